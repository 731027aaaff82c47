"""The q4_K experts' quad layout built by native/layouts.c against quant/layout.py's torch
version (the reference the kernel's own tests were written against): the same bytes."""

from __future__ import annotations

import pytest
import torch

from hetserve.moe.native_layout import q4k_layer
from hetserve.native import native_unavailable_reason, optional_kernel
from hetserve.quant.packed import Q4KRows

pytestmark = pytest.mark.skipif(
    native_unavailable_reason() is not None,
    reason=f"native kernels unavailable: {native_unavailable_reason()}",
)


def _experts(n: int, blocks: int, count: int, seed: int) -> tuple[Q4KRows, ...]:
    """Random 144-byte blocks with finite fp16 d and dmin (the torch version widens them to
    fp32 and back, which keeps every finite value but not a NaN's payload)."""
    gen = torch.Generator().manual_seed(seed)
    mats = []
    for _ in range(count):
        raw = torch.randint(0, 256, (n, blocks, 144), dtype=torch.uint8, generator=gen)
        scales = torch.randn(n, blocks, 2, generator=gen).to(torch.float16)
        raw[..., 0:4] = scales.view(torch.uint8).reshape(n, blocks, 4)
        mats.append(Q4KRows(raw))
    return tuple(mats)


@pytest.mark.parametrize(
    "n,blocks,gate_up",
    [
        (32, 2, True),  # W13: 8 gate rows, 8 up rows, ... then quads in pairs
        (48, 3, True),
        (12, 1, False),  # 3 quads: one pair and an odd last quad
        (8, 4, False),
    ],
)
def test_native_layout_is_the_torch_layout_byte_for_byte(n, blocks, gate_up, monkeypatch):
    mats = _experts(n, blocks, 3, seed=n + blocks)
    assert optional_kernel("hetserve_q4k_quads") is not None
    native = q4k_layer(mats, gate_up)
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    reference = q4k_layer(mats, gate_up)
    assert native.shape == reference.shape == (3, n // 4, blocks, 576)
    assert torch.equal(native, reference)


def test_rows_that_do_not_fill_the_units_are_refused():
    with pytest.raises(ValueError, match="quads"):
        q4k_layer(_experts(24, 1, 1, seed=0), gate_up=True)  # 24 rows: not units of 16
