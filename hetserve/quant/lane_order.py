"""The GGUF row kernels' own byte order: each super-block's weights regrouped so that every lane
of every vector the kernel unpacks belongs to one scale group.

Who calls it: the native layouts of experts (`moe/native_layout.py`) and linears
(`layers/int8_linear.py`), through `KERNEL_ORDER`, once per matrix at load. Pure (no I/O): bytes
in, the same number of bytes out; a block size that does not divide a row is the caller's bug.

The row kernels (native/moe_kq.h) multiply a super-block of 256 columns 32 at a time
(vpdpbusd: 8 int32 lanes of 4 products each). Read in the file's order, each 32 columns are one
or two scale groups, so every 32 products met their scale (a shuffle and vpmaddwd) before being
added. Here the columns are permuted within the super-block, the same way as the activations
(moe_kq.h, kq_quantize): position 32 k + 4 i + p (vector k < 8, lane i < 8, byte p < 4) holds

- `PERM32` (one scale per 32 columns: IQ4_XS, IQ4_NL, q5_K): column 32 i + 4 k + p, so lane i
  of every vector is sub-block i;
- `PERM16` (one scale per 16: q6_K, q3_K, q2_K): column 128 h + 16 i + 4 k' + p (k = 4 h + k'),
  so lane i of vectors 0-3 is group i and of vectors 4-7 group 8 + i;

and the kernel adds a whole super-block's products in int32 lanes before scaling them once.
The K-quants keep their bit layout: the codes of "column" c in the file's layout are those of
the column at position c. IQ4_XS and IQ4_NL hold their nibbles in chunks of 64 positions
(byte l of 32-byte chunk c: position 64 c + l low, 64 c + 32 + l high) and IQ4_NL its 8 d first.
Scales, d, dmin and minimums stay where they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetserve import envs
from hetserve.native import optional_kernel
from hetserve.quant.gguf import (
    Q2_K_BLOCK_BYTES,
    Q3_K_BLOCK_BYTES,
    Q5_K_BLOCK_BYTES,
    Q6_K_BLOCK_BYTES,
    Q2KRows,
    Q3KRows,
    Q5KRows,
    Q6KRows,
)
from hetserve.quant.gguf_iq import IQ4_NL_BLOCK_BYTES, IQ4_XS_BLOCK_BYTES, IQ4NLRows, IQ4XSRows

_I, _K, _P = torch.meshgrid(torch.arange(8), torch.arange(8), torch.arange(4), indexing="ij")
# PERM32[position] = column: position 32 k + 4 i + p, column 32 i + 4 k + p
PERM32 = torch.empty(256, dtype=torch.long)
PERM32[(32 * _K + 4 * _I + _P).flatten()] = (32 * _I + 4 * _K + _P).flatten()
_H, _I2, _K2, _P2 = torch.meshgrid(
    torch.arange(2), torch.arange(8), torch.arange(4), torch.arange(4), indexing="ij"
)
# PERM16[position] = column: position 128 h + 32 k' + 4 i + p, column 128 h + 16 i + 4 k' + p
PERM16 = torch.empty(256, dtype=torch.long)
PERM16[(128 * _H + 32 * _K2 + 4 * _I2 + _P2).flatten()] = (
    128 * _H + 16 * _I2 + 4 * _K2 + _P2
).flatten()

ROWS_PER_STEP = 4096  # super-blocks regrouped at once (bounds the temporaries of a big matrix)


def _by_steps(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(raw: torch.Tensor) -> torch.Tensor:
        flat = raw.reshape(-1, raw.shape[-1])
        out = torch.empty_like(flat)
        for s in range(0, flat.shape[0], ROWS_PER_STEP):
            out[s : s + ROWS_PER_STEP] = fn(flat[s : s + ROWS_PER_STEP])
        return out.reshape(raw.shape)

    run.__doc__ = fn.__doc__
    return run


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[.., 8, 16] bytes, byte l of block j: column 32 j + l (low nibble), 32 j + 16 + l (high)
    -> the 4-bit codes [.., 256] in column order."""
    return torch.stack((q & 15, q >> 4), dim=-2).reshape(*q.shape[:-2], 256)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[.., 256] codes -> [.., 128] bytes, byte l of 64-column chunk c: column 64 c + l (low
    nibble), 64 c + 32 + l (high)."""
    c = codes.reshape(*codes.shape[:-1], 4, 2, 32)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*codes.shape[:-1], 128)


def _iq4_xs(raw: torch.Tensor) -> torch.Tensor:
    """IQ4_XS super-blocks [n, 136]: the nibbles in chunks of 64 positions (PERM32)."""
    codes = _nibbles(raw[:, 8:].reshape(-1, 8, 16))[:, PERM32]
    return torch.cat((raw[:, :8], _pack_nibbles(codes)), dim=-1)


def _iq4_nl(raw: torch.Tensor) -> torch.Tensor:
    """IQ4_NL groups of 8 blocks [n, 144] (8 x (fp16 d, 16 bytes of nibbles)): their 8 d, then
    the nibbles as IQ4_XS's."""
    blocks = raw.reshape(-1, 8, 18)
    codes = _nibbles(blocks[:, :, 2:])[:, PERM32]
    return torch.cat((blocks[:, :, :2].reshape(-1, 16), _pack_nibbles(codes)), dim=-1)


