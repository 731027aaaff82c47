"""Quantized weight matrices as checkpoints publish them, and routed experts held in them.

A `QMatrix` is one matrix (or a stack of them) `[.., N, K]` (output rows, input columns) in one
storage format, with every quantization parameter kept per row, so row selection, expert
selection and concatenation are plain indexing:

- `Fp8Rows`: float8_e4m3fn values, fp32 scale per row and group of `group` columns (DeepSeek's
  128 x 128 block scales, expanded along rows: a row knows its block's scale).
- `Mxfp4Rows`: gpt-oss's published bytes unchanged: `blocks` [.., N, K/32, 16] (two e2m1 codes
  a byte, element 2j in the low nibble) and e8m0 `scales` [.., N, K/32].
- `Int4Rows`: nibbles in natural order (element 2j in the low nibble) [.., N, K/2], fp32 scale
  and minimum per group: w = q * scale + minimum, q in [0, 15] (GPTQ, compressed-tensors, q4_K).
- `Int8Rows`: int8 values, fp32 scale per group (`group = K`: per channel; q8_0: 32).
- `Q4KRows`: GGUF q4_K super-blocks as the file stores them, 144 bytes per 256 columns (fp16
  d and dmin, 6-bit scale and minimum per 32 columns, nibbles): w = d * sc * q - dmin * m.

`PackedExperts` holds one MoE layer's routed experts as such matrices, one per expert and
projection, so CPU backends read the checkpoint's own numbers (and convert expert by expert
where their format differs) without a full-precision copy of the layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from hetserve.errors import ModelLoadError
from hetserve.quant.quantize import dequantize_mxfp4, quantize_int8_per_channel


@dataclass(frozen=True)
class QMatrix:
    """Base: subclasses list their tensor fields and where each one's row dimension is."""

    fmt: ClassVar[str]
    row_dims: ClassVar[dict[str, int]]  # field -> its row dimension, counted from the end

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix these numbers stand for (exactly, for every format here)."""
        raise NotImplementedError

    @property
    def group(self) -> int:
        """Columns per scale (0 where the format has no column groups)."""
        return 0

    def _map(self, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> QMatrix:
        return dataclasses.replace(
            self, **{f: fn(getattr(self, f), d) for f, d in self.row_dims.items()}
        )

    def select(self, index: int) -> QMatrix:
        """Matrix `index` of a stack (the first dimension)."""
        return self._map(lambda t, d: t[index])

    def rows(self, index: torch.Tensor | slice) -> QMatrix:
        if isinstance(index, slice):
            return self._map(lambda t, d: t[(slice(None),) * (t.dim() + d) + (index,)])
        return self._map(lambda t, d: t.index_select(t.dim() + d, index))

    @classmethod
    def cat_rows(cls, parts: list[QMatrix]) -> QMatrix:
        first = parts[0]
        fields = {
            f: torch.cat([getattr(p, f) for p in parts], dim=d) for f, d in cls.row_dims.items()
        }
        return dataclasses.replace(first, **fields)

    def contiguous(self) -> QMatrix:
        return self._map(lambda t, d: t.contiguous())

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f).nbytes for f in self.row_dims)


def _expand_groups(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.float().repeat_interleave(group, dim=-1)


@dataclass(frozen=True)
class Fp8Rows(QMatrix):
    w: torch.Tensor  # float8_e4m3fn [.., N, K]
    scale: torch.Tensor  # fp32 [.., N, ceil(K / block_k)]
    block_k: int = 128

    fmt: ClassVar[str] = "fp8"
    row_dims: ClassVar[dict[str, int]] = {"w": -2, "scale": -2}

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)

    @property
    def group(self) -> int:
        return self.block_k

    def dequantize(self) -> torch.Tensor:
        k = self.w.shape[-1]
        return self.w.float() * _expand_groups(self.scale, self.block_k)[..., :k]


@dataclass(frozen=True)
class Mxfp4Rows(QMatrix):
    blocks: torch.Tensor  # uint8 [.., N, K/32, 16]
    scales: torch.Tensor  # uint8 [.., N, K/32], e8m0

    fmt: ClassVar[str] = "mxfp4"
    row_dims: ClassVar[dict[str, int]] = {"blocks": -3, "scales": -2}

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, g, _ = self.blocks.shape
        return (*lead, n, g * 32)

    @property
    def group(self) -> int:
        return 32

    def dequantize(self) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks, self.scales)


@dataclass(frozen=True)
class Int4Rows(QMatrix):
    packed: torch.Tensor  # uint8 [.., N, K/2], element 2j low nibble, 2j + 1 high nibble
    scale: torch.Tensor  # fp32 [.., N, K/group]
    minimum: torch.Tensor  # fp32 [.., N, K/group]

    fmt: ClassVar[str] = "int4"
    row_dims: ClassVar[dict[str, int]] = {"packed": -2, "scale": -2, "minimum": -2}

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def group(self) -> int:
        return self.shape[-1] // self.scale.shape[-1]

    def codes(self) -> torch.Tensor:
        """The 4-bit integers [.., N, K] in [0, 15]."""
        p = self.packed
        return torch.stack((p & 0x0F, p >> 4), dim=-1).reshape(self.shape)

    def dequantize(self) -> torch.Tensor:
        g = self.group
        return self.codes().float() * _expand_groups(self.scale, g) + _expand_groups(
            self.minimum, g
        )


@dataclass(frozen=True)
class Int8Rows(QMatrix):
    q: torch.Tensor  # int8 [.., N, K]
    scale: torch.Tensor  # fp32 [.., N, K/group]

    fmt: ClassVar[str] = "int8"
    row_dims: ClassVar[dict[str, int]] = {"q": -2, "scale": -2}

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def group(self) -> int:
        return self.shape[-1] // self.scale.shape[-1]

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * _expand_groups(self.scale, self.group)

    @classmethod
    def q8_0(cls, w: torch.Tensor) -> Int8Rows:
        """w [N, K] fp32 (K % 32 == 0) rounded as GGUF q8_0: int8 with a scale per 32 columns,
        the scale an fp16 number (as the file stores it)."""
        q, s = quantize_int8_per_channel(w.reshape(-1, 32))
        return cls(q.reshape(w.shape), s.to(torch.float16).float().reshape(w.shape[0], -1))

    @staticmethod
    def per_row(w: torch.Tensor) -> Int8PerRow:
        """w [N, K] as int8 with one fp32 scale per row (quantize_int8_per_channel: the numbers
        cpu-int8 and Int8Linear make of a dense weight, so rounding it early or late gives its
        bits)."""
        q, s = quantize_int8_per_channel(w)
        return Int8PerRow(q, s[:, None])

    @classmethod
    def grouped(cls, w: torch.Tensor, group: int = 32) -> Int8Rows:
        """w [N, K] (K % group == 0) as int8 with a scale per `group` columns, each scale an
        fp16 number (the native kernel reads them as fp16: no second rounding there) rounded
        up, so |q| <= 127 and |w - q * s| <= s / 2 element by element, where
        s <= max|w in its group| / 127 * (1 + 2^-10) + 2^-24 (fp16's relative step, and its
        smallest subnormal for groups near zero)."""
        n, k = w.shape
        amax = w.float().reshape(n, k // group, group).abs().amax(dim=-1)
        s = _f16_up(amax / 127.0)
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: any scale
        q = torch.round(w.float().reshape(n, k // group, group) / s.unsqueeze(-1))
        return cls(q.clamp_(-127, 127).to(torch.int8).reshape(n, k), s)

    @classmethod
    def linear_groups(cls, w: torch.Tensor) -> Int8Rows:
        """A dense linear weight as an int8 linear keeps one it cannot read as stored (a GGUF
        file's other types, a tensor left unallocated): `grouped` in groups of 32 columns, or
        one group a row where its columns are not whole groups."""
        return cls.grouped(w, 32 if w.shape[-1] % 32 == 0 else w.shape[-1])


@dataclass(frozen=True)
class Int8PerRow(Int8Rows):
    """Int8Rows rounded per row from a dense weight (`Int8Rows.per_row`), not a checkpoint's own
    groups (a q8_0 row of 32 columns has one scale too, fp16 and read as a group): the kernels
    take its fp32 scales per row, as they would have rounded the weight themselves."""


def _f16_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 number >= x (x >= 0, below fp16's max), as fp32."""
    h = x.to(torch.float16)
    below = h.float() < x
    bumped = (h.view(torch.int16) + 1).view(torch.float16)  # next fp16 up (x >= 0)
    return torch.where(below, bumped, h).float()


def _q4k_six(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of 6-bit scales and minimums of q4_K super-blocks -> sc, m [.., 8]
    (llama.cpp's packing: 0-3 sc 0-3 and the top bits of sc 4-7, 4-7 the same for m, 8-11 the
    low 4 bits of sc 4-7 | m 4-7 << 4)."""
    b = raw.to(torch.int32)
    lo, mid, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat((lo & 63, (hi & 15) | ((lo >> 2) & 48)), dim=-1)
    m = torch.cat((mid & 63, (hi >> 4) | ((mid >> 2) & 48)), dim=-1)
    return sc, m


def _f16_bits(raw: torch.Tensor) -> torch.Tensor:
    """Two bytes [.., 2] (little-endian fp16) -> fp32 [..]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


@dataclass(frozen=True)
class BlockRows(QMatrix):
    """A GGUF block type's bytes as the file stores them, [.., N, K / per_block, block bytes]:
    the base of every such format (q4_K here; quant/gguf.py's other K-quants, gguf_iq.py's
    4-bit and gguf_grid.py's grid i-quants)."""

    raw: torch.Tensor  # uint8

    row_dims: ClassVar[dict[str, int]] = {"raw": -3}
    per_block: ClassVar[int] = 256  # columns per block
    scale_columns: ClassVar[int] = 32  # columns per scale (`group`)
    ggml: ClassVar[str] = ""  # gguf's type name
    native: ClassVar[int] = 0  # the native kernels' format number (F_* in native/moe_job.h)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, blocks, _ = self.raw.shape
        return (*lead, n, blocks * self.per_block)

    @property
    def group(self) -> int:
        return self.scale_columns


@dataclass(frozen=True)
class Q4KRows(BlockRows):
    """q4_K super-blocks [.., N, K/256, 144] exactly as in a GGUF file. Its format is "int4"
    (served by cpu-int4; the native kernel reads these bytes, only rearranged into quads)."""

    fmt: ClassVar[str] = "int4"
    ggml: ClassVar[str] = "Q4_K"
    native: ClassVar[int] = 5

    def fields(self) -> tuple[torch.Tensor, ...]:
        """(d, dmin [.., N, K/256] fp32; sc, m [.., N, K/256, 8] int32; codes [.., N, K] in
        [0, 15]) with w[32 j + i of block b] = d[b] * sc[b, j] * code - dmin[b] * m[b, j]."""
        r = self.raw
        d, dmin = _f16_bits(r[..., 0:2]), _f16_bits(r[..., 2:4])
        sc, m = _q4k_six(r[..., 4:16])
        qs = r[..., 16:].reshape(*r.shape[:-1], 4, 32)  # chunk c: low = 64c + i, high = +32
        codes = torch.stack((qs & 15, qs >> 4), dim=-2).flatten(-4)
        return d, dmin, sc, m, codes

    def to_int4(self) -> Int4Rows:
        """The same numbers as int4 groups of 32 (fp32 scale d * sc and minimum -dmin * m,
        both exact in fp32): 6 bits per weight instead of 4.5."""
        d, dmin, sc, m, codes = self.fields()
        scale = (d[..., None] * sc).flatten(-2)
        minimum = (-(dmin[..., None] * m)).flatten(-2)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
        return Int4Rows(packed.contiguous(), scale.contiguous(), minimum.contiguous())

    def dequantize(self) -> torch.Tensor:
        return self.to_int4().dequantize()


# Formats a GGUF layer may mix (q8_0 is "int8", q4_K "int4"; quant/gguf.py: q6_K, q5_K;
# quant/gguf_iq.py: iq4_xs, iq4_nl), all served together by cpu-gguf (moe/cpu_gguf.py).
GGUF_FMTS = frozenset({"int8", "int4", "q6_K", "q5_K", "q3_K", "q2_K", "iq4_xs", "iq4_nl",
                       "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"})


@dataclass(frozen=True)
class PackedExperts:
    """One layer's routed experts as published: w13[e] [2I, H] (gate rows, then up rows) and
    w2[e] [H, I], all in one format."""

    w13: tuple[QMatrix, ...]
    w2: tuple[QMatrix, ...]

    def __post_init__(self) -> None:
        fmts = {m.fmt for m in (*self.w13, *self.w2)}
        if len(fmts) != 1 and not fmts <= GGUF_FMTS:
            raise ModelLoadError(f"routed experts mix quantization formats {sorted(fmts)}")

    @property
    def fmt(self) -> str:
        """The one format of every matrix; "gguf" where a GGUF layer mixes block types."""
        fmts = {m.fmt for m in (*self.w13, *self.w2)}
        return fmts.pop() if len(fmts) == 1 else "gguf"

    @property
    def num_experts(self) -> int:
        return len(self.w13)

    @property
    def hidden_size(self) -> int:
        return self.w2[0].shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w2[0].shape[1]

    def groups(self) -> tuple[int, int]:
        """Columns per scale of w13 and of w2 (the same for every expert)."""
        g13, g2 = {m.group for m in self.w13}, {m.group for m in self.w2}
        if len(g13) != 1 or len(g2) != 1:
            raise ModelLoadError("routed experts of one layer use different group sizes")
        return g13.pop(), g2.pop()

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w13[e].dequantize(), self.w2[e].dequantize()

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in (*self.w13, *self.w2))
