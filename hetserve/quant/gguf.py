"""GGUF block types as a file stores them, read into `QMatrix` rows without rounding again.

Who calls it: the GGUF reader (`model/gguf_file.py`) for every quantized tensor it keeps packed.
`data` is the tensor's raw bytes as the `gguf` package maps them ([.., rows, bytes per row]);
the result holds exactly the file's numbers. A block size that does not divide a row is the
caller's bug (the reader checks tensor shapes against the file's metadata first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from hetserve.quant.packed import Int8Rows, Q4KRows, QMatrix, _f16_bits, _q4k_six

Q8_0_BLOCK_BYTES = 34  # fp16 d, 32 int8
Q4_K_BLOCK_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums, 128 of nibbles


def f16_values(raw: np.ndarray) -> torch.Tensor:
    """Little-endian fp16 bytes -> fp32 values."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


def q8_0_rows(data: np.ndarray) -> Int8Rows:
    """q8_0 blocks [.., rows, n * 34] -> Int8Rows (group 32), exactly."""
    blocks = data.reshape(*data.shape[:-1], -1, Q8_0_BLOCK_BYTES)
    scale = f16_values(blocks[..., :2]).squeeze(-1)
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
    return Int8Rows(q.reshape(*q.shape[:-2], -1), scale)


def q4_k_rows(data: np.ndarray) -> Q4KRows:
    """q4_K super-blocks [.., rows, n * 144] -> Q4KRows: the file's bytes, unchanged."""
    raw = np.array(data).reshape(*data.shape[:-1], -1, Q4_K_BLOCK_BYTES)  # a writable copy
    return Q4KRows(torch.from_numpy(raw))


Q6_K_BLOCK_BYTES = 210  # ql[128], qh[64], 16 int8 scales, fp16 d
Q5_K_BLOCK_BYTES = 176  # fp16 d, dmin, 12 bytes of 6-bit scales and minimums, qh[32], qs[128]


@dataclass(frozen=True)
class Q6KRows(QMatrix):
    """q6_K super-blocks [.., N, K/256, 210] exactly as in a GGUF file: w = d * sc * (q - 32),
    q in [0, 63], an int8 sc per 16 columns (6.5625 bits per weight). Served by cpu-gguf."""

    raw: torch.Tensor

    fmt: ClassVar[str] = "q6_K"
    row_dims: ClassVar[dict[str, int]] = {"raw": -3}

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, blocks, _ = self.raw.shape
        return (*lead, n, blocks * 256)

    @property
    def group(self) -> int:
        return 16

    def dequantize(self) -> torch.Tensor:
        r = self.raw.to(torch.int32)
        ql, qh = r[..., 0:128], r[..., 128:192]
        sc = self.raw[..., 192:208].contiguous().view(torch.int8).float()
        d = self.raw[..., 208:210].contiguous().view(torch.float16).float()  # [.., n, b, 1]
        halves = []
        for n in range(2):
            lo, hi = ql[..., 64 * n : 64 * n + 64], qh[..., 32 * n : 32 * n + 32]
            for i in range(4):  # column 128 n + 32 i + l
                nib = (lo[..., 32 * (i & 1) : 32 * (i & 1) + 32] >> (4 * (i // 2))) & 15
                halves.append(nib | (((hi >> (2 * i)) & 3) << 4))
        q = torch.cat(halves, dim=-1).float() - 32  # [.., n, b, 256]
        w = (d * sc).repeat_interleave(16, dim=-1) * q
        return w.flatten(-2)


@dataclass(frozen=True)
class Q5KRows(QMatrix):
    """q5_K super-blocks [.., N, K/256, 176] exactly as in a GGUF file: w = d * sc * q - dmin * m,
    q in [0, 31], 6-bit sc and m per 32 columns (5.5 bits per weight). Served by cpu-gguf."""

    raw: torch.Tensor

    fmt: ClassVar[str] = "q5_K"
    row_dims: ClassVar[dict[str, int]] = {"raw": -3}

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, blocks, _ = self.raw.shape
        return (*lead, n, blocks * 256)

    @property
    def group(self) -> int:
        return 32

    def dequantize(self) -> torch.Tensor:
        r = self.raw
        d, dmin = _f16_bits(r[..., 0:2]), _f16_bits(r[..., 2:4])
        sc, m = _q4k_six(r[..., 4:16])
        qh, qs = r[..., 16:48].to(torch.int32), r[..., 48:176].to(torch.int32)
        parts = []
        for c in range(4):  # column 64 c + 32 h + l
            for h in range(2):
                nib = (qs[..., 32 * c : 32 * c + 32] >> (4 * h)) & 15
                parts.append(nib | (((qh >> (2 * c + h)) & 1) << 4))
        q = torch.cat(parts, dim=-1).float()
        scale = (d[..., None] * sc).repeat_interleave(32, dim=-1)
        low = (dmin[..., None] * m).repeat_interleave(32, dim=-1)
        return (scale * q - low).flatten(-2)


def q6_k_rows(data: np.ndarray) -> Q6KRows:
    raw = np.array(data).reshape(*data.shape[:-1], -1, Q6_K_BLOCK_BYTES)
    return Q6KRows(torch.from_numpy(raw))


def q5_k_rows(data: np.ndarray) -> Q5KRows:
    raw = np.array(data).reshape(*data.shape[:-1], -1, Q5_K_BLOCK_BYTES)
    return Q5KRows(torch.from_numpy(raw))
