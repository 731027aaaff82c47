"""Weight layouts the native kernels read (moe_kernels.c): shared by the routed experts
(`moe/cpu_native.py`) and the int8 linears (`layers/int8_linear.py`).

Only byte order changes here, never values: row quads interleaved into one sequential stream
per matrix (four strided row streams ran at half the speed: prefetch-bound), gate and up rows
paired, int4 nibbles in the order the AVX2 unpack wants, int4 group parameters inside their
tiles. And sizes: a matrix whose rows or columns are not whole units of its kernel (quads and
tiles of rows, 8 to 256 columns, whole groups) is stored with zero weights appended up to them
(`padded_size`, `pad_tensor`, `pad_qmatrix`), once at load; the kernels pad the activations
with zeros and drop the padded outputs, so nothing the model sees changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from hetserve import envs
from hetserve.native import hugepage_empty, kernel, optional_kernel
from hetserve.quant.packed import (
    BlockRows,
    Fp8Rows,
    Int4Rows,
    Int8Rows,
    Mxfp4Rows,
    Q4KRows,
    QMatrix,
)


def padded_size(fmt: int, group: int, n: int) -> int:
    """The size a hidden or intermediate size (a linear's input size) `n` is stored at by the
    native kernels of format `fmt` (F_* of moe_kernels.c) with `group` columns per scale (0:
    none): their own rule (hetserve_moe_padded), so layouts built here and the kernel agree."""
    return int(kernel("hetserve_moe_padded")(fmt, group, n))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_tensor(t: torch.Tensor, rows: int, cols: int, row_dim: int = -2) -> torch.Tensor:
    """`t` with dimensions `row_dim` and the one after it extended with zeros at the end to
    `rows` and `cols` (`t` itself where they already are that)."""
    d = t.dim() + row_dim
    n, c = t.shape[d], t.shape[d + 1]
    if (n, c) == (rows, cols):
        return t
    assert n <= rows and c <= cols, "padding never shrinks"
    out = t.new_zeros((*t.shape[:d], rows, cols, *t.shape[d + 2 :]))
    out[(slice(None),) * d + (slice(0, n), slice(0, c))] = t
    return out


def pad_gate_up(t: torch.Tensor, half: int, cols: int) -> torch.Tensor:
    """[.., 2I, C] gate rows then up rows -> [.., 2 half, cols]: each half padded on its own, so
    the up rows still start at row `half`."""
    n = t.shape[-2] // 2
    if (n, t.shape[-1]) == (half, cols):
        return t
    gate, up = (pad_tensor(p, half, cols) for p in (t[..., :n, :], t[..., n:, :]))
    return torch.cat((gate, up), dim=-2)


def pad_bias(b: torch.Tensor | None, n: int, gate_up: bool = False) -> torch.Tensor | None:
    """Biases [E, N] (`gate_up`: [E, 2I], gate then up) with zeros appended to `n` (per half)."""
    if b is None:
        return None
    t = b.unsqueeze(-1)
    return (pad_gate_up(t, n, 1) if gate_up else pad_tensor(t, n, 1)).squeeze(-1).contiguous()


def _column_units(m: QMatrix) -> dict[str, int]:
    """Matrix columns per column of each field of `m` (the dimension after its row one)."""
    if isinstance(m, Fp8Rows):
        return {"w": 1, "scale": m.block_k}
    if isinstance(m, Mxfp4Rows):
        return {"blocks": 32, "scales": 32}
    if isinstance(m, Int4Rows):
        return {"packed": 2, "scale": m.group, "minimum": m.group}
    if isinstance(m, Int8Rows):
        return {"q": 1, "scale": m.group}
    if isinstance(m, BlockRows):  # GGUF blocks: 256 columns (IQ4_NL: 32)
        return {"raw": m.per_block}
    raise TypeError(f"no padding rule for {type(m).__name__}")


def pad_qmatrix(m: QMatrix, rows: int, cols: int) -> QMatrix:
    """`m` [.., N, K] as [.., rows, cols]: every field zero-filled in the new rows and columns,
    which every format here reads as weight 0 (int4: code 0 with scale and minimum 0 in new
    rows and groups; in a partial group's new columns code 0 is its minimum, which meets only
    zero activations). `cols` holds whole groups of `m`'s (the caller's padded_size)."""
    n, k = m.shape[-2:]
    if (n, k) == (rows, cols):
        return m
    units = _column_units(m)  # FP8's last block may be partial: its scale covers it
    assert isinstance(m, Fp8Rows) or all(cols % u == 0 for u in units.values()), "whole groups"
    fields = {f: pad_tensor(getattr(m, f), rows, -(-cols // units[f]), d)
              for f, d in m.row_dims.items()}  # fmt: skip
    return dataclasses.replace(m, **fields)


def pad_qmatrix_gate_up(m: QMatrix, half: int, cols: int) -> QMatrix:
    """pad_gate_up for a QMatrix: gate rows, then up rows, each padded to `half`."""
    n = m.shape[-2] // 2
    if (n, m.shape[-1]) == (half, cols):
        return m
    parts = [pad_qmatrix(m.rows(slice(a, a + n)), half, cols) for a in (0, n)]
    return type(m).cat_rows(parts)


def pad_qmatrices(
    mats: Sequence[QMatrix], rows: int, cols: int, gate_up: bool = False
) -> list[QMatrix]:
    """Each matrix padded (pad_qmatrix, or with `gate_up` pad_qmatrix_gate_up and `rows` per
    half): checkpoint matrices as they are where they fit, as their formats' blocks mostly
    make them. A list is padded in place and returned (a layer handed over to its backend:
    no second list holds the loaded matrices); anything else gives a new list."""
    pad = pad_qmatrix_gate_up if gate_up else pad_qmatrix
    if not isinstance(mats, list):
        return [pad(m, rows, cols) for m in mats]
    for i, m in enumerate(mats):
        mats[i] = pad(m, rows, cols)
    return mats


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """q [..., K] in [0, 15] -> uint8 [..., K/2]: byte j holds element 2j in its low nibble and
    element 2j + 1 in its high nibble, the order GPTQ, compressed-tensors and MXFP4 use (the
    kernel unpacks it without lane-crossing shuffles)."""
    q = q.to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def pair_gate_up(w13: torch.Tensor, rows: int = 4) -> torch.Tensor:
    """[E, 2I, C] with gate rows then up rows -> rows ordered gate 0-3, up 0-3, gate 4-7, ...
    (units of `rows`: 16 for the int4 and MXFP4 tiles), so phase 1 of the kernel (which needs
    gate and up of the same rows) reads one stream."""
    e, n, c = w13.shape
    return w13.reshape(e, 2, n // (2 * rows), rows, c).transpose(1, 2).reshape(e, n, c)


def quad_units(t: torch.Tensor, chunk: int, rows: int) -> torch.Tensor:
    """A view (no copy) of [E, N, C] as [E, N/rows, C/chunk, rows, chunk]: per unit of `rows`
    rows and every `chunk` columns, the rows' pieces back to back."""
    e, n, c = t.shape
    return t.reshape(e, n // rows, rows, c // chunk, chunk).transpose(2, 3)


def interleave_quads(t: torch.Tensor, chunk: int, rows: int = 4) -> torch.Tensor:
    """[E, N, C] -> same bytes reordered so each quad of rows (or unit of `rows`) is one
    sequential stream: for every `chunk` columns, the rows' pieces back to back
    ([E, N/rows, C/chunk, rows, chunk]), in memory backed by huge pages where the OS allows."""
    src = quad_units(t, chunk, rows)
    return hugepage_empty(tuple(src.shape), t.dtype).copy_(src)


def q4k_quads(
    d: torch.Tensor,
    dmin: torch.Tensor,
    sc: torch.Tensor,
    m: torch.Tensor,
    codes: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """One q4_K matrix of N rows and B super-blocks (d, dmin [N, B]; 6-bit sc, m [N, B, 8];
    codes [N, 256 B] in [0, 15]) -> `out` uint8 [N/4, B, 576], the kernel's quad layout
    (hetserve/native/moe_q4k.h): per quad and super-block the 4 rows' d, dmin, scales and
    nibbles, 144 bytes per row and super-block as in the file. The kernel reads quads in pairs,
    so pairs (quads 2u, 2u + 1) interleave their super-blocks by 64-byte line ([B, 9, 2, 64]),
    the order it reads them in; an odd last quad stays as it is."""
    n, b = d.shape
    quads = n // 4
    flat = torch.empty((quads, b, 576), dtype=torch.uint8)  # quad by quad, before the pairs

    def by_quad(t: torch.Tensor) -> torch.Tensor:  # [N, B, ...] -> [N/4, B, 4, ...]
        return t.reshape(quads, 4, b, *t.shape[2:]).transpose(1, 2)

    flat[..., 0:8] = by_quad(d).to(torch.float16).contiguous().view(torch.uint8)
    flat[..., 8:16] = by_quad(dmin).to(torch.float16).contiguous().view(torch.uint8)

    def by_place(six: torch.Tensor) -> torch.Tensor:  # [N, B, 8] -> [N/4, B, 32]
        t = by_quad(six).reshape(quads, b, 4, 2, 4)  # row r, sub-block 4g + i -> 16g + 4r + i
        return t.transpose(2, 3).reshape(quads, b, 32).to(torch.int32)

    flat[..., 16:48] = ((by_place(sc) & 15) | ((by_place(m) & 15) << 4)).to(torch.uint8)
    shift = (2 * torch.arange(4)).view(1, 1, 4, 1)
    for lo, six in ((48, sc), (56, m)):  # byte p's high 2 bits at byte p % 8, bits 2(p // 8)
        high = (by_place(six) >> 4).reshape(quads, b, 4, 8)
        flat[..., lo : lo + 8] = (high << shift).sum(dim=2).to(torch.uint8)
    # [quads, row r, B, group g, sub-block 4g + i, nibble h, k // 2, 4 columns]
    c = codes.reshape(quads, 4, b, 2, 4, 2, 4, 4).to(torch.uint8)
    nib = c[..., 0, :, :] | (c[..., 1, :, :] << 4)  # [quads, r, B, g, i, k // 2, 4]
    # vector k = 2 (k // 2) + g: byte 16r + 4i + t
    flat[..., 64:] = nib.permute(0, 2, 5, 3, 1, 4, 6).reshape(quads, b, 512)
    # pairs of quads: for every 64 bytes, the pair's two lines back to back
    pairs = quads // 2
    out[: 2 * pairs].view(1, pairs, 9 * b, 2, 64).copy_(
        quad_units(flat[: 2 * pairs].view(1, 2 * pairs, 576 * b), 64, 2)
    )
    out[2 * pairs :] = flat[2 * pairs :]
    return out


def q4k_layout(mat: Q4KRows, out: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """One q4_K matrix [N, K] (N a multiple of 4; of 16 with `gate_up`: gate rows then up rows,
    taken 8 and 8 as the experts' phase 1 reads them) -> `out` uint8 [N/4, K/256, 576], the
    kernel's quad layout: by native/layouts.c where the kernels are built (the file's blocks
    moved as they are; ~20x faster than torch), else by `q4k_quads` (the same bytes)."""
    n, k = mat.shape
    if n % (16 if gate_up else 4):
        raise ValueError(f"a q4_K matrix of {n} rows does not fill the kernel's quads")
    native = optional_kernel("hetserve_q4k_quads") if envs.native_kernels() else None
    if native is not None and out.is_contiguous():
        raw = mat.raw.contiguous()
        threads = torch.get_num_threads()
        if native(threads, n, k // 256, raw.data_ptr(), int(gate_up), out.data_ptr()):
            raise RuntimeError("hetserve_q4k_quads refused checked rows")  # cannot happen
        return out
    d, dmin, sc, m, codes = mat.fields()
    if gate_up:  # 8 gate rows, 8 up rows, ... (the kernel's unit): phase 1 reads one stream
        d, dmin, sc, m, codes = (
            pair_gate_up(t.reshape(1, n, -1), rows=8)[0] for t in (d, dmin, sc, m, codes)
        )
        sc, m = sc.reshape(n, -1, 8), m.reshape(n, -1, 8)
    return q4k_quads(d, dmin, sc, m, codes, out)


def int4_group_tiles(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """One int4 matrix of N rows, K columns in groups of G (packed uint8 [N, K/2]; fp32 scale
    and minimum [N, K/G]) -> `out` uint8 [N/16, K/G, 8G + 128], tile_i4's layout
    (hetserve/native/moe_quads.h): per tile of 16 rows and group, the rows' nibbles (4 bytes
    per row and 8 columns), then the 16 scales, then the 16 minimums. A tile is then one
    sequential stream: read as three (nibbles, scales, minimums apart) a one-token layer took
    ~1.09x as long (same process, alternating calls: 285 -> 260 us at H 2048, I 512, top-6)."""
    n, ng = scale.shape
    nb = packed.shape[1] // ng  # nibble bytes per row and group: G / 2
    tiles = n // 16
    q = quad_units(packed.unsqueeze(0), 4, 16)[0].reshape(tiles, ng, nb // 4, 16, 4)  # a view
    out[..., : 16 * nb].view(tiles, ng, nb // 4, 16, 4).copy_(q)
    for lo, t in ((16 * nb, scale), (16 * nb + 64, minimum)):
        p = t.to(torch.float32).reshape(tiles, 16, ng).transpose(1, 2)
        out[..., lo : lo + 64].view(torch.float32).copy_(p)
    return out


def fp16_group_scales(scale: torch.Tensor) -> torch.Tensor:
    """Grouped int8 scales (GGUF q8_0) as the kernels read them: fp16, which q8_0's are exactly
    (`quad_i8g` converts them with F16C); other scales round to within 2^-11 of themselves."""
    return scale.to(torch.float16)
