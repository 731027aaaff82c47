"""The native expert kernels' weight layouts, built from per-expert matrices one expert at a
time into one stacked tensor per matrix (on huge pages): row quads interleaved into one
sequential stream, W13's gate and up units alternating (phase 1 reads one stream), q4_K
super-blocks regrouped into quads, int4 and MXFP4 in their tiles, the file's K-quant and i-quant
rows as they are. Each is filled expert by expert, so a layer's matrices never exist twice
beside the layout (the streaming load's peak: model/loader.py); given a list, each lets its
entries go as it lays them out, so where the caller holds nothing else of them (a layer the
loader handed over: ExpertWeights.handed_over) each expert's loaded copy is freed before the
next one is laid out, and the peak is the layout plus one expert, not plus the layer.

Who calls it: the native backends (moe/cpu_native.py, moe/cpu_gguf.py) when they load a layer.
Failure: `stacked_quads` refuses experts of one layer with different shapes (ValueError); the
others take the first expert's shape as every expert's (the loader checked the checkpoint's
shapes before).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch

from hetserve import envs
from hetserve.native import hugepage_empty, optional_kernel
from hetserve.quant.lane_order import KERNEL_ORDER
from hetserve.quant.layout import int4_group_tiles, pair_gate_up, q4k_layout, quad_units
from hetserve.quant.packed import Int4Rows, Q4KRows, QMatrix

T = TypeVar("T")


def taken(mats: Sequence[T]) -> Iterator[tuple[int, T]]:
    """(e, mats[e]) in order; a list's entry is let go as it is handed out (see the module
    docstring), a tuple's stays."""
    drop = isinstance(mats, list)
    for e in range(len(mats)):
        m = mats[e]
        if drop:
            mats[e] = None  # type: ignore[call-overload]
        yield e, m
        del m


def stacked_quads(
    mats: list[torch.Tensor], chunk: int, gate_up: bool, rows: int = 4
) -> torch.Tensor:
    """Per-expert matrices [N, C] -> one stacked tensor in the kernel's quad layout (or tile
    layout of `rows` rows), filled expert by expert: no stacked copy of the layer beside it."""
    shape = tuple(mats[0].shape)
    if any(tuple(m.shape) != shape for m in mats):
        raise ValueError(f"experts of one layer differ in shape: {[tuple(m.shape) for m in mats]}")
    out = None
    native = optional_kernel("hetserve_unit_tiles") if envs.native_kernels() else None
    for e, m in taken(mats):
        t = m.unsqueeze(0)
        src = quad_units(pair_gate_up(t, rows) if gate_up else t, chunk, rows)
        if out is None:
            out = hugepage_empty((len(mats), *src.shape[1:]), m.dtype)
        if native is not None and m.is_contiguous() and m.dtype in (torch.uint8, torch.int8):
            # native/layouts.c: the same bytes as the strided copy below, ~10x its speed
            n, c = m.shape
            threads = torch.get_num_threads()
            if native(threads, n, c, rows, chunk, int(gate_up), m.data_ptr(), out[e].data_ptr()):
                raise RuntimeError("hetserve_unit_tiles refused a checked shape")  # cannot happen
        else:
            out[e : e + 1].copy_(src)
    return out


def stacked_tiles(mats: list[torch.Tensor], chunk: int, gate_up: bool) -> torch.Tensor:
    """MXFP4's tile layout (tile_mxfp4 in native/): 16 rows at a time, `chunk` bytes of each row
    back to back (int4's tiles also carry their group parameters: int4_layer)."""
    return stacked_quads(mats, chunk, gate_up, rows=16)


def q4k_layer(mats: Sequence[Q4KRows], gate_up: bool) -> torch.Tensor:
    """Per-expert q4_K matrices [N, K] -> one stacked tensor [E, N/4, K/256, 576] in the
    kernel's quad layout (native/moe_q4k.h), filled expert by expert (quant/layout.py's
    q4k_layout)."""
    n, k = mats[0].shape
    out = hugepage_empty((len(mats), n // 4, k // 256, 576), torch.uint8)
    for e, mat in taken(mats):
        q4k_layout(mat, out[e], gate_up)
    return out


def int4_layer(mats: Sequence[Int4Rows], gate_up: bool) -> torch.Tensor:
    """Per-expert int4 matrices [N, K] -> one stacked tensor [E, N/16, K/G, 8G + 128] in
    tile_i4's layout (quant/layout.py, int4_group_tiles), filled expert by expert."""
    n, k = mats[0].shape
    g = mats[0].group
    out = hugepage_empty((len(mats), n // 16, k // g, 8 * g + 128), torch.uint8)
    for e, m in taken(mats):
        q, s, z = m.packed, m.scale, m.minimum
        if gate_up:  # gate tile, up tile, ...: phase 1 reads one stream
            q, s, z = (pair_gate_up(t.reshape(1, n, -1), 16)[0] for t in (q, s, z))
        int4_group_tiles(q, s, z, out[e])
    return out


def rows_layer(mats: Sequence[QMatrix], gate_up: bool) -> torch.Tensor:
    """GGUF block matrices [N, K] (q2_K-q6_K, IQ4, the grid i-quants) -> [E, N, blocks, block
    bytes], the file's bytes (the K-quants' and IQ4's regrouped within each block for the row
    kernels), filled expert by expert; W13's rows in quads of gate rows then up rows (phase 1 reads
    one stream)."""
    # the K-quants' and IQ4's codes regrouped for the row kernels (quant/lane_order.py)
    reorder = KERNEL_ORDER.get(type(mats[0]))
    out = hugepage_empty((len(mats), *mats[0].raw.shape), torch.uint8)  # type: ignore[attr-defined]
    for e, m in taken(mats):
        raw = reorder(m.raw) if reorder else m.raw  # type: ignore[attr-defined]
        n = raw.shape[0]
        if gate_up:
            raw = pair_gate_up(raw.reshape(1, n, -1), 4)[0].reshape(raw.shape)
        out[e].copy_(raw)
    return out
