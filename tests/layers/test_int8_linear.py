"""Int8Linear (CPU-only serving of non-expert linears): both kernels within the int8 bound."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetserve.layers.int8_linear import Int8Linear
from hetserve.moe.cpu_backends import int8_linear_bound, quantize_int8_per_channel
from hetserve.native import native_unavailable_reason


@pytest.mark.parametrize("kernel", ["auto", "fbgemm"])
@pytest.mark.parametrize("n,k,t,bias", [(64, 96, 1, False), (12, 32, 5, True), (8, 64, 33, True)])
def test_within_the_stated_bound(kernel, n, k, t, bias):
    g = torch.Generator().manual_seed(n + t)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.1)
        lin.weight[2, 5] = 2.0  # an outlier the per-channel scale must contain
    x = torch.randn(t, k, generator=g)
    q = Int8Linear(lin, kernel=kernel)
    if kernel == "auto":
        assert q.kernel == ("fbgemm" if native_unavailable_reason() else "native")
    with torch.no_grad():
        ref = lin(x)
    out = q(x.view(t, 1, k)).view(t, n)  # leading dims are kept
    qw, scale = quantize_int8_per_channel(lin.weight.detach())
    bound = int8_linear_bound(
        x, qw.float() * scale[:, None], scale, q.kernel if q.kernel == "native" else "fbgemm"
    )
    assert ((out - ref).abs() <= bound + 1e-5).all()


def test_native_needs_aligned_shapes_and_falls_back():
    assert Int8Linear(nn.Linear(30, 8), kernel="auto").kernel == "fbgemm"  # K % 32 != 0
    assert Int8Linear(nn.Linear(32, 6), kernel="auto").kernel == "fbgemm"  # N % 4 != 0
