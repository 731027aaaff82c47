"""Routed experts at sizes off their kernels' units: hidden and intermediate sizes that are not
multiples of 8, 16, 32 or a group, odd numbers of experts and top-k, on every CPU backend and
weight format, against the torch reference within each format's stated bound
(quant/quantize.py). Such sizes are stored with zero weights appended (quant/layout.py) and the
kernels pad their inputs with zeros: these tests are what says that adds nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetserve.moe.experts import ExpertWeights, create_backend
from hetserve.native import fp8_activations, native_unavailable_reason
from hetserve.quant.layout import pad_bias, pad_gate_up, pad_tensor
from hetserve.quant.packed import PackedExperts
from hetserve.quant.quantize import (
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    expand_blocks,
    fp8_weight_bound,
    mxfp4_weight_bound,
    quantize_fp8_blocks,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
    quantize_mxfp4,
)
from tests.moe.test_packed_experts import PACKERS

SILU_LIPSCHITZ = 1.1  # max |d silu / dx| = 1.0998
SIZES = [(72, 24), (100, 40), (130, 100), (72, 130)]  # (hidden, intermediate)
ROUTINGS = [(5, 3, 7), (7, 1, 2), (3, 3, 1)]  # (experts, top-k, tokens)
FP8_ACT = "bf16x2" if fp8_activations() == "bf16x2" else "none"

# name -> (backend, kernel, options, weight rounding, activation rounding)
DENSE = {
    "fp32": ("cpu-fp32", "native", {}, "none", "none"),
    "fp32-library": ("cpu-fp32", "library", {}, "none", "none"),
    "int8": ("cpu-int8", "native", {}, "int8", "int16"),
    "int8-fbgemm": ("cpu-int8", "library", {}, "int8", "fbgemm"),
    "int4-g32": ("cpu-int4", "native", {"group_size": 32}, "int4", "int16"),
    "int4-g64": ("cpu-int4", "native", {"group_size": 64}, "int4", "int16"),
    "int4-g128": ("cpu-int4", "native", {"group_size": 128}, "int4", "int16"),
    "int4-g32-library": ("cpu-int4", "library", {"group_size": 32}, "int4", "none"),
    "int4-g128-library": ("cpu-int4", "library", {"group_size": 128}, "int4", "none"),
    "mxfp4": ("cpu-mxfp4", "native", {}, "mxfp4", "int16"),
    "fp8": ("cpu-fp8", "native", {}, "fp8", FP8_ACT),
}
# Checkpoint formats, at sizes their blocks can hold (q4_K: 256 columns, MXFP4 and q8_0: 32,
# int4: whole groups; FP8's last block may be partial, so any size): weights exact, only the
# kernel's activation rounding (and FP8's subnormals on the bf16 build) against the reference.
PACKED = {
    "fp8": ("fp8" if FP8_ACT == "bf16x2" else "none", FP8_ACT, SIZES),
    "int4": ("none", "int16", [(96, 160)]),
    "int8": ("none", "int16", [(96, 160)]),
    "mxfp4": ("none", "int16", [(96, 160)]),
    "q4k": ("none", "q8k", [(256, 256)]),
}


@pytest.fixture(autouse=True)
def _native():
    if native_unavailable_reason() is not None:
        pytest.skip(f"native kernel unavailable: {native_unavailable_reason()}")


def _rounded(w: torch.Tensor, kind: str, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One matrix [N, K] as the backend holds it (w_hat: its quantizer's numbers, which appended
    zeros do not change) and the stated |w - w_hat| per element (quant/quantize.py)."""
    k = w.shape[1]
    if kind == "none":
        return w, torch.zeros_like(w)
    if kind == "int8":  # s[n] / 2, s[n] = max|w[n]| / 127
        q, scale = quantize_int8_per_channel(w)
        return q.float() * scale[:, None], (scale[:, None] / 2).expand_as(w)
    if kind == "int4":  # scale / 2 of the element's group (a short last group: its own)
        q, scale, low = quantize_int4_groupwise(w, group)
        scale, low = (t.repeat_interleave(group, dim=1)[:, :k] for t in (scale, low))
        return q.float() * scale + low, scale / 2
    if kind == "mxfp4":  # 2 x the block's scale (zeros appended: the kernel's blocks)
        blocks, scales = quantize_mxfp4(F.pad(w, (0, -k % 32)))
        return dequantize_mxfp4(blocks, scales)[:, :k], mxfp4_weight_bound(scales)[:, :k]
    q, scale = quantize_fp8_blocks(w)
    w_hat = dequantize_fp8_blocks(q, scale, (128, 128))
    if FP8_ACT == "bf16x2":  # that build reads e4m3 subnormals (exponent field 0) as zero
        w_hat = torch.where((q.view(torch.uint8) & 0x78) == 0, 0.0, w_hat)
    return w_hat, fp8_weight_bound(w, scale)


