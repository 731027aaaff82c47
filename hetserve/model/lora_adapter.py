"""A PEFT LoRA adapter directory, read and checked: `adapter_config.json` and
`adapter_model.safetensors` as `PeftModel.save_pretrained` writes them.

Who calls it: the engine's LoRA manager (serving) and `hetserve export` (merging). It knows
nothing of the model: module names are the HF ones PEFT saves (`model.layers.0.self_attn.q_proj`);
whether the model has them is the caller's check. Every refusal is a one-line `ModelLoadError`
naming the adapter, the problem and the fix.

Scaling follows PEFT: `lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`), with per-module
`rank_pattern` / `alpha_pattern` overrides matched as PEFT matches them (the pattern is a suffix of
the module name at a dot boundary). `fan_in_fan_out` concerns only how a base layer stores its
weight (GPT-2's Conv1D); on `nn.Linear` PEFT turns it off itself and the A/B matrices are the same,
so it changes nothing here.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from hetserve.errors import ModelLoadError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's names
_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(\.default)?\.weight$")
_MAGNITUDE = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector(\.default)?(\.weight)?$")
_EXPERTS = re.compile(r"(^|\.)experts(\.|$)")
# Initialisations that rewrite the base weights: the adapter only works on that rewritten base.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")
# Config keys whose (truthy) value changes the forward beyond plain LoRA: (key, what it is).
_UNSERVABLE = (
    ("modules_to_save", "full copies of modules trained beside the adapter"),
    ("trainable_token_indices", "trained embedding rows"),
    ("lora_bias", "a bias on lora_B"),
    ("alora_invocation_tokens", "activated LoRA, which applies only after invocation tokens"),
    ("layer_replication", "replicated layers"),
    ("use_qalora", "QALoRA"),
    ("use_bdlora", "block-diagonal LoRA"),
    ("arrow_config", "Arrow routing between adapters"),
    ("kasa_config", "KaSA"),
    ("monteclora_config", "MonteCLoRA"),
)


@dataclass(frozen=True)
class LoRAWeights:
    """One module's adapter: delta W = scale * b @ a (DoRA adds a magnitude per output row)."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float
    magnitude: torch.Tensor | None = None  # [out], DoRA only

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    path: Path
    id: str  # content id: the same weights and scaling give the same id wherever they live
    modules: dict[str, LoRAWeights]  # HF module name -> its weights (fp32, CPU)
    use_dora: bool

    @property
    def rank(self) -> int:
        return max(w.rank for w in self.modules.values())


