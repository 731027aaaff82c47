"""`hetserve convert`: write a model's routed experts in a CPU format (`converted.py`).

The output directory holds the non-expert tensors (`model.safetensors`), the routed experts
quantized per layer, and config.json with a `hetserve_experts` entry naming the format, file
and layout:

- `--layout kernel` (default): `experts-<format>.hsk`, the native kernels' own bytes
  (`quant/kernel_file.py`), which the loader maps and the kernels read in place. Each layer is
  quantized as the portable file stores it, dequantized, and laid out by the very backend that
  serves it (`kernel_layout()`), so serving the file is bit-equal to serving the portable one.
  The file also holds the dense linears as the all-int8 placement serves them (int8 per row,
  in the kernel's quads, rounded from float32 as a load would round them), so serving it on a
  CPU maps those too; model.safetensors keeps them in float32 for the other placements.
- `--layout portable`: `experts-<format>.safetensors`, int8 per output channel or int4 groups
  with a minimum, two nibbles per byte; loading dequantizes them and the CPU backend
  quantizes them again, which reproduces the stored integers exactly (symmetric int8 and
  min/max int4 are idempotent). Any backend, any machine, no native kernels needed.

The checkpoint is read by the streaming loader: each experts layer is converted as soon as its
tensors are in and dropped before the next is read, so the peak is the rest of the model in
float32 plus one layer (1.7 B MoE: 3.0 GB, where loading it whole took 8.8 GB). Failure: a
one-line InvalidInputError (no routed experts, a bad format or group size, OUT_DIR = MODEL_DIR)
before anything is written; the loader's ModelLoadError for a broken checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from hetserve.errors import InvalidInputError
from hetserve.model.loader import load_model
from hetserve.model.st_file import save_safetensors
from hetserve.moe.placement import default_rules
from hetserve.quant.converted import CONFIG_KEY, FORMATS, dequantize, quantize
from hetserve.quant.kernel_file import FORMAT, LAYOUT_VERSION, SUFFIX, LinearLayout
from hetserve.quant.quantize import INT4_GROUP_SIZES

# What the output does not take from the source directory as it is: the weights (written anew)
# and config.json (rewritten); everything else (tokenizer files of any kind: tokenizer.json,
# Kimi's tiktoken.model, chat templates, generation config) is copied.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".hsk")
_NOT_COPIED = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


LAYOUTS = ("kernel", "portable")


def convert(
    model_dir: str | Path,
    out_dir: str | Path,
    fmt: str,
    group_size: int = 64,
    layout: str = "kernel",
) -> Path:
    if layout not in LAYOUTS:
        raise InvalidInputError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if fmt not in FORMATS:
        raise InvalidInputError(f"--quant must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "int4" and group_size not in INT4_GROUP_SIZES:
        raise InvalidInputError(f"--group-size must be one of {INT4_GROUP_SIZES}")
    src, out = Path(model_dir), Path(out_dir)
    if out.resolve() == src.resolve():
        raise InvalidInputError("OUT_DIR must differ from MODEL_DIR")
    if not _has_routed_experts(src):
        raise InvalidInputError(f"{src} has no routed experts to convert")
    # Written beside OUT_DIR and renamed to it once whole: a failure or a Ctrl-C part way leaves
    # no half-written OUT_DIR that a second run would refuse as not empty.
    final = out
    out = out.parent / f".{out.name}.converting-{os.getpid()}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        _convert_into(src, out, fmt, group_size, layout)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    if final.is_dir():
        final.rmdir()  # empty (the caller's check): the whole result takes its place
    out.rename(final)
    return final


def _convert_into(src: Path, out: Path, fmt: str, group_size: int, layout: str) -> None:
    sink: _KernelSink | _PortableSink = (
        _KernelSink(out, fmt, group_size) if layout == "kernel" else _PortableSink(fmt, group_size)
    )
    # Streamed: each experts layer is converted as soon as its tensors are in and let go before
    # the next is read (experts a checkpoint stores quantized, FP8 ..., stay packed and are
    # converted expert by expert), so the peak is the rest of the model plus one layer.
    model = load_model(
        src, device="cpu", dtype="float32", placement=default_rules("cpu-int8"),
        experts_ready=lambda plan, name, ex: sink.add(plan, name, ex), expert_backends=False,
    )  # fmt: skip
    _write_rest(model, out)
    entry = sink.close(model, out)
    cfg = json.loads((src / "config.json").read_text())
    for key in ("quantization_config", "compression_config"):  # the rest is now fp32
        cfg.pop(key, None)
    cfg[CONFIG_KEY] = {
        "format": fmt,
        "group_size": group_size if fmt == "int4" else None,
        "file": entry,
    }
    if layout == "kernel":
        cfg[CONFIG_KEY].update(layout="kernel", layout_version=LAYOUT_VERSION)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for path in src.iterdir():
        if path.is_file() and path.name not in _NOT_COPIED and path.suffix not in _WEIGHT_SUFFIXES:
            shutil.copy2(path, out / path.name)


def _quantize_experts(name: str, weights, fmt: str, group_size: int) -> dict[str, torch.Tensor]:
    """One layer's experts in the converted format, quantized one expert at a time."""
    parts: dict[str, list[dict[str, torch.Tensor]]] = {"w13": [], "w2": []}
    for e in range(weights.num_experts):
        for pname, w in zip(("w13", "w2"), weights.expert(e), strict=True):
            if fmt == "int4" and w.shape[-1] % group_size:
                fits = [g for g in INT4_GROUP_SIZES if w.shape[-1] % g == 0]
                raise InvalidInputError(
                    f"{name}.{pname}: input size {w.shape[-1]} is not a "
                    f"multiple of --group-size {group_size}"
                    + (f"; use --group-size {max(fits)}" if fits else "")
                )
            parts[pname].append(quantize(w[None], fmt, group_size))
    return {
        f"{name}.{pname}_{suffix}": torch.cat([p[suffix] for p in per_expert]).contiguous()
        for pname, per_expert in parts.items()
        for suffix in per_expert[0]
    }