def _rounded_layer(weights: ExpertWeights, kind: str, group: int = 0):
    """(the layer as the backend holds it, the stated |w - w_hat| of w13 and of w2)."""
    dense = weights.dense()
    (h13, d13), (h2, d2) = (
        (torch.stack(t) for t in zip(*(_rounded(m, kind, group) for m in mats), strict=True))
        for mats in (dense.w13, dense.w2)
    )
    return ExpertWeights(h13, h2, weights.b13, weights.b2), d13, d2


def _act_err(v: torch.Tensor, slack: torch.Tensor, kind: str) -> torch.Tensor:
    """|v_hat - v| per element for the rows v [R, K] the kernel rounds, each known only within
    `slack`: int16 per row (step max|v| / 16383), fbgemm's 7 bits per call (the call holds
    some of these rows: their range bounds its), q4_K's int8 per 256, two bf16 (2^-16 |v|)."""
    top = v.abs() + slack
    if kind == "none":
        return torch.zeros_like(v)
    if kind == "int16":
        return (top.amax(dim=1, keepdim=True) / 16383 / 2).expand_as(v)
    if kind == "fbgemm":
        full = (v + slack).clamp(min=0).max() - (v - slack).clamp(max=0).min()
        return (full / 127 / 2).expand_as(v)
    if kind == "q8k":
        r, k = v.shape
        return (top.reshape(r, -1, 256).amax(dim=2) / 254).repeat_interleave(256, dim=1)
    return top * 2.0**-16


def _layer_bound(w13, w2, d13, d2, b13, b2, x, tw, ids, act: str) -> torch.Tensor:
    """The per-linear bounds carried through silu(gate) * up and the weighted sum: weights
    w_hat within d of w, inputs rounded within _act_err (the kernel's w_hat multiplies them)."""
    inter = w2.shape[2]
    ex = _act_err(x, torch.zeros_like(x), act)
    slots = []
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, w = int(ids[t, j]), float(tw[t, j])
            h = w13[e] @ x[t] + (0 if b13 is None else b13[e])
            dh = d13[e] @ x[t].abs() + (w13[e].abs() + d13[e]) @ ex[t]
            (gate, up), (dg, du) = h.split(inter), dh.split(inter)
            a = w * F.silu(gate) * up
            da = abs(w) * (F.silu(gate).abs() * du + SILU_LIPSCHITZ * dg * (up.abs() + du))
            slots.append((t, e, a, da))
    a_all = torch.stack([s[2] for s in slots])
    ea = _act_err(a_all, torch.stack([s[3] for s in slots]), act)
    bound = torch.zeros(x.shape[0], w2.shape[1])
    for (t, e, a, da), ea_p in zip(slots, ea, strict=True):
        bound[t] += (w2[e].abs() + d2[e]) @ (da + ea_p) + d2[e] @ a.abs()
    return bound


def _case(h, i, e, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    w13[0, 3, h - 1] = 2.0  # an outlier in the last (padded) group / block of a row
    b13 = torch.randn(e, 2 * i, generator=g) * 0.1 if bias else None
    b2 = torch.randn(e, h, generator=g) * 0.1 if bias else None
    return w13, w2, b13, b2


def _routing(h, e, k, t, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return x, torch.rand(t, k, generator=g), ids


def _within(out, weights, d13, d2, x, tw, ids, act) -> float:
    """max |out - the torch reference on `weights`| / _layer_bound (plus fp32 rounding)."""
    ref = create_backend("torch", weights).forward(x, tw, ids)
    assert out.shape == ref.shape
    w = weights.dense()
    bound = _layer_bound(w.w13, w.w2, d13, d2, w.b13, w.b2, x, tw, ids, act)
    return float(((out - ref).abs() / (bound + 1e-5 * ref.abs().max())).max())


def _check(backend, weights, kind, group, x, tw, ids, act):
    """Within the format's stated bound of the reference on the model's weights; and, the tight
    check, within the activation rounding's bound of the reference on the backend's numbers
    (a row, group or gate/up half out of place would be far outside it)."""
    out = backend.forward(x, tw, ids)
    held, d13, d2 = _rounded_layer(weights, kind, group)
    assert _within(out, weights, d13, d2, x, tw, ids, act) <= 1.0
    zero13, zero2 = torch.zeros_like(d13), torch.zeros_like(d2)
    assert _within(out, held, zero13, zero2, x, tw, ids, act) <= 1.0


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: "E{}k{}T{}".format(*r))
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "H{}I{}".format(*s))
@pytest.mark.parametrize("name", sorted(DENSE))
def test_dense_experts_at_odd_sizes(name, size, routing):
    backend, kernel, opts, wkind, act = DENSE[name]
    (h, i), (e, k, t) = size, routing
    w13, w2, _, _ = _case(h, i, e, seed=h + i)
    weights = ExpertWeights(w13, w2)
    b = create_backend(backend, weights, kernel=kernel, **opts)
    assert type(b).__name__.startswith("Native") == (kernel == "native")  # no silent fallback
    x, tw, ids = _routing(h, e, k, t, seed=t)
    _check(b, weights, wkind, opts.get("group_size", 0), x, tw, ids, act)


@pytest.mark.parametrize("name", ["fp32", "fp32-library", "int8", "int4-g64", "int4-g32-library",
                                  "mxfp4", "fp8"])  # fmt: skip
