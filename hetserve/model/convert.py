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
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from hetserve.errors import InvalidInputError
from hetserve.model.loader import load_model
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
    # Experts a checkpoint stores quantized (FP8, ...) stay packed and are converted expert
    # by expert below: no full-precision copy of them exists at any time.
    model = load_model(src, device="cpu", dtype="float32", expert_backends=False)
    experts = list(model.routed_experts())
    if not experts:
        raise InvalidInputError(f"{src} has no routed experts to convert")
    out.mkdir(parents=True, exist_ok=True)
    _write_rest(model, out)
    if layout == "kernel":
        entry = write_kernel_layout(experts, out, fmt, group_size, _dense_layouts(model))
    else:
        stored: dict[str, torch.Tensor] = {}
        for name, ex in tqdm(experts, desc=f"quantizing experts to {fmt}"):
            stored.update(_quantize_experts(name, ex.weights(), fmt, group_size))
        entry = f"experts-{fmt}.safetensors"
        save_file(stored, str(out / entry), metadata={"format": "pt"})
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
    return out


def _quantize_experts(name: str, weights, fmt: str, group_size: int) -> dict[str, torch.Tensor]:
    """One layer's experts in the converted format, quantized one expert at a time."""
    parts: dict[str, list[dict[str, torch.Tensor]]] = {"w13": [], "w2": []}
    for e in range(weights.num_experts):
        for pname, w in zip(("w13", "w2"), weights.expert(e), strict=True):
            if fmt == "int4" and w.shape[-1] % group_size:
                raise InvalidInputError(
                    f"{name}.{pname}: input size {w.shape[-1]} is not a "
                    f"multiple of --group-size {group_size}"
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
            if isinstance(m, Int8Linear) and m.kernel == "native" and m.fmt == 1
            and not m.group]  # fmt: skip


def write_kernel_layout(
    experts: list,
    out: Path,
    fmt: str,
    group_size: int,
    linears: list[tuple[str, LinearLayout]] = (),
) -> str:
    """Writes the kernel-layout file: the dense `linears` (rounded from float32), then the
    experts a layer at a time; returns its name."""
    from hetserve.model.kernel_file import KernelFileWriter
    from hetserve.moe.experts import ExpertWeights, create_backend
    from hetserve.native import isa, native_unavailable_reason

    reason = native_unavailable_reason()
    if reason is not None:
        raise InvalidInputError(
            f"--layout kernel needs the native kernels, unavailable here ({reason}); "
            "use --layout portable"
        )
    name = f"experts-{fmt}{SUFFIX}"
    group = group_size if fmt == "int4" else 0
    meta = {"format": FORMAT, "version": LAYOUT_VERSION, "quant": fmt, "group_size": group,
            "isa": isa()}  # fmt: skip
    writer = KernelFileWriter(out / name, meta, [p for p, _ in [*linears, *experts]])
    for lin_name, lay in linears:
        writer.add_linear(lin_name, lay, "float32")
    options = {"group_size": group_size} if fmt == "int4" else {}
    for prefix, ex in tqdm(experts, desc=f"laying out experts as {fmt}"):
        w = ex.weights()
        stored = _quantize_experts(prefix, w, fmt, group_size)
        # what loading the portable file gives (the same dequantize): bit-equal serving
        dense = [
            dequantize({k.rsplit("_", 1)[1]: v for k, v in stored.items()
                        if k.startswith(f"{prefix}.{p}_")}, fmt, group_size)
            for p in ("w13", "w2")
        ]  # fmt: skip
        del stored
        backend = create_backend(
            f"cpu-{fmt}", ExpertWeights(*dense, w.b13, w.b2), activation=ex.activation,
            kernel="native", **options,
        )  # fmt: skip
        writer.add(prefix, backend.kernel_layout())
        del backend, dense
    writer.close()
    return name


def _write_rest(model, out: Path) -> None:
    expert_params = {f"{n}.{p}" for n, _ in model.routed_experts() for p in ("w13", "w2")}
    rest = {}
    for name, p in model.named_parameters():
        if name in expert_params:
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        rest[name] = model.published_value(name, p.data).contiguous()
    save_file(rest, str(out / "model.safetensors"), metadata={"format": "pt"})
