"""Reading the converted-experts files that `hetserve convert` writes: config.json's
`hetserve_experts` entry names the format and file. Two layouts:

- `"layout": "kernel"` (the default since issue 42): the native kernels' own bytes
  (`quant/kernel_file.py`), mapped read-only and handed to each module's backend in place: no
  expert is ever materialized, nothing is copied, and every process serving the file shares
  its pages. A layout version this hetserve does not read is a one-line error asking to re-run
  convert (no fallback: the file holds no other form of the weights).
- otherwise (`--layout portable`, and files written before): int8 per output channel or int4
  groups in safetensors (`quant/converted.py`), dequantized into the experts module and
  quantized again by whichever backend serves them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hetserve import envs
from hetserve.errors import MissingTensorError, ModelLoadError
from hetserve.model.filler import ExpertsReady
from hetserve.model.st_file import SafetensorsFile
from hetserve.quant.converted import CONFIG_KEY, dequantize

__all__ = ["CONFIG_KEY", "is_mapped", "load_converted_experts"]


def is_mapped(spec: dict | None) -> bool:
    """Whether a `hetserve_experts` entry names a kernel-layout file (loaded by mapping)."""
    return spec is not None and spec.get("layout") == "kernel"


def load_converted_experts(
    model, model_dir: Path, spec: dict, experts_ready: ExpertsReady | None = None
) -> None:
    """Fill every routed-experts module from the converted file (called by the loader), one
    module at a time: with `experts_ready`, each module's backend is built from it (and its
    dequantized copy dropped) before the next module is read."""
    if is_mapped(spec):
        _map_experts(model, model_dir, spec, experts_ready)
        return
    fmt, group = spec["format"], spec.get("group_size") or 0
    with SafetensorsFile(model_dir / spec["file"]) as f:
        names = f.keys()
        for name, ex in model.routed_experts():
            ex.materialize(torch.device("cpu"))
            for pname in ("w13", "w2"):
                prefix = f"{name}.{pname}_"
                parts = {k[len(prefix) :]: f.read(k) for k in names if k.startswith(prefix)}
                if "q" not in parts:
                    raise MissingTensorError(f"{spec['file']} lacks '{prefix}q'; re-run convert")
                dst = getattr(ex, pname).data
                if fmt == "int8":  # in place: no layer-sized fp32 temporaries beside dst
                    dst.copy_(parts["q"]).mul_(parts["scale"].unsqueeze(-1))
                else:
                    dst.copy_(dequantize(parts, fmt, group))
                del parts
            if experts_ready is not None:
                experts_ready(name, ex)


def _map_experts(model, model_dir: Path, spec: dict, experts_ready: ExpertsReady | None) -> None:
    from hetserve.model.kernel_file import MappedKernelFile

    path = model_dir / spec["file"]
    if not path.is_file():
        raise MissingTensorError(f"{spec['file']} is missing from {model_dir}; re-run convert")
    when = envs.verify_converted()
    mapped = MappedKernelFile(path, verify=when != "never", remember=when == "once")
    if mapped.header.get("quant") != spec["format"]:
        raise ModelLoadError(
            f"{spec['file']} holds {mapped.header.get('quant')!r} experts, config.json says "
            f"{spec['format']!r}; re-run hetserve convert"
        )
    for name, ex in model.routed_experts():
        layout = mapped.module(name)
        if (layout.num_experts, layout.hidden, layout.inter) != (
            ex.num_experts, ex.hidden_size, ex.intermediate_size,
        ):  # fmt: skip
            raise ModelLoadError(
                f"{spec['file']}: the experts of {name!r} do not match config.json; "
                "re-run hetserve convert"
            )
        ex.layout = layout  # views into the mapping: the backend reads them in place
        if experts_ready is not None:
            experts_ready(name, ex)
    mapped.mark_verified()  # every module's digests passed: not read again for this version