def _dense_layouts(model) -> list[tuple[str, LinearLayout]]:
    """The dense linears as the all-int8 placement serves them (build.apply_dense_backends on
    this fp32 model, which it changes: called once the rest is written), by module path."""
    from hetserve.layers.int8_linear import Int8Linear
    from hetserve.model.build import apply_dense_backends
    from hetserve.model.hybrid_plan import plan_placement
    from hetserve.moe.presets import preset_rules

    apply_dense_backends(
        model, plan_placement(model, preset_rules("all-int8"), torch.device("cpu"))
    )
    return [(name, m.kernel_layout()) for name, m in model.named_modules()
            if isinstance(m, Int8Linear) and m.kernel == "native" and m.kind == "int8"
            and not m.group]  # fmt: skip


def _has_routed_experts(src: Path) -> bool:
    """Whether the checkpoint's architecture has routed experts (built on meta: nothing read)."""
    from hetserve.model.loader import _no_init, open_checkpoint
    from hetserve.model.registry import model_class

    cfg, _ = open_checkpoint(src)
    with torch.device("meta"), _no_init():
        return any(True for _ in model_class(cfg.architecture)(cfg).routed_experts())


class _KernelSink:
    """The kernel-layout file, written as the layers arrive: each experts module quantized as the
    portable file stores it, dequantized and laid out by the very backend that serves it (so
    serving the file is bit-equal to serving the portable one), then the dense linears."""

    def __init__(self, out: Path, fmt: str, group_size: int) -> None:
        from hetserve.native import native_unavailable_reason

        reason = native_unavailable_reason()
        if reason is not None:
            raise InvalidInputError(
                f"--layout kernel needs the native kernels, unavailable here ({reason}); "
                "use --layout portable"
            )
        self.fmt, self.group_size = fmt, group_size
        self.name = f"experts-{fmt}{SUFFIX}"
        self.path = out / self.name
        self.writer = None
        self.bar = tqdm(desc=f"laying out experts as {fmt}", unit="layer")

    def add(self, plan, prefix: str, ex) -> None:
        from hetserve.model.kernel_file import KernelFileWriter
        from hetserve.moe.experts import ExpertWeights, create_backend
        from hetserve.native import isa

        fmt, group_size = self.fmt, self.group_size
        if self.writer is None:
            group = group_size if fmt == "int4" else 0
            meta = {"format": FORMAT, "version": LAYOUT_VERSION, "quant": fmt,
                    "group_size": group, "isa": isa()}  # fmt: skip
            # the header's room: ~1 KiB per experts module, as much again for the dense linears
            names = list(_experts_units(plan))
            self.writer = KernelFileWriter(self.path, meta, names + names)
            self.bar.reset(total=len(names))
        w = ex.weights()
        stored = _quantize_experts(prefix, w, fmt, group_size)
        dense = [
            dequantize({k.rsplit("_", 1)[1]: v for k, v in stored.items()
                        if k.startswith(f"{prefix}.{p}_")}, fmt, group_size)
            for p in ("w13", "w2")
        ]  # fmt: skip
        del stored
        options = {"group_size": group_size} if fmt == "int4" else {}
        backend = create_backend(
            f"cpu-{fmt}", ExpertWeights(*dense, w.b13, w.b2), activation=ex.activation,
            kernel="native", **options,
        )  # fmt: skip
        self.writer.add(prefix, backend.kernel_layout())
        del backend, dense, w
        ex.release_weights()  # the layer's loaded copy goes before the next is read
        self.bar.update()

    def close(self, model, out: Path) -> str:
        self.bar.close()
        for name, lay in _dense_layouts(model):
            self.writer.add_linear(name, lay, "float32")
        self.writer.close()
        return self.name


def _experts_units(plan):
    """The names of the routed-experts modules a placement plan holds."""
    from hetserve.layers.moe import FusedExperts

    return (n for n, u in plan.units.items() if isinstance(u, FusedExperts))


class _PortableSink:
    """`--layout portable`: the experts' int8 / int4 tensors, collected layer by layer (the
    stored size, never the layers in full precision) and written as one safetensors file."""

    def __init__(self, fmt: str, group_size: int) -> None:
        self.fmt, self.group_size = fmt, group_size
        self.stored: dict[str, torch.Tensor] = {}
        self.bar = tqdm(desc=f"quantizing experts to {fmt}", unit="layer")

    def add(self, plan, prefix: str, ex) -> None:
        if self.bar.total is None:
            self.bar.reset(total=sum(1 for _ in _experts_units(plan)))
        self.stored.update(_quantize_experts(prefix, ex.weights(), self.fmt, self.group_size))
        ex.release_weights()
        self.bar.update()

    def close(self, model, out: Path) -> str:
        self.bar.close()
        entry = f"experts-{self.fmt}.safetensors"
        save_safetensors(self.stored, str(out / entry), metadata={"format": "pt"})
        return entry


def _write_rest(model, out: Path) -> None:
    expert_params = {f"{n}.{p}" for n, _ in model.routed_experts() for p in ("w13", "w2")}
    rest = {}
    for name, p in model.named_parameters():
        if name in expert_params:
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        rest[name] = model.published_value(name, p.data).contiguous()
    save_safetensors(rest, str(out / "model.safetensors"), metadata={"format": "pt"})
