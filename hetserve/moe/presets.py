"""Named placements and the `auto` choice between them: pure policy (facts in, decision out).

Who calls it: `model/build.py` at engine start-up (it measures the facts: accelerator memory,
checkpoint bytes, whether the native kernels build) and the loader (`preset_rules`, once it
knows which backend reads a checkpoint's packed experts). `--placement` takes one of
`PRESETS`, the legacy alias `default` (= hybrid) or a YAML rules file (moe/placement.py).

- `device`: every weight on the engine device in the engine's dtype; the reference, exact
  against transformers (packed checkpoints keep their experts' own CPU format).
- `hybrid`: routed experts on the CPU int8 kernel (or the checkpoint's packed format), the rest
  on the engine device: KTransformers' split.
- `all-int8`: CPU only; routed experts and every other linear on the native int8 kernels;
  what a layer declares `precise_projections` (linear attention's input projections: plain
  int8 there moved a tiny Qwen3-Next's logprobs as far as all the rest together; see
  layers/linear_attention.py) keeps an int8 residual too (16-bit class, 2 bytes a weight).
- `auto` (the default): no accelerator -> all-int8 where the native kernels build (else
  device); an accelerator -> device where the weights fit it with room for the KV cache, else
  hybrid; an explicit `--dtype float32` asks for exactness -> device.

Failure: an unknown name is not an error here (the caller treats it as a rules file path);
`choose_placement` never raises.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetserve.moe.placement import PlacementRule, default_rules

PRESETS = ("auto", "device", "hybrid", "all-int8")
ALIASES = {"default": "hybrid"}
# Share of the accelerator's memory the weights and the KV budget may take together under
# `auto`: the rest is activations, the allocator's slack and other processes.
ACCELERATOR_FILL = 0.9
_EXACT_DTYPES = ("float32", "fp32")


def preset_name(placement: str) -> str | None:
    """The preset `placement` names (aliases resolved), or None for a rules file path."""
    name = ALIASES.get(placement, placement)
    return name if name in PRESETS else None


@dataclass(frozen=True)
class PlacementFacts:
    """What `auto` decides from, measured by the caller."""

    accelerator: str | None  # "cuda" / "cuda:N" when the engine runs on one, else None
    accelerator_bytes: int = 0  # its total memory
    weight_bytes: int = 0  # the checkpoint's weights at the engine's dtype
    kv_bytes: int = 0  # the KV cache budget the engine will allocate
    dtype: str = "auto"  # as the user gave it
    native_unavailable: str | None = None  # why the native kernels do not build here, if so


@dataclass(frozen=True)
class PlacementChoice:
    requested: str  # what the user asked for (a preset, an alias or a path)
    preset: str | None  # device | hybrid | all-int8; None for a rules file
    reason: str

    def line(self) -> str:
        """The one line printed at start-up."""
        what = self.preset or f"rules file {self.requested}"
        via = f" (auto: {self.reason})" if self.requested == "auto" else ""
        hint = "" if self.preset == "device" else "; --placement device for exact fp32"
        return f"placement: {what}{via}{hint}"


def choose_placement(requested: str, facts: PlacementFacts) -> PlacementChoice:
    name = preset_name(requested)
    if name != "auto":
        return PlacementChoice(requested, name, "asked for")
    if facts.dtype in _EXACT_DTYPES:
        return PlacementChoice(requested, "device", f"--dtype {facts.dtype} asks for exactness")
    if facts.accelerator is None:
        if facts.dtype != "auto":
            return PlacementChoice(requested, "device", f"--dtype {facts.dtype} on the CPU")
        if facts.native_unavailable is not None:
            why = f"no accelerator, native kernels unavailable ({facts.native_unavailable})"
            return PlacementChoice(requested, "device", why)
        return PlacementChoice(
            requested, "all-int8", "no accelerator: experts and linears on native int8 kernels"
        )
    need = facts.weight_bytes + facts.kv_bytes
    room = int(facts.accelerator_bytes * ACCELERATOR_FILL)
    gib = 1 << 30
    sizes = f"{need / gib:.1f} GiB of weights and KV, {room / gib:.1f} GiB usable"
    if need <= room:
        return PlacementChoice(requested, "device", f"fits {facts.accelerator}: {sizes}")
    return PlacementChoice(
        requested, "hybrid", f"routed experts on the CPU: {sizes} on {facts.accelerator}"
    )


def preset_rules(preset: str, expert_backend: str = "cpu-int8") -> list[PlacementRule] | None:
    """The rules of a preset (None for `device`: no rules, everything on the engine device);
    `expert_backend` serves the routed experts (a packed checkpoint's own format's backend)."""
    preset = ALIASES.get(preset, preset)
    if preset == "device":
        return None
    if preset == "hybrid":
        return default_rules(expert_backend)
    if preset == "all-int8":
        experts, _ = default_rules(expert_backend)
        return [
            experts,
            PlacementRule(name="int8-linears", match=r".*", device="cpu", backend="cpu-int8"),
        ]
    raise ValueError(f"{preset!r} is not a placement preset ({', '.join(PRESETS[1:])})")
