"""Reading the converted-experts file that `hetserve convert` writes (the format itself:
`quant/converted.py`): config.json's `hetserve_experts` entry names the format and file."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from hetserve.errors import MissingTensorError
from hetserve.quant.converted import CONFIG_KEY, dequantize

__all__ = ["CONFIG_KEY", "load_converted_experts"]


def load_converted_experts(model, model_dir: Path, spec: dict) -> None:
    """Fill every routed-experts module from the converted file (called by the loader)."""
    fmt, group = spec["format"], spec.get("group_size") or 0
    with safe_open(str(model_dir / spec["file"]), framework="pt", device="cpu") as f:
        names = set(f.keys())
        for name, ex in model.routed_experts():
            for pname in ("w13", "w2"):
                prefix = f"{name}.{pname}_"
                parts = {k[len(prefix) :]: f.get_tensor(k) for k in names if k.startswith(prefix)}
                if "q" not in parts:
                    raise MissingTensorError(f"{spec['file']} lacks '{prefix}q'; re-run convert")
                getattr(ex, pname).data.copy_(dequantize(parts, fmt, group))