def read_adapter(path: str | Path, allow_dora: bool = False) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter directory. DoRA only where `allow_dora` (merging):
    its per-row normalisation depends on the base weight, so it cannot be served as a delta."""
    root = Path(path)
    cfg = _read_config(root)
    use_dora = bool(cfg.get("use_dora"))
    if use_dora and not allow_dora:
        raise ModelLoadError(
            f"LoRA adapter {str(root)!r} is DoRA (use_dora: true), which cannot be served next to "
            f"other adapters; merge it into the weights with `hetserve export --model MODEL "
            f"--adapter {root} --out DIR` and serve that"
        )
    state, digest = _read_weights(root)
    modules = _modules(root, cfg, state, use_dora)
    scales = sorted((name, w.scale) for name, w in modules.items())
    digest.update(json.dumps({"scales": scales, "dora": use_dora}).encode())
    return LoRAAdapter(root, digest.hexdigest()[:32], modules, use_dora)


def _read_config(root: Path) -> dict:
    what = f"LoRA adapter {str(root)!r}"
    try:
        if not root.is_dir():
            raise ModelLoadError(
                f"{what} is not a directory; give a PEFT adapter directory "
                f"({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})"
            )
        text = (root / ADAPTER_CONFIG).read_text()
    except FileNotFoundError:
        raise ModelLoadError(
            f"{what} has no {ADAPTER_CONFIG}; save the adapter with PeftModel.save_pretrained"
        ) from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{what} cannot be read: {exc}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{what}: {ADAPTER_CONFIG} is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{what}: {ADAPTER_CONFIG} must hold a JSON object")
    _check_config(what, cfg)
    return cfg


def _check_config(what: str, cfg: dict) -> None:
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise ModelLoadError(f"{what} is a {kind} adapter; only LoRA adapters can be used")
    if cfg.get("target_parameters"):
        raise ModelLoadError(
            f"{what} puts LoRA on parameters ({cfg['target_parameters']}), i.e. on routed "
            "experts, which run on the expert kernels; train it on attention and dense MLPs"
        )
    for key, meaning in _UNSERVABLE:
        if cfg.get(key):
            raise ModelLoadError(f"{what} sets {key} ({meaning}), which hetserve cannot use")
    if cfg.get("bias", "none") != "none":
        raise ModelLoadError(
            f"{what} trains biases (bias: {cfg['bias']!r}), which hetserve cannot use; "
            "train with bias: none"
        )
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise ModelLoadError(
            f"{what} was initialised with {init!r}, which rewrites the base weights; convert "
            "it to a plain LoRA first (PEFT's path_initial_model_for_weight_conversion)"
        )
    for key in ("r", "lora_alpha"):
        value = cfg.get(key, 8)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelLoadError(f"{what}: {ADAPTER_CONFIG} has {key}={value!r}; need > 0")


def _read_weights(root: Path) -> tuple[dict[str, torch.Tensor], hashlib._Hash]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    what = f"LoRA adapter {str(root)!r}"
    path = root / ADAPTER_WEIGHTS
    if not path.is_file():
        legacy = " (it has adapter_model.bin: re-save with safe_serialization)"
        hint = legacy if (root / "adapter_model.bin").is_file() else ""
        raise ModelLoadError(f"{what} has no {ADAPTER_WEIGHTS}{hint}")
    data = path.read_bytes()
    try:
        state = load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(
            f"{what}: {ADAPTER_WEIGHTS} is not a safetensors file ({exc})"
        ) from None
    return state, hashlib.sha256(data)


def _modules(root: Path, cfg: dict, state: dict, use_dora: bool) -> dict[str, LoRAWeights]:
    what = f"LoRA adapter {str(root)!r}"
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        name = key.removeprefix(PEFT_PREFIX)
        if "lora_embedding_" in name:
            raise ModelLoadError(f"{what} has LoRA on an embedding ({name}); it cannot be used")
        m = _KEY.match(name)
        kind = m["kind"] if m else None
        if m is None and use_dora and (m := _MAGNITUDE.match(name)) is not None:
            kind = "magnitude"
        if m is None:
            raise ModelLoadError(f"{what} holds {key!r}, which is not a LoRA weight")
        module = m["module"]
        if _EXPERTS.search(module):
            raise ModelLoadError(
                f"{what} has LoRA on routed experts ({module}), which run on the expert kernels; "
                "train it on attention and dense/shared MLPs"
            )
        parts.setdefault(module, {})[kind] = tensor
    if not parts:
        raise ModelLoadError(f"{what}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    return {name: _module(what, cfg, name, got, use_dora) for name, got in sorted(parts.items())}


def _module(what: str, cfg: dict, name: str, got: dict, use_dora: bool) -> LoRAWeights:
    need = ("lora_A", "lora_B", "magnitude") if use_dora else ("lora_A", "lora_B")
    missing = [k for k in need if k not in got]
    if missing:
        raise ModelLoadError(f"{what}: module {name} lacks its {missing[0]} tensor")
    a, b = got["lora_A"].float(), got["lora_B"].float()
    rank = _pattern(cfg.get("rank_pattern"), name, cfg.get("r", 8))
    alpha = _pattern(cfg.get("alpha_pattern"), name, cfg.get("lora_alpha", 8))
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise ModelLoadError(
            f"{what}: module {name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
            f"not rank {rank} as {ADAPTER_CONFIG} says"
        )
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    magnitude = got["magnitude"].float().flatten() if use_dora else None
    if magnitude is not None and magnitude.shape[0] != b.shape[0]:
        raise ModelLoadError(f"{what}: module {name}'s DoRA magnitude does not match lora_B")
    return LoRAWeights(a.contiguous(), b.contiguous(), float(scale), magnitude)


def _pattern(patterns: dict | None, module: str, default):
    """PEFT's per-module override: the first pattern that is a dotted suffix of the name."""
    for key, value in (patterns or {}).items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as exc:
            raise ModelLoadError(
                f"LoRA adapter pattern {key!r} is not a valid regex: {exc}"
            ) from None
    return default