def _q5_k(raw: torch.Tensor) -> torch.Tensor:
    """q5_K [n, 176]: column 64 c + 32 h + l has its low 4 bits in nibble h of qs[32 c + l]
    (byte 48 on), bit 4 at bit 2 c + h of qh[l] (byte 16 on)."""
    r = raw.to(torch.int32)
    qh, qs = r[:, 16:48], r[:, 48:176].reshape(-1, 4, 32)
    low = torch.stack((qs & 15, qs >> 4), dim=-2)  # [n, c, h, l]
    bit = torch.arange(8).reshape(4, 2, 1)
    codes = (low | (((qh[:, None, None, :] >> bit) & 1) << 4)).reshape(-1, 256)[:, PERM32]
    c = codes.reshape(-1, 4, 2, 32)
    qs2 = (c[:, :, 0] & 15) | ((c[:, :, 1] & 15) << 4)
    qh2 = ((c >> 4) << bit).sum(dim=(1, 2))
    return torch.cat((raw[:, :16], qh2.to(torch.uint8), qs2.reshape(-1, 128).to(torch.uint8)), -1)


def _two_bits(qs: torch.Tensor) -> torch.Tensor:
    """qs [n, 64] -> 2-bit codes [n, 2, 4, 32]: column 128 n + 32 i + l at bits 2 i of
    qs[32 n + l]."""
    return (qs.reshape(-1, 2, 1, 32) >> (2 * torch.arange(4).reshape(4, 1))) & 3


def _pack_two_bits(c: torch.Tensor) -> torch.Tensor:
    """[n, 2, 4, 32] 2-bit codes -> qs [n, 64]."""
    return (c << (2 * torch.arange(4).reshape(4, 1))).sum(dim=2).reshape(-1, 64)


def _q3_k(raw: torch.Tensor) -> torch.Tensor:
    """q3_K [n, 110]: column 128 n + 32 i + l has its low 2 bits at bits 2 i of qs[32 n + l]
    (byte 32 on), bit 2 at bit 4 n + i of hmask[l] (byte 0 on)."""
    r = raw.to(torch.int32)
    hm = r[:, 0:32]
    bit = torch.arange(8).reshape(2, 4, 1)
    codes = _two_bits(r[:, 32:96]) | (((hm[:, None, None, :] >> bit) & 1) << 2)
    c = codes.reshape(-1, 256)[:, PERM16].reshape(-1, 2, 4, 32)
    hm2 = ((c >> 2) << bit).sum(dim=(1, 2))
    qs2 = _pack_two_bits(c & 3)
    return torch.cat((hm2.to(torch.uint8), qs2.to(torch.uint8), raw[:, 96:]), dim=-1)


