"""Reading the converted-experts file that `hetserve convert` writes (the format itself:
`quant/converted.py`): config.json's `hetserve_experts` entry names the format and file."""

from __future__ import annotations

from pathlib import Path

import torch

from hetserve.errors import MissingTensorError
from hetserve.model.filler import ExpertsReady
from hetserve.model.st_file import SafetensorsFile
from hetserve.quant.converted import CONFIG_KEY, dequantize

__all__ = ["CONFIG_KEY", "load_converted_experts"]


def load_converted_experts(
    model, model_dir: Path, spec: dict, experts_ready: ExpertsReady | None = None
) -> None:
    """Fill every routed-experts module from the converted file (called by the loader), one
    module at a time: with `experts_ready`, each module's backend is built from it (and its
    dequantized copy dropped) before the next module is read."""
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
