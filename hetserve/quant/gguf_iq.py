"""GGUF's 4-bit i-quants (IQ4_XS, IQ4_NL) as the file stores them.

Who calls it: the GGUF reader (`model/gguf_file.py`): `IQ4XSRows` / `IQ4NLRows` hold a
tensor's bytes unchanged for `cpu-gguf` (moe_kq.h reads them regrouped: quant/lane_order.py);
the grid i-quants are quant/gguf_grid.py's, the types no kernel reads quant/gguf_convert.py's.
Pure (no I/O). A block size that does not divide a row is the caller's bug (the reader checks
shapes against the metadata first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from hetserve.quant.packed import BlockRows, _f16_bits

# llama.cpp's 16 non-uniform levels of the 4-bit i-quants (ggml-common.h, kvalues_iq4nl)
IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10,
                           1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32)  # fmt: skip
IQ4_XS_BLOCK_BYTES = 136  # fp16 d, 16 bits of high scale bits, 4 bytes of low ones, 128 nibbles
IQ4_NL_BLOCK_BYTES = 18  # per 32 columns: fp16 d, 16 bytes of nibbles


def _levels(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [.., 16 j + l] -> levels [.., 32 j + l] (low nibbles) and 32 j + 16 + l (high)."""
    q = qs.to(torch.int64).reshape(*qs.shape[:-1], -1, 16)
    codes = torch.stack((q & 15, q >> 4), dim=-2).flatten(-3)
    return IQ4_LEVELS[codes]


@dataclass(frozen=True)
class IQ4XSRows(BlockRows):
    """IQ4_XS super-blocks [.., N, K/256, 136] as in the file: w = d * (ls - 32) * level[q], a
    6-bit ls per 32 columns (4.25 bits per weight). Served by cpu-gguf."""

    fmt: ClassVar[str] = "iq4_xs"
    ggml: ClassVar[str] = "IQ4_XS"
    native: ClassVar[int] = 8

    def dequantize(self) -> torch.Tensor:
        r = self.raw.to(torch.int32)
        d = _f16_bits(self.raw[..., 0:2])
        high = r[..., 2] | (r[..., 3] << 8)
        j = torch.arange(8)
        low = (r[..., 4 + j // 2] >> (4 * (j % 2))) & 15
        ls = (low | (((high[..., None] >> (2 * j)) & 3) << 4)).float() - 32  # [.., 8]
        scale = (d[..., None] * ls).repeat_interleave(32, dim=-1)
        return (scale * _levels(self.raw[..., 8:])).flatten(-2)


@dataclass(frozen=True)
class IQ4NLRows(BlockRows):
    """IQ4_NL blocks [.., N, K/32, 18] as in the file: w = d * level[q] per 32 columns (4.5
    bits per weight). Served by cpu-gguf (rows padded to 256 columns with zero blocks)."""

    fmt: ClassVar[str] = "iq4_nl"
    ggml: ClassVar[str] = "IQ4_NL"
    native: ClassVar[int] = 9
    per_block: ClassVar[int] = 32

    def dequantize(self) -> torch.Tensor:
        d = _f16_bits(self.raw[..., 0:2])
        return (d[..., None] * _levels(self.raw[..., 2:])).flatten(-2)


def iq4_xs_rows(data: np.ndarray) -> IQ4XSRows:
    raw = np.array(data).reshape(*data.shape[:-1], -1, IQ4_XS_BLOCK_BYTES)
    return IQ4XSRows(torch.from_numpy(raw))


def iq4_nl_rows(data: np.ndarray) -> IQ4NLRows:
    raw = np.array(data).reshape(*data.shape[:-1], -1, IQ4_NL_BLOCK_BYTES)
    return IQ4NLRows(torch.from_numpy(raw))
