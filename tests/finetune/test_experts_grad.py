"""The routed experts' backward (finetune/experts_grad.py) against autograd through the torch
reference backend, and the quantized ones against their stated bound."""

import pytest
import torch

from hetserve.finetune.experts_grad import (
    GradExperts,
    experts_backward,
    make_grad_weights,
    quantized_grad_bound,
    torch_backward,
)
from hetserve.moe.experts import ExpertWeights, TorchExperts, create_backend
from hetserve.native import native_unavailable_reason

native = pytest.mark.skipif(native_unavailable_reason() is not None, reason="no native kernels")


def layer(e=8, h=64, i=32, t=23, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    tw = torch.rand(t, k, generator=g)
    gout = torch.randn(t, h, generator=g)
    return w13, w2, x, tw, ids, gout


def autograd_reference(w13, w2, x, tw, ids, gout):
    xr, twr = x.clone().requires_grad_(), tw.clone().requires_grad_()
    y = TorchExperts(ExpertWeights(w13, w2)).forward(xr, twr, ids)
    return torch.autograd.grad(y, (xr, twr), gout)


@native
@pytest.mark.parametrize("t", [1, 5, 23, 70])
def test_native_fp32_backward_equals_autograd(t):
    w13, w2, x, tw, ids, gout = layer(t=t, seed=t)
    dx, dw = experts_backward(make_grad_weights(w13, w2), x, tw, ids, gout)
    rx, rw = autograd_reference(w13, w2, x, tw, ids, gout)
    torch.testing.assert_close(dx, rx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, rw, rtol=1e-5, atol=1e-5)


@native
def test_native_fp32_backward_tiles_and_tails():
    """The fp32 path's tiling: ~50 pairs per expert (blocks of 24, then 2), rows past a tile of
    256 (H = 520), a column strip of 8 after those of 16 (I = 40), pair groups of 6 with a rest."""
    w13, w2, x, tw, ids, gout = layer(e=4, h=520, i=40, t=100, k=2, seed=3)
    dx, dw = experts_backward(make_grad_weights(w13, w2), x, tw, ids, gout)
    # Against float64, with fp32 rounding relative to the largest value (|dw| reaches ~50 here:
    # fp32 autograd itself is 1.8e-5 off, and the earlier axpy kernel 2.4e-5).
    rx, rw = autograd_reference(*(v.double() if v.is_floating_point() else v
                                  for v in (w13, w2, x, tw, ids, gout)))  # fmt: skip
    for ours, ref in ((dx, rx), (dw, rw)):
        assert (ours.double() - ref).abs().max() <= 2e-6 * ref.abs().max()


def test_torch_backward_equals_autograd():
    w13, w2, x, tw, ids, gout = layer()
    dx, dw = torch_backward(make_grad_weights(w13, w2), x, tw, ids, gout)
    rx, rw = autograd_reference(w13, w2, x, tw, ids, gout)
    torch.testing.assert_close(dx, rx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, rw, rtol=1e-5, atol=1e-5)


@native
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_backward_exact_for_quantized_weights_and_within_bound(bits):
    w13, w2, x, tw, ids, gout = layer(h=64, i=64, t=31)
    gw = make_grad_weights(w13, w2, bits=bits, group_size=32)
    dx, dw = experts_backward(gw, x, tw, ids, gout)
    # Exact (fp32 rounding) for the dequantized weights the forward uses...
    rx, rw = torch_backward(gw, x, tw, ids, gout)
    torch.testing.assert_close(dx, rx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, rw, rtol=1e-5, atol=1e-5)
    # ...and within the stated bound of the fp32 model's gradient.
    fx, _ = autograd_reference(w13, w2, x, tw, ids, gout)
    bound = quantized_grad_bound(gw, x, tw, ids, gout, w13, w2)
    err = (dx - fx).abs()
    assert (err <= bound + 1e-5).all(), (err - bound).max()
    assert err.max() > 0  # the quantization really changed something


@native
@pytest.mark.parametrize("backend", ["cpu-fp32", "cpu-int8"])
def test_grad_experts_wraps_a_placed_backend(backend):
    w13, w2, x, tw, ids, gout = layer(h=64, i=64)
    inner = create_backend(backend, ExpertWeights(w13, w2))
    bits = 32 if backend == "cpu-fp32" else 8
    wrapped = GradExperts(inner, make_grad_weights(w13, w2, bits=bits))
    xr, twr = x.clone().requires_grad_(), tw.clone().requires_grad_()
    y = wrapped.forward(xr, twr, ids)
    torch.testing.assert_close(y, inner.forward(x, tw, ids))
    (y * gout).sum().backward()
    assert xr.grad is not None and twr.grad is not None
    if backend == "cpu-fp32":
        rx, rw = autograd_reference(w13, w2, x, tw, ids, gout)
        torch.testing.assert_close(xr.grad, rx, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(twr.grad, rw, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cuda_bf16_activations_with_host_experts():
    w13, w2, x, tw, ids, gout = layer()
    gw = make_grad_weights(w13, w2)
    wrapped = GradExperts(TorchExperts(ExpertWeights(w13, w2)), gw)
    xc = x.cuda().bfloat16().requires_grad_()
    twc = tw.cuda().requires_grad_()
    inner = TorchExperts(ExpertWeights(w13.cuda().bfloat16(), w2.cuda().bfloat16()))
    wrapped.inner = inner
    y = wrapped.forward(xc, twc, ids.cuda())
    (y.float() * gout.cuda()).sum().backward()
    rx, _ = autograd_reference(w13, w2, x, tw, ids, gout)
    torch.testing.assert_close(xc.grad.float().cpu(), rx, rtol=2e-2, atol=2e-2)


def test_int4_training_weights_refuse_sizes_off_the_group():
    import pytest as _pytest

    from hetserve.errors import InvalidInputError
    from hetserve.finetune.experts_grad import make_grad_weights

    w13, w2 = torch.randn(2, 2 * 40, 72), torch.randn(2, 72, 40)  # hidden 72, inter 40
    with _pytest.raises(InvalidInputError, match="multiples of the group size 64"):
        make_grad_weights(w13, w2, bits=4, group_size=64)
    assert make_grad_weights(w13, w2, bits=8).fmt == 8


@native
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("bits", [32, 8])
def test_training_backward_shares_the_host_backends_weights(tiny_model, bits, dtype):
    """fp32 or int8 host experts: the backward reads the forward backend's own copy (same
    storage, so one copy of the experts; the native kernel runs, also where the model is bf16,
    the accelerator's default, which it does not read), and computes what it computed on a
    copy of its own: int8 through the backend's quad layout (fmt 9) bit for bit as on plain
    rows rounded the same way (fmt 8), fp32 as the torch reference on the loaded weights."""
    from hetserve.finetune.experts_grad import native_backward_applies
    from hetserve.finetune.model import ExpertsPlacement, load_for_training
    from hetserve.model.loader import load_model

    path = tiny_model("deepseek-v3")
    model = load_for_training(path, "cpu", dtype, ExpertsPlacement(True, bits=bits))
    plain = load_model(path, device="cpu", dtype=dtype)  # the loaded weights, as a reference
    loaded = dict(plain.routed_experts())
    layers = list(model.routed_experts())
    assert layers
    g = torch.Generator().manual_seed(0)
    for name, fused in layers:
        assert fused.w13.numel() == 0  # the loaded weights were released
        gws = {id(b.grad_weights): b for b in fused._phase_backends.values()}
        assert len(gws) == 1  # one set for every phase
        backend = next(iter(gws.values()))
        gw, inner = backend.grad_weights, backend.inner
        if bits == 32:
            w13, w2 = inner.fp32_weights()
            assert gw.fmt == 32 and gw.w13.data_ptr() == w13.data_ptr()
            assert gw.w2.data_ptr() == w2.data_ptr()
        else:
            q13, s13, q2, s2 = inner.int8_rows()
            assert gw.fmt == 9
            assert [t.data_ptr() for t in (gw.w13, gw.s13, gw.w2, gw.s2)] == [
                t.data_ptr() for t in (q13, s13, q2, s2)
            ]
        ref = make_grad_weights(loaded[name].w13.data, loaded[name].w2.data, bits)
        e, h = gw.w13.shape[0], gw.hidden
        assert (h, gw.inter) == (ref.hidden, ref.inter)
        for x in range(e):
            for a, b in zip(gw.dequantized(x), ref.dequantized(x), strict=True):
                assert torch.equal(a, b)
        x, gout = torch.randn(9, h, generator=g), torch.randn(9, h, generator=g)
        ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(9)])
        tw = torch.rand(9, 2, generator=g)
        assert native_backward_applies(gw, x)
        dx, dw = experts_backward(gw, x, tw, ids, gout)
        if bits == 8:  # the same rounding on plain rows: the same bits
            rdx, rdw = experts_backward(ref, x, tw, ids, gout)
            assert torch.equal(dx, rdx) and torch.equal(dw, rdw)
        else:
            rdx, rdw = torch_backward(ref, x, tw, ids, gout)
            torch.testing.assert_close(dx, rdx, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-5)