def _q2_k(raw: torch.Tensor) -> torch.Tensor:
    """q2_K [n, 84]: column 128 n + 32 i + l at bits 2 i of qs[32 n + l] (byte 16 on)."""
    codes = _two_bits(raw[:, 16:80].to(torch.int32)).reshape(-1, 256)[:, PERM16]
    qs2 = _pack_two_bits(codes.reshape(-1, 2, 4, 32))
    return torch.cat((raw[:, :16], qs2.to(torch.uint8), raw[:, 80:]), dim=-1)


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    """q6_K [n, 210]: column 128 n + 32 i + l has its low 4 bits in nibble i // 2 of
    ql[64 n + 32 (i % 2) + l], its high 2 at bits 2 i of qh[32 n + l] (byte 128 on)."""
    r = raw.to(torch.int32)
    ql, qh = r[:, 0:128].reshape(-1, 2, 2, 32), r[:, 128:192].reshape(-1, 2, 1, 32)
    low = torch.stack((ql & 15, ql >> 4), dim=2)  # [n, half, i // 2, i % 2, l]
    low = low.reshape(-1, 2, 4, 32)  # i = 2 (i // 2) + i % 2
    high = (qh >> (2 * torch.arange(4).reshape(4, 1))) & 3
    c = (low | (high << 4)).reshape(-1, 256)[:, PERM16].reshape(-1, 2, 2, 2, 32)
    ql2 = (c[:, :, 0] & 15) | ((c[:, :, 1] & 15) << 4)  # nibble i // 2 of byte 32 (i % 2) + l
    qh2 = ((c.reshape(-1, 2, 4, 32) >> 4) << (2 * torch.arange(4).reshape(4, 1))).sum(dim=2)
    return torch.cat(
        (ql2.reshape(-1, 128).to(torch.uint8), qh2.reshape(-1, 64).to(torch.uint8), raw[:, 192:]),
        dim=-1,
    )


_iq4_nl_steps = _by_steps(_iq4_nl)


def _iq4_nl_groups(raw: torch.Tensor) -> torch.Tensor:
    groups = raw.reshape(*raw.shape[:-2], raw.shape[-2] // 8, 8 * IQ4_NL_BLOCK_BYTES)
    return _iq4_nl_steps(groups).reshape(raw.shape)


# The same regrouping in torch, per class (the native one's reference; ~0.05-0.3 GB/s).
TORCH_ORDER: dict[type, Callable[[torch.Tensor], torch.Tensor]] = {
    IQ4XSRows: _by_steps(_iq4_xs),
    IQ4NLRows: _iq4_nl_groups,
    Q5KRows: _by_steps(_q5_k),
    Q6KRows: _by_steps(_q6_k),
    Q3KRows: _by_steps(_q3_k),
    Q2KRows: _by_steps(_q2_k),
}


# bytes per unit the native regrouping takes: a super-block (IQ4_NL: 8 blocks of 32 columns)
_UNIT: dict[type, int] = {
    IQ4XSRows: IQ4_XS_BLOCK_BYTES,
    IQ4NLRows: 8 * IQ4_NL_BLOCK_BYTES,
    Q5KRows: Q5_K_BLOCK_BYTES,
    Q6KRows: Q6_K_BLOCK_BYTES,
    Q3KRows: Q3_K_BLOCK_BYTES,
    Q2KRows: Q2_K_BLOCK_BYTES,
}


def _regroup(cls: type) -> Callable[[torch.Tensor], torch.Tensor]:
    unit = _UNIT[cls]

    def run(raw: torch.Tensor) -> torch.Tensor:
        fn = optional_kernel("hetserve_kq_lanes") if envs.native_kernels() else None
        if fn is None:
            return TORCH_ORDER[cls](raw)
        src = raw.contiguous()
        out = torch.empty_like(src)
        fmt: int = cls.native  # type: ignore[attr-defined]
        rc = fn(torch.get_num_threads(), fmt, src.numel() // unit, src.data_ptr(), out.data_ptr())
        if rc != 0:
            raise ValueError(f"hetserve_kq_lanes: no lane order for {cls.__name__}")
        return out

    return run


# The matrices whose bytes the row kernels read regrouped, and how (experts:
# moe/native_layout.py; linears: layers/int8_linear.py): native/layouts.c's hetserve_kq_lanes
# where the kernels build, else torch. Each maps [.., block bytes] to the same shape (IQ4_NL:
# [.., B, 18] with B a multiple of 8, rows padded to 256 columns).
KERNEL_ORDER: dict[type, Callable[[torch.Tensor], torch.Tensor]] = {
    cls: _regroup(cls) for cls in TORCH_ORDER
}
