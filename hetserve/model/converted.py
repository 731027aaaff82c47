"""The converted-experts file format that `hetserve convert` writes (`convert.py`) and the
loader reads: config.json's `hetserve_experts` entry names the format and file; the file holds,
per routed-experts module and matrix (`w13`, `w2`), int8 per output channel (`_q`, `_scale`) or
int4 groups with a minimum, two nibbles per byte (`_q`, `_scale`, `_min`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from hetserve.errors import MissingTensorError
from hetserve.moe.quant import quantize_int4_groupwise, quantize_int8_per_channel

FORMATS = ("int8", "int4")
CONFIG_KEY = "hetserve_experts"


def quantize(w: torch.Tensor, fmt: str, group_size: int) -> dict[str, torch.Tensor]:
    """w [E, N, K] -> stored tensors (suffix -> tensor)."""
    e, n, k = w.shape
    flat = w.reshape(e * n, k)
    if fmt == "int8":
        q, scale = quantize_int8_per_channel(flat)
        return {"q": q.reshape(e, n, k), "scale": scale.reshape(e, n)}
    q, scale, lo = quantize_int4_groupwise(flat, group_size)
    q = q.to(torch.uint8).reshape(e, n, k // 2, 2)
    packed = q[..., 0] | (q[..., 1] << 4)
    g = k // group_size
    return {"q": packed, "scale": scale.reshape(e, n, g), "min": lo.reshape(e, n, g)}


def dequantize(t: dict[str, torch.Tensor], fmt: str, group_size: int) -> torch.Tensor:
    q = t["q"]
    if fmt == "int8":
        return q.float() * t["scale"].unsqueeze(-1)
    e, n, half = q.shape
    nib = torch.stack((q & 0xF, q >> 4), dim=-1).reshape(e, n, half * 2).float()
    g = nib.reshape(e, n, -1, group_size)
    return (g * t["scale"].unsqueeze(-1) + t["min"].unsqueeze(-1)).reshape(e, n, half * 2)


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
