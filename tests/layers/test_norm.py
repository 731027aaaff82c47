"""RMSNorm: the native fp32 path against torch's rms_norm, and where it is (not) taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetserve.layers.norm import RMSNorm


@pytest.mark.parametrize("shape", [(1, 2048), (64, 256), (5, 8, 32), (3, 7), (2000, 64)])
def test_matches_torch(shape):
    g = torch.Generator().manual_seed(len(shape))
    norm = RMSNorm(shape[-1], eps=1e-5).requires_grad_(False)
    norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = torch.randn(*shape, generator=g) * 3
    ref = F.rms_norm(x, (shape[-1],), norm.weight, 1e-5)
    out = norm(x)
    assert out.shape == x.shape
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    t = x.transpose(0, -1) if x.dim() > 1 else x  # non-contiguous input
    assert torch.allclose(norm(t.transpose(0, -1)), ref, atol=1e-5)


def test_autograd_and_bf16_keep_the_torch_path(monkeypatch):
    import hetserve.layers.norm as mod

    monkeypatch.setattr(mod, "optional_kernel", lambda name: pytest.fail("native kernel used"))
    norm = RMSNorm(16)
    x = torch.randn(4, 16, requires_grad=True)
    norm(x).sum().backward()  # weight requires grad: torch path, gradients flow
    assert x.grad is not None and norm.weight.grad is not None
    assert norm.bfloat16()(torch.randn(4, 16).bfloat16()).dtype == torch.bfloat16
    norm.float()
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    with torch.no_grad():
        norm(torch.randn(4, 16))
