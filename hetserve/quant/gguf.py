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

from hetserve import envs
from hetserve.native import optional_kernel
from hetserve.quant.gguf_grid import BY_GGML, grid_reader
from hetserve.quant.gguf_iq import iq4_nl_rows, iq4_xs_rows
from hetserve.quant.packed import BlockRows, Int8Rows, Mxfp4Rows, Q4KRows, _f16_bits, _q4k_six

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
class Q6KRows(BlockRows):
    """q6_K super-blocks [.., N, K/256, 210] exactly as in a GGUF file: w = d * sc * (q - 32),
    q in [0, 63], an int8 sc per 16 columns (6.5625 bits per weight). Served by cpu-gguf."""

    fmt: ClassVar[str] = "q6_K"
    ggml: ClassVar[str] = "Q6_K"
    native: ClassVar[int] = 6
    scale_columns: ClassVar[int] = 16

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
class Q5KRows(BlockRows):
    """q5_K super-blocks [.., N, K/256, 176] exactly as in a GGUF file: w = d * sc * q - dmin * m,
    q in [0, 31], 6-bit sc and m per 32 columns (5.5 bits per weight). Served by cpu-gguf."""

    fmt: ClassVar[str] = "q5_K"
    ggml: ClassVar[str] = "Q5_K"
    native: ClassVar[int] = 7

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


Q3_K_BLOCK_BYTES = 110  # hmask[32], qs[64], 12 bytes of 6-bit scales, fp16 d
Q2_K_BLOCK_BYTES = 84  # 16 scale bytes (sc low nibble, m high), qs[64], fp16 d, dmin


def _two_bit(qs: torch.Tensor) -> list[torch.Tensor]:
    """q3_K / q2_K's 2-bit values [.., 32] in column order: 128 n + 32 i + l is bits 2 i of
    qs[32 n + l]."""
    return [(qs[..., 32 * n : 32 * n + 32] >> (2 * i)) & 3 for n in range(2) for i in range(4)]


