"""The experts' stacked layouts built by native/layouts.c (hetserve_unit_tiles) equal torch's
strided copy byte for byte: int8 quads (4 rows) and MXFP4's tiles (16 rows, 4-byte and 1-byte
pieces), with and without W13's gate / up pairing."""

from __future__ import annotations

import pytest
import torch

from hetserve.moe.native_layout import stacked_quads
from hetserve.native import optional_kernel


@pytest.mark.parametrize(("dtype", "rows", "chunk"), [
    (torch.int8, 4, 16), (torch.uint8, 16, 4), (torch.uint8, 16, 1), (torch.int8, 4, 64),
])  # fmt: skip
@pytest.mark.parametrize("gate_up", [False, True])
def test_native_tiles_equal_torch(monkeypatch, dtype, rows, chunk, gate_up):
    if optional_kernel("hetserve_unit_tiles") is None:
        pytest.skip("the native kernels are not built here")
    g = torch.Generator().manual_seed(rows * chunk + gate_up)
    mats = [torch.randint(0, 256, (64, 128), generator=g).to(torch.uint8).view(dtype)
            for _ in range(3)]  # fmt: skip
    native = stacked_quads(list(mats), chunk, gate_up, rows)
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    plain = stacked_quads(list(mats), chunk, gate_up, rows)
    assert native.shape == plain.shape and torch.equal(native, plain)
