"""The converted-experts file format that `hetserve convert` writes (`model/convert.py`) and the
loader reads (`model/converted.py`): per routed-experts module and matrix (`w13`, `w2`), int8
per output channel (`_q`, `_scale`) or int4 groups with a minimum, two nibbles per byte, element
2j in the low nibble (`_q`, `_scale`, `_min`). Error bounds: `quantize.py`'s quantizers.
"""

from __future__ import annotations

import torch

from hetserve.quant.layout import pack_int4_rows
from hetserve.quant.quantize import quantize_int4_groupwise, quantize_int8_per_channel

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
    packed = pack_int4_rows(q.reshape(e, n, k))
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