@dataclass(frozen=True)
class Q3KRows(BlockRows):
    """q3_K super-blocks [.., N, K/256, 110] exactly as in a GGUF file: w = d * (sc - 32) *
    (q - 4), q in [0, 7] (bit 2 from hmask), a 6-bit sc per 16 columns (3.4375 bits per
    weight). Served by cpu-gguf (native/moe_kq.h)."""

    fmt: ClassVar[str] = "q3_K"
    ggml: ClassVar[str] = "Q3_K"
    native: ClassVar[int] = 10
    scale_columns: ClassVar[int] = 16

    def scales(self) -> torch.Tensor:
        """The 16 scales sc - 32 per super-block [.., 16]: scale j's low 4 bits are nibble
        j // 8 of byte j % 8, its top 2 bits at bits 2 (j // 4) of byte 8 + j % 4."""
        a = self.raw[..., 96:108].to(torch.int32)
        low = torch.cat((a[..., 0:8] & 15, a[..., 0:8] >> 4), dim=-1)
        j = torch.arange(16)
        high = (a[..., 8 + j % 4] >> (2 * (j // 4))) & 3
        return (low | (high << 4)) - 32

    def dequantize(self) -> torch.Tensor:
        r = self.raw.to(torch.int32)
        hmask = r[..., 0:32]
        parts = _two_bit(r[..., 32:96])
        q = torch.cat(
            [p - 4 * (1 - ((hmask >> k) & 1)) for k, p in enumerate(parts)], dim=-1
        ).float()
        d = _f16_bits(self.raw[..., 108:110])
        dl = (d[..., None] * self.scales().float()).repeat_interleave(16, dim=-1)
        return (dl * q).flatten(-2)


@dataclass(frozen=True)
class Q2KRows(BlockRows):
    """q2_K super-blocks [.., N, K/256, 84] exactly as in a GGUF file: w = d * sc * q - dmin *
    m, q in [0, 3], 4-bit sc and m per 16 columns (2.625 bits per weight). Served by
    cpu-gguf (native/moe_kq.h)."""

    fmt: ClassVar[str] = "q2_K"
    ggml: ClassVar[str] = "Q2_K"
    native: ClassVar[int] = 11
    scale_columns: ClassVar[int] = 16

    def dequantize(self) -> torch.Tensor:
        r = self.raw.to(torch.int32)
        q = torch.cat(_two_bit(r[..., 16:80]), dim=-1).float()
        d, dmin = _f16_bits(self.raw[..., 80:82]), _f16_bits(self.raw[..., 82:84])
        sc, m = (r[..., 0:16] & 15).float(), (r[..., 0:16] >> 4).float()
        scale = (d[..., None] * sc).repeat_interleave(16, dim=-1)
        low = (dmin[..., None] * m).repeat_interleave(16, dim=-1)
        return (scale * q - low).flatten(-2)


def q3_k_rows(data: np.ndarray) -> Q3KRows:
    raw = np.array(data).reshape(*data.shape[:-1], -1, Q3_K_BLOCK_BYTES)
    return Q3KRows(torch.from_numpy(raw))


def q2_k_rows(data: np.ndarray) -> Q2KRows:
    raw = np.array(data).reshape(*data.shape[:-1], -1, Q2_K_BLOCK_BYTES)
    return Q2KRows(torch.from_numpy(raw))


def q6_k_rows(data: np.ndarray) -> Q6KRows:
    raw = np.array(data).reshape(*data.shape[:-1], -1, Q6_K_BLOCK_BYTES)
    return Q6KRows(torch.from_numpy(raw))


def q5_k_rows(data: np.ndarray) -> Q5KRows:
    raw = np.array(data).reshape(*data.shape[:-1], -1, Q5_K_BLOCK_BYTES)
    return Q5KRows(torch.from_numpy(raw))


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[rows, K] fp32 (K % 256 == 0) -> q4_K bytes [rows, K / 256 * 144]: per 32 elements
    scale = (max - min) / 15 and offset = -min (min <= 0), both as 6-bit multiples of the
    super-block's fp16 d and dmin; nibbles of sub-blocks 2c and 2c + 1 share 32 bytes."""
    rows, k = w.shape
    x = w.astype(np.float32).reshape(rows, k // 256, 8, 32)
    lo = np.minimum(x.min(axis=-1), 0.0)
    scale = (x.max(axis=-1) - lo) / 15.0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(axis=-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(scale / df)), 0, 63).astype(np.uint8)
        m = np.clip(np.nan_to_num(np.round(-lo / dminf)), 0, 63).astype(np.uint8)
        s_eff, o_eff = (df * sc)[..., None], (dminf * m)[..., None]
        q = np.clip(np.nan_to_num(np.round((x + o_eff) / s_eff)), 0, 15).astype(np.uint8)
    packed = np.empty((rows, k // 256, 12), dtype=np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    chunks = q.reshape(rows, k // 256, 4, 2, 32)
    qs = (chunks[..., 0, :] | (chunks[..., 1, :] << 4)).reshape(rows, k // 256, 128)
    parts = (d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed, qs)
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def mxfp4_rows(data: np.ndarray) -> Mxfp4Rows:
    """GGML MXFP4 rows (blocks of 32: an e8m0 byte, then 16 bytes whose low nibbles are elements
    0-15 and high nibbles 16-31) -> gpt-oss's layout (quant/packed.py `Mxfp4Rows`: byte j holds
    elements 2j and 2j + 1). The same codes and scales, moved: exact."""
    raw = np.ascontiguousarray(data, dtype=np.uint8)
    blocks = raw.reshape(*raw.shape[:-1], raw.shape[-1] // 17, 17)
    native = optional_kernel("hetserve_mxfp4_split") if envs.native_kernels() else None
    if native is not None:  # native/layouts.c: the same bytes, ~0.2 GB/s -> the disk's rate
        packed = torch.empty((*blocks.shape[:-1], 16), dtype=torch.uint8)
        scales = torch.empty(blocks.shape[:-1], dtype=torch.uint8)
        n = int(np.prod(blocks.shape[:-1]))
        native(torch.get_num_threads(), n, raw.ctypes.data, packed.data_ptr(), scales.data_ptr())
        return Mxfp4Rows(packed, scales)
    qs = torch.from_numpy(blocks[..., 1:].copy())
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # elements 0..31 of each block
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    return Mxfp4Rows(packed, torch.from_numpy(blocks[..., 0].copy()))


# GGML types kept as they are for routed experts (cpu-int8, cpu-int4, cpu-gguf, cpu-mxfp4 read
# them), by the `gguf` package's type name; and bits per weight of every type, for the loader's
# summary and the choice of what the others convert to (quant/gguf_convert.py, convert_target).
KEPT = {"Q8_0": q8_0_rows, "Q4_K": q4_k_rows, "Q6_K": q6_k_rows, "Q5_K": q5_k_rows,
        "Q3_K": q3_k_rows, "Q2_K": q2_k_rows, "IQ4_XS": iq4_xs_rows, "IQ4_NL": iq4_nl_rows,
        "MXFP4": mxfp4_rows, **{name: grid_reader(name) for name in BY_GGML}}  # fmt: skip
BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8.5, "Q6_K": 6.5625, "Q5_K": 5.5, "Q5_1": 6,
        "Q5_0": 5.5, "Q4_K": 4.5, "Q4_1": 5, "Q4_0": 4.5, "IQ4_NL": 4.5, "IQ4_XS": 4.25,
        "Q3_K": 3.4375, "IQ3_S": 3.4375, "IQ3_XXS": 3.0625, "Q2_K": 2.625, "IQ2_S": 2.5,
        "IQ2_XS": 2.3125, "IQ2_XXS": 2.0625, "IQ1_M": 1.75, "IQ1_S": 1.5625, "TQ2_0": 2.0625,
        "TQ1_0": 1.6875, "MXFP4": 4.25}  # fmt: skip
