"""Weight layouts the native kernels read (moe_kernels.c): shared by the routed experts
(`moe/cpu_native.py`) and the int8 linears (`layers/int8_linear.py`).

Only byte order changes here, never values: row quads interleaved into one sequential stream
per matrix (four strided row streams ran at half the speed: prefetch-bound), gate and up rows
paired, int4 nibbles in the order the AVX2 unpack wants.
"""

from __future__ import annotations

import torch

from hetserve.native import hugepage_empty


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """q [..., K] in [0, 15] -> uint8 [..., K/2]: byte j holds element 2j in its low nibble and
    element 2j + 1 in its high nibble, the order GPTQ, compressed-tensors and MXFP4 use (the
    kernel unpacks it without lane-crossing shuffles)."""
    q = q.to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def pair_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """[E, 2I, C] with gate rows then up rows -> rows ordered gate 0-3, up 0-3, gate 4-7, ...,
    so phase 1 of the kernel (which needs gate and up of the same rows) reads one stream."""
    e, n, c = w13.shape
    return w13.reshape(e, 2, n // 8, 4, c).transpose(1, 2).reshape(e, n, c)


def interleave_quads(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """[E, N, C] -> same bytes reordered so each quad of rows is one sequential stream: for every
    `chunk` columns, the 4 rows' pieces back to back ([E, N/4, C/chunk, 4, chunk]), in memory
    backed by huge pages where the OS allows."""
    e, n, c = t.shape
    src = t.reshape(e, n // 4, 4, c // chunk, chunk).transpose(2, 3)
    return hugepage_empty(tuple(src.shape), t.dtype).copy_(src)
