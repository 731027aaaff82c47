"""W8A8: the int8 kernels with activations rounded to int8 per token row (`activation_bits=8`,
native/moe_gemm.h's byte tiles, moe_job.h's F_A8).

The rows are still stored as int16, only with |x| <= 127, so every kernel that reads them (the
AVX2 decode quads, the int16 tiles on AVX2, AMX's one tile product) sums exactly the same
integers as the byte tiles and AVX-512's decode quads (vpdpbusd with x + 128 and the weights'
sums taken off, moe_quads.h's quad_u8): a token's result
must not depend on the path, the batch or the instruction set, bit for bit. The arithmetic
equals a torch reference of it, and the error against the exact product stays within the
rounding's own bound."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetserve import native
from hetserve.layers.int8_linear import Int8Linear
from hetserve.moe.cpu_native import F_I8
from hetserve.moe.experts import ClampedSwiGLU, ExpertWeights, create_backend
from hetserve.quant.quantize import quantize_int8_per_channel

pytestmark = pytest.mark.skipif(
    bool(native.native_unavailable_reason()), reason="native kernels unavailable"
)
KBLOCK = 4096  # moe_quads.h: int32 sums turned into fp32 every KBLOCK inputs


def _alone(fn, *args):
    return torch.cat([fn(*(a[t : t + 1] for a in args)) for t in range(args[0].shape[0])])


def _experts(h, inter, e, bias, act, seed, threads=None):
    g = torch.Generator().manual_seed(seed)
    w = ExpertWeights(
        torch.randn(e, 2 * inter, h, generator=g) * h**-0.5,
        torch.randn(e, h, inter, generator=g) * inter**-0.5,
        torch.randn(e, 2 * inter, generator=g) if bias else None,
        torch.randn(e, h, generator=g) if bias else None,
    )
    activation = ClampedSwiGLU(1.702, 7.0) if act == "clamped" else "silu"
    b = create_backend("cpu-int8", w, activation=activation, num_threads=threads, activation_bits=8)
    return b, w, activation, g


def _inputs(g, t, h, e, k):
    x = torch.randn(t, h, generator=g) * torch.logspace(-1, 1, h)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return x, torch.rand(t, k, generator=g), ids


@pytest.mark.parametrize(
    ("h", "inter", "e", "k", "t", "bias", "act"),
    [
        (256, 128, 4, 2, 40, False, "silu"),  # ~20 pairs an expert: the byte tiles
        (100, 40, 3, 2, 33, True, "silu"),  # both sizes padded to the kernel's units
        (256, 96, 3, 3, 24, True, "clamped"),  # gpt-oss's activation, biases
        (4608, 64, 2, 1, 40, False, "silu"),  # hidden past KBLOCK: two corrections, two adds
        (256, 64, 2, 1, 230, False, "silu"),  # ~115 pairs an expert: past a block of 96
        (256, 128, 8, 2, 20, False, "silu"),  # 2-7 pairs an expert: the quads alone
    ],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_w8a8_experts_batch_equals_tokens_alone(h, inter, e, k, t, bias, act, threads):
    b, w, activation, g = _experts(h, inter, e, bias, act, seed=h + t, threads=threads)
    x, tw, ids = _inputs(g, t, h, e, k)
    batch = b.forward(x, tw, ids)
    assert torch.equal(batch, _alone(b.forward, x, tw, ids))
    ref = create_backend("torch", w, activation=activation).forward(x, tw, ids)
    assert (batch - ref).abs().max() <= 0.05 * ref.abs().max()  # int8's own error, no more
    b16 = create_backend("cpu-int8", w, activation=activation)
    assert not torch.equal(batch, b16.forward(x, tw, ids))  # the 8-bit rows did run


def _rows8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's W8A8 rounding: per row to the int8 grid of step max|x| / 127."""
    mx = x.abs().amax(dim=1)
    s = torch.where(mx > 0, mx / 127.0, torch.ones_like(mx))
    return torch.round(x * (1.0 / s)[:, None]).clamp(-127, 127).long(), s


