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

A kernel-layout file may also hold the dense linears as the all-int8 placement serves them
(`attach_linears`): where the placement gives a linear's unit the native int8 kernel and the
model is in the dtype they were rounded from, its Int8Linear reads the mapped bytes and the
checkpoint's full-precision copy of the weight (still in model.safetensors, for placements that
serve it) is never read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hetserve import envs
from hetserve.errors import MissingTensorError, ModelLoadError
from hetserve.model.filler import ExpertsReady
from hetserve.model.st_file import SafetensorsFile
from hetserve.quant.converted import CONFIG_KEY, dequantize

__all__ = ["CONFIG_KEY", "attach_linears", "is_mapped", "load_converted_experts", "open_mapped"]


def is_mapped(spec: dict | None) -> bool:
    """Whether a `hetserve_experts` entry names a kernel-layout file (loaded by mapping)."""
    return spec is not None and spec.get("layout") == "kernel"


def load_converted_experts(
    model, model_dir: Path, spec: dict, experts_ready: ExpertsReady | None = None, mapped=None
) -> None:
    """Fill every routed-experts module from the converted file (called by the loader), one
    module at a time: with `experts_ready`, each module's backend is built from it (and its
    dequantized copy dropped) before the next module is read. `mapped`: the kernel-layout
    file, where the loader opened it already (`open_mapped`)."""
    if is_mapped(spec):
        _map_experts(model, mapped or open_mapped(model_dir, spec), experts_ready)
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


def open_mapped(model_dir: Path, spec: dict):
    """The kernel-layout file a `hetserve_experts` entry names, mapped (MappedKernelFile)."""
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
    return mapped


def attach_linears(model, mapped, dtype: torch.dtype) -> set[str]:
    """Hands each dense linear the mapped file stores (as the all-int8 placement serves it) its
    layout as `mapped_layout`, where the model's placement gives its unit the native int8 kernel
    and the model is in `dtype`, the one its numbers were rounded from; the parts of a fused
    linear (q, k, v of `qkv_proj`) all get the fused one. Their weights become unallocated
    (meta): build.apply_dense_backends makes their Int8Linears of the layouts. Returns the
    weights' parameter names, which the loader then does not read. Called by the loader after
    placing, before reading; a stored linear whose sizes do not match config.json is a
    ModelLoadError of one line."""
    from torch import nn

    from hetserve.layers.moe import FusedExperts

    plan = getattr(model, "hybrid_plan", None)
    names = mapped.linear_names()
    if plan is None or not names:
        return set()
    units = [
        n
        for n, u in plan.units.items()
        if not isinstance(u, FusedExperts) and plan.placement.get(n).backend is not None
    ]
    modules = dict(model.named_modules())
    skipped: set[str] = set()
    for name in names:
        if mapped.linear_dtype(name) != str(dtype).removeprefix("torch."):  # bf16: rounded anew
            continue
        if not any(name == u or name.startswith(f"{u}.") for u in units):
            continue  # served otherwise: its weight is read as before
        parent_name, _, leaf = name.rpartition(".")
        parent = modules.get(parent_name)
        if parent is None:
            continue
        declared = getattr(parent, "fused_projections", None)
        parts = (declared() if declared else {}).get(leaf, (leaf,))
        lins = [getattr(parent, p, None) for p in parts]
        if not all(type(lin) is nn.Linear for lin in lins):
            continue
        layout = mapped.linear(name)
        if (layout.in_features, layout.out_features) != (
            lins[0].in_features, sum(lin.out_features for lin in lins)
        ):  # fmt: skip
            raise ModelLoadError(
                f"{mapped.path.name}: the linear {name!r} does not match config.json; "
                "re-run hetserve convert"
            )
        for p, lin in zip(parts, lins, strict=True):
            if not lin.weight.is_meta:  # a kept-precise projection: allocated, never filled
                lin.weight = nn.Parameter(lin.weight.to("meta"), requires_grad=False)
            lin.mapped_layout = layout
            skipped.add(f"{parent_name}.{p}.weight" if parent_name else f"{p}.weight")
    return skipped


def _map_experts(model, mapped, experts_ready: ExpertsReady | None) -> None:
    spec_file = mapped.path.name
    for name, ex in model.routed_experts():
        layout = mapped.module(name)
        if (layout.num_experts, layout.hidden, layout.inter) != (
            ex.num_experts, ex.hidden_size, ex.intermediate_size,
        ):  # fmt: skip
            raise ModelLoadError(
                f"{spec_file}: the experts of {name!r} do not match config.json; "
                "re-run hetserve convert"
            )
        ex.layout = layout  # views into the mapping: the backend reads them in place
        if experts_ready is not None:
            experts_ready(name, ex)
    mapped.mark_verified()  # every module's digests passed: not read again for this version