def test_biases_at_odd_sizes(name):
    """Biases are stored at the weights' padded sizes too (gate and up halves apart)."""
    backend, kernel, opts, wkind, act = DENSE[name]
    h, i, e = 100, 40, 5
    w13, w2, b13, b2 = _case(h, i, e, seed=3, bias=True)
    weights = ExpertWeights(w13, w2, b13, b2)
    b = create_backend(backend, weights, kernel=kernel, **opts)
    x, tw, ids = _routing(h, e, 3, 6, seed=4)
    _check(b, weights, wkind, opts.get("group_size", 0), x, tw, ids, act)


@pytest.mark.parametrize("routing", ROUTINGS[:2], ids=lambda r: "E{}k{}T{}".format(*r))
@pytest.mark.parametrize(
    ("fmt", "size"), [(f, s) for f in sorted(PACKED) for s in PACKED[f][2]], ids=str
)
def test_packed_experts_at_odd_sizes(fmt, size, routing):
    pack, backend = PACKERS[fmt]
    wkind, act, _ = PACKED[fmt]
    (h, i), (e, k, t) = size, routing
    w13, w2, _, _ = _case(h, i, e, seed=h * i)
    packed = PackedExperts(tuple(pack(m) for m in w13), tuple(pack(m) for m in w2))
    weights = ExpertWeights(None, None, packed=packed)
    x, tw, ids = _routing(h, e, k, t, seed=t + 1)
    _check(create_backend(backend, weights), weights.dense(), wkind, 0, x, tw, ids, act)


@pytest.mark.parametrize("name", ["fp32", "int8", "mxfp4"])
def test_padding_is_exact(name):
    """Where rounding does not see the appended zeros (fp32; int8's per-row and MXFP4's per-32
    scales are maxima), a layer at odd sizes gives, bit for bit, what the same kernel gives on
    weights, biases and tokens padded by hand to the sizes it stores them at."""
    backend, kernel, opts, _, _ = DENSE[name]
    h, i, e = 100, 40, 5
    hp, ip = (104, 40) if name == "fp32" else (128, 64)
    w13, w2, b13, b2 = _case(h, i, e, seed=7, bias=True)
    odd = create_backend(backend, ExpertWeights(w13, w2, b13, b2), kernel=kernel)
    padded = ExpertWeights(
        pad_gate_up(w13, ip, hp), pad_tensor(w2, hp, ip),
        pad_bias(b13, ip, gate_up=True), pad_bias(b2, hp),
    )  # fmt: skip
    aligned = create_backend(backend, padded, kernel=kernel)
    x, tw, ids = _routing(h, e, 3, 7, seed=8)
    out = odd.forward(x, tw, ids)
    assert torch.equal(out, aligned.forward(F.pad(x, (0, hp - h)), tw, ids)[:, :h])
    assert odd.nbytes() == aligned.nbytes()  # what streams: the padded layout


def test_fp8_and_mxfp4_weight_bounds_hold():
    """The stated per-element bounds of the two float formats (quant/quantize.py), on weights
    with outliers, tiny values (FP8 subnormals) and zeros."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(200, 320, generator=g) * torch.logspace(-6, 1, 320)
    w[5, :64] = 0.0
    q, s = quantize_fp8_blocks(w)
    deq = dequantize_fp8_blocks(q, s, (128, 128))
    bound = fp8_weight_bound(w, s)
    assert ((w - deq).abs() <= bound).all()
    subnormal = deq.abs() < 2.0**-6 * expand_blocks(s, (128, 128), 200, 320)
    assert subnormal.any()  # the avx512bf16 build reads them as zero: still within
    assert ((w - torch.where(subnormal, 0.0, deq)).abs() <= bound).all()
    blocks, scales = quantize_mxfp4(w)
    assert ((w - dequantize_mxfp4(blocks, scales)).abs() <= mxfp4_weight_bound(scales)).all()


@pytest.mark.parametrize("name", ["fp32", "int8", "int4-g64", "mxfp4", "fp8"])
def test_touch_threads_and_bytes_at_odd_sizes(name):
    """bench moe-kernel's `touch` reads the padded layout the kernel streams (every stored byte
    of the routed experts, once), and threads split the padded units without changing a bit."""
    backend, kernel, opts, _, _ = DENSE[name]
    h, i, e = 130, 100, 5
    w13, w2, _, _ = _case(h, i, e, seed=11)
    b = create_backend(backend, ExpertWeights(w13, w2), kernel=kernel, **opts)
    ids = torch.tensor([[e - 1, 0, 3], [3, 1, 0]])
    touched, _ = b.touch(ids)
    assert touched == 4 * sum(t.nbytes for t in b._tensors if t is not None) // e
    x, tw, _ = _routing(h, e, 3, 2, seed=12)
    three = create_backend(backend, ExpertWeights(w13, w2), kernel=kernel, num_threads=3, **opts)
    try:
        assert torch.equal(three.forward(x, tw, ids), b.forward(x, tw, ids))
    finally:
        three.close()
