"""Rotary embedding: the native fp32 path equals the torch one (both layouts)."""

from __future__ import annotations

import pytest
import torch

from hetserve.layers.rotary import RopeConfig, RotaryEmbedding


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dim,heads", [(32, 8), (64, 1), (12, 3)])
def test_native_equals_torch(interleaved, dim, heads, monkeypatch):
    rope = RotaryEmbedding(dim, 256, RopeConfig(theta=10000.0), interleaved=interleaved)
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(7, heads, dim, generator=g)
    pos = torch.tensor([0, 5, 17, 255, 3, 3, 100])
    native = rope(x, pos)
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    plain = rope(x, pos.clone())
    assert torch.allclose(native, plain, atol=1e-6, rtol=1e-6)
    assert torch.equal(rope(x, pos.clone()), plain)  # a new positions tensor: no stale angles
