"""The GEMM tiles prefill runs on int8 weights (hetserve/native/moe_gemm.h): where an expert or a
linear sees 16 tokens or more (8 on AVX2, whose row kernels take 2 tokens a call, not 4), the
native kernels pack 16 rows at a time and multiply-add every token against them; below that
they run the decode path. Both sum the same int16 x int8
products in int32 and take the same fp32 steps, so a token's result must not depend on which
path ran it: a batch equals its tokens one at a time, bit for bit. And both equal a reference of
that arithmetic in torch (exact integer sums, then the same fp32 steps)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetserve import native
from hetserve.layers.int8_linear import Int8Linear
from hetserve.moe.experts import ClampedSwiGLU, ExpertWeights, create_backend
from hetserve.quant.quantize import quantize_int8_per_channel

pytestmark = pytest.mark.skipif(
    bool(native.native_unavailable_reason()), reason="native kernels unavailable"
)
KBLOCK = 4096  # moe_quads.h: int32 sums turned into fp32 every KBLOCK inputs


def _one_at_a_time(fn, *args):
    return torch.cat([fn(*(a[t : t + 1] for a in args)) for t in range(args[0].shape[0])])


@pytest.mark.parametrize(
    ("h", "inter", "e", "k", "t", "bias", "act"),
    [
        (256, 128, 4, 2, 40, False, "silu"),
        (100, 40, 3, 2, 33, True, "silu"),  # both sizes padded to the kernel's units
        (256, 96, 3, 3, 24, True, "clamped"),  # gpt-oss's activation, biases
        (4608, 64, 2, 1, 40, False, "silu"),  # hidden past KBLOCK: two fp32 partial sums
        (256, 64, 2, 1, 230, False, "silu"),  # ~115 pairs an expert: past a block of 96
        # batched decode: 2-7 pairs per expert, below the tiles: the quad kernel (calls of 4 and
        # fewer on AVX-512, of 2 and 1 on AVX2)
        (256, 128, 8, 2, 20, False, "silu"),
        (100, 40, 6, 2, 11, True, "clamped"),
    ],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_experts_batch_equals_tokens_alone(h, inter, e, k, t, bias, act, threads):
    g = torch.Generator().manual_seed(h + t)
    w = ExpertWeights(
        torch.randn(e, 2 * inter, h, generator=g) * h**-0.5,
        torch.randn(e, h, inter, generator=g) * inter**-0.5,
        torch.randn(e, 2 * inter, generator=g) if bias else None,
        torch.randn(e, h, generator=g) if bias else None,
    )
    activation = ClampedSwiGLU(1.702, 7.0) if act == "clamped" else "silu"
    b = create_backend("cpu-int8", w, activation=activation, num_threads=threads)
    x = torch.randn(t, h, generator=g) * torch.logspace(-1, 1, h)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    tw = torch.rand(t, k, generator=g)
    batch = b.forward(x, tw, ids)
    assert torch.equal(batch, _one_at_a_time(b.forward, x, tw, ids))
    ref = create_backend("torch", w, activation=activation).forward(x, tw, ids)
    assert (batch - ref).abs().max() <= 0.05 * ref.abs().max()  # int8's own error, no more


def _reference_linear(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The native int8 linear's arithmetic in torch: activations rounded to int16 per row,
    exact integer sums (every KBLOCK inputs turned into fp32 and added in order), then
    (sum * weight scale) * activation scale in fp32."""
    q, scale = quantize_int8_per_channel(lin.weight.detach())
    mx = x.abs().amax(dim=1)
    s = torch.where(mx > 0, mx / 16383.0, torch.ones_like(mx))
    x16 = torch.round(x * (1.0 / s)[:, None]).clamp(-16383, 16383).long()
    out = torch.zeros(x.shape[0], q.shape[0])
    for k0 in range(0, x.shape[1], KBLOCK):
        part = x16[:, k0 : k0 + KBLOCK] @ q[:, k0 : k0 + KBLOCK].long().T
        out = out + part.float()
    return out * scale * s[:, None]


@pytest.mark.parametrize(("n", "k", "t"), [(22, 100, 40), (96, 256, 64), (301, 256, 9),
                                           (40, 4608, 20), (64, 2048, 3), (22, 100, 7),
                                           (96, 256, 5), (40, 100, 203)])  # fmt: skip
def test_int8_linear_tiles_equal_the_reference_arithmetic(n, k, t):
    """t >= 16 runs the tiles (>= 8 on AVX2), fewer the decode path's rows (4 tokens a call on
    AVX-512, 2 on AVX2): all equal the reference bit for bit."""
    g = torch.Generator().manual_seed(n + k)
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * k**-0.5)
    q = Int8Linear(lin)
    assert q.kernel == "native"
    x = torch.randn(t, k, generator=g) * torch.logspace(-1, 1, k)
    got = q(x)
    assert torch.equal(got, _reference_linear(lin, x))
    assert torch.equal(got, _one_at_a_time(q, x))


@pytest.mark.parametrize("fmt", ["q4k", "int8"])  # q4_K's tiles; q8_0's grouped int8 tiles
def test_packed_linear_tiles_agree_with_the_rows(fmt):
    """A GGUF linear meeting 130 tokens (the tiles, past their blocks of 96 tokens) gives each
    token its single-token call's result up to the order of fp32 additions."""
    from tests.moe.test_packed_experts import PACKERS

    g = torch.Generator().manual_seed(11)
    n, k, t = 40, 512, 130
    lin = nn.Linear(k, n, bias=False)
    lin.packed_weight = PACKERS[fmt][0](torch.randn(n, k, generator=g) * 0.1)
    q = Int8Linear(lin)
    assert q.kernel == "native"
    x = torch.randn(t, k, generator=g) * torch.logspace(-2, 1, k)
    got = q(x)
    alone = _one_at_a_time(q, x)
    assert float((got - alone).abs().max()) <= 2e-6 * float(alone.abs().max())