def _reference_linear8(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The W8A8 linear's arithmetic in torch: rows rounded to int8, exact integer sums (fp32
    every KBLOCK inputs, added in order), then (sum * weight scale) * row scale in fp32."""
    q, scale = quantize_int8_per_channel(lin.weight.detach())
    x8, s = _rows8(x)
    out = torch.zeros(x.shape[0], q.shape[0])
    for k0 in range(0, x.shape[1], KBLOCK):
        out = out + (x8[:, k0 : k0 + KBLOCK] @ q[:, k0 : k0 + KBLOCK].long().T).float()
    return out * scale * s[:, None]


def _linear(n, k, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * k**-0.5)
    return lin, g


@pytest.mark.parametrize(
    ("n", "k", "t"),
    [
        (22, 100, 40),
        (96, 256, 64),
        (301, 256, 9),
        (40, 4608, 20),
        (40, 4608, 5),
        (64, 2048, 3),
        (40, 100, 203),
    ],
)
def test_w8a8_linear_equals_the_reference_arithmetic(n, k, t):
    """16 tokens or more: the byte tiles (AVX-512; AVX2's int16 tiles on the same rows), fewer:
    the rows (AVX-512: quad_u8 on bytes, two KBLOCKs at K = 4608); all equal the reference bit
    for bit."""
    lin, g = _linear(n, k, seed=n + k)
    q = Int8Linear(lin, activation_bits=8)
    assert q.kernel == "native" and "int8 activations" in repr(q)
    x = torch.randn(t, k, generator=g) * torch.logspace(-1, 1, k)
    got = q(x)
    assert torch.equal(got, _reference_linear8(lin, x))
    assert torch.equal(got, _alone(q, x))


def test_w8a8_linear_error_within_the_rounding_bound():
    """Against the exact product with the same int8 weights, each output is off by at most
    half a step of each input times the weights' absolute sum (plus fp32's slop)."""
    lin, g = _linear(64, 1024, seed=5)
    q8 = Int8Linear(lin, activation_bits=8)
    x = torch.randn(50, 1024, generator=g) * torch.logspace(-1, 1, 1024)
    wq, scale = quantize_int8_per_channel(lin.weight.detach())
    w_hat = wq.float() * scale[:, None]
    exact = x.double() @ w_hat.double().T
    _, s = _rows8(x)
    bound = (s.double() / 2)[:, None] * w_hat.abs().sum(dim=1).double()[None, :]
    err = (q8(x).double() - exact).abs()
    assert bool((err <= bound * 1.001 + 1e-5).all())
    err16 = (Int8Linear(lin)(x).double() - exact).abs()  # the int16 grid: 129x finer
    assert float(err.max()) > 10 * float(err16.max())


def test_a_residual_linear_keeps_int16_activations():
    """Kept-precise projections (int8 residual, 16-bit class) stay at 16-bit activations."""
    lin, g = _linear(32, 256, seed=9)
    x = torch.randn(20, 256, generator=g)
    a = Int8Linear(lin, residual=True, activation_bits=8)
    b = Int8Linear(lin, residual=True)
    assert "int8 activations" not in repr(a)
    assert torch.equal(a(x), b(x))


def _isa_libs():
    names = ["avx2", native.isa(), "amx-emulated"]
    libs = {}
    for name in dict.fromkeys(names):
        lib, err = native.build_for(name)
        assert lib is not None, err
        libs[name] = lib
    return libs


@pytest.mark.parametrize(
    ("h", "inter", "t"), [(256, 128, 40), (4160, 64, 36), (192, 64, 9), (4160, 64, 7)]
)
def test_w8a8_experts_same_bits_on_every_isa(h, inter, t):
    """AVX2 (int16 tiles and quads), this CPU's build (byte tiles on AVX-512) and the AMX loops
    on the C model of the tiles (one signed-byte product) give the same bits."""
    b, _, _, g = _experts(h, inter, 4, True, "silu", seed=h + t)
    x, tw, ids = _inputs(g, t, h, 4, 2)
    out = {}
    for name, lib in _isa_libs().items():
        b._bind(lib)
        out[name] = b.forward(x, tw, ids)
    first = next(iter(out.values()))
    assert all(torch.equal(first, o) for o in out.values()), list(out)
    assert first.abs().max() > 0


def test_w8a8_linear_same_bits_on_every_isa():
    lin, g = _linear(40, 256, seed=2, bias=True)
    q = Int8Linear(lin, activation_bits=8)
    x = torch.randn(40, 256, generator=g) * torch.logspace(-2, 1, 256)
    out = {}
    for name, lib in _isa_libs().items():
        q._fn = lib.hetserve_qlinear
        out[name] = q(x)
    first = next(iter(out.values()))
    assert all(torch.equal(first, o) for o in out.values()), list(out)


def test_grouped_int8_keeps_int16_activations():
    """GGUF q8_0 experts (int8 with a scale per 32 columns) ignore W8A8: their tiles read int16
    rows, so int8 ones would only lose precision."""
    from hetserve.quant.packed import Int8Rows, PackedExperts

    g = torch.Generator().manual_seed(4)
    e, h, inter = 4, 256, 128
    w13 = torch.randn(e, 2 * inter, h, generator=g) * 0.1
    w2 = torch.randn(e, h, inter, generator=g) * 0.1
    packed = PackedExperts(
        tuple(Int8Rows.q8_0(w) for w in w13), tuple(Int8Rows.q8_0(w) for w in w2)
    )
    x, tw, ids = _inputs(g, 40, h, e, 2)
    out = []
    for bits in (16, 8):
        b = create_backend(
            "cpu-int8", ExpertWeights(None, None, packed=packed), activation_bits=bits
        )
        assert b.group_size == 32 and b.kernel_fmt() == F_I8
        out.append(b.forward(x, tw, ids))
    assert torch.equal(out[0], out[1])


def test_activation_bits_is_checked():
    lin, _ = _linear(8, 32, seed=1)
    with pytest.raises(ValueError, match="activation_bits"):
        Int8Linear(lin, activation_bits=4)
    from hetserve.config_sections import MoEConfig

    with pytest.raises(ValueError, match="activation_bits"):
        MoEConfig(activation_bits=12)
