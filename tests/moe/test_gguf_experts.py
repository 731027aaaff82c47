"""cpu-gguf: GGUF experts in their own block types, W13 and W2 in different ones where a file
mixes them (Q4_K_M: q4_K gate/up beside q6_K down). The kernel against an emulation of its
arithmetic in float64 from the same rounded activations (q8_K: int8 per 256 columns for the
K-quants, int16 per row for q8_0): the integer sums are exact, so what is left is fp32 rounding
(2e-6 relative) and, now and then, an activation on a rounding boundary (one step times a
weight, `flip`)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from hetserve.moe.experts import ExpertWeights, create_backend, gated_activation
from hetserve.native import native_unavailable_reason
from hetserve.quant.gguf import Q5KRows, Q6KRows, q2_k_rows, q3_k_rows, q5_k_rows, q6_k_rows
from hetserve.quant.gguf_iq import iq4_nl_rows, iq4_xs_rows
from hetserve.quant.packed import Int8Rows, PackedExperts, Q4KRows
from hetserve.quant.quantize import q8k_round
from hetserve.testing.ggml_quant import ggml_quantize, ggml_unavailable_reason
from hetserve.testing.gguf_quants import (
    quantize_q2_k,
    quantize_q3_k,
    quantize_q5_k,
    quantize_q6_k,
    random_iq4,
    random_iq_grid,
)
from hetserve.testing.tiny_gguf import quantize_q4_k

pytestmark = pytest.mark.skipif(
    bool(native_unavailable_reason()), reason="native kernels unavailable"
)
E, H, INTER, K = 8, 256, 512, 3


def _q6(w):
    return Q6KRows(torch.from_numpy(quantize_q6_k(w.numpy()).reshape(w.shape[0], -1, 210)))


def _q5(w):
    return Q5KRows(torch.from_numpy(quantize_q5_k(w.numpy()).reshape(w.shape[0], -1, 176)))


def _q4(w):
    return Q4KRows(torch.from_numpy(quantize_q4_k(w.numpy()).reshape(w.shape[0], -1, 144)))


def _q3(w):
    return q3_k_rows(quantize_q3_k(w.numpy()))


def _q2(w):
    return q2_k_rows(quantize_q2_k(w.numpy()))


def _iq4(kind):
    rows = iq4_xs_rows if kind == "IQ4_XS" else iq4_nl_rows
    return lambda w: rows(ggml_quantize(w.numpy(), kind))


def _iq4_random(kind):
    rows = iq4_xs_rows if kind == "IQ4_XS" else iq4_nl_rows
    seed = iter(range(10_000))
    return lambda w: rows(random_iq4(kind, w.shape[0], w.shape[1], next(seed)))


def _grid_random(kind):
    from hetserve.quant.gguf_grid import grid_reader

    seed = iter(range(10_000))
    return lambda w: grid_reader(kind)(random_iq_grid(kind, w.shape[0], w.shape[1], next(seed)))


GRIDS = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]
PACK = {"q4_K": _q4, "q5_K": _q5, "q6_K": _q6, "q3_K": _q3, "q2_K": _q2, "q8_0": Int8Rows.q8_0,
        "iq4_xs": _iq4("IQ4_XS"), "iq4_nl": _iq4("IQ4_NL"),
        "random_iq4_xs": _iq4_random("IQ4_XS"), "random_iq4_nl": _iq4_random("IQ4_NL"),
        **{f"random_{k.lower()}": _grid_random(k) for k in GRIDS}}  # fmt: skip  # fmt: skip
NEEDS_GGML = pytest.mark.skipif(
    bool(ggml_unavailable_reason()), reason=f"llama.cpp's quantizer: {ggml_unavailable_reason()}"
)


def _round16(v):
    s = v.abs().amax(dim=-1, keepdim=True) / 16383
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(v * (1.0 / s)).clamp(-16383, 16383) * s


def _rounding(kind: str):
    return (_round16, 16383) if kind == "q8_0" else (q8k_round, 127)


def _emulated(w13, w2, x, tw, ids, kinds):
    glu = gated_activation("silu")
    (r1, l1), (r2, l2) = _rounding(kinds[0]), _rounding(kinds[1])
    out, flip = torch.zeros(x.shape[0], H, dtype=torch.float64), 0.0
    for t in range(x.shape[0]):
        xt = r1(x[t])
        for j in range(ids.shape[1]):
            e, w = int(ids[t, j]), float(tw[t, j])
            h = w13[e].double() @ xt.double()
            a = (glu(h[:INTER], h[INTER:]) * w).float()
            flip = max(flip, float(a.abs().max()) / l2 * float(w2[e].abs().max())
                       + float(x[t].abs().max()) / l1 * float(w13[e].abs().max()))  # fmt: skip
            out[t] += w2[e].double() @ r2(a).double()
    return out.float(), flip


def _experts(kinds, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.05
    w2 = torch.randn(E, H, INTER, generator=g) * 0.05
    return PackedExperts(
        tuple(PACK[kinds[0]](w) for w in w13), tuple(PACK[kinds[1]](w) for w in w2)
    )


IQ = [("iq4_xs", "iq4_xs"), ("iq4_nl", "iq4_nl"), ("iq4_xs", "q6_K"), ("q4_K", "iq4_nl"),
      ("iq4_xs", "q8_0")]  # fmt: skip
MIXES = [("q6_K", "q6_K"), ("q5_K", "q5_K"), ("q4_K", "q6_K"), ("q5_K", "q6_K"),
         ("q4_K", "q5_K"), ("q4_K", "q8_0"), ("q8_0", "q6_K"),
         ("random_iq4_xs", "random_iq4_xs"), ("random_iq4_nl", "random_iq4_nl"),
         ("random_iq4_xs", "q5_K"), ("q3_K", "q3_K"), ("q2_K", "q2_K"), ("q2_K", "q3_K"),
         ("q3_K", "q5_K"), ("q4_K", "q2_K"), ("q2_K", "q8_0"),
         *((f"random_{k.lower()}",) * 2 for k in GRIDS), ("random_iq2_xxs", "random_iq3_xxs"),
         ("random_iq1_s", "q4_K"), ("random_iq1_m", "q8_0"), ("q2_K", "random_iq3_s"),
         *(pytest.param(m, marks=NEEDS_GGML) for m in IQ)]  # fmt: skip


@pytest.mark.parametrize("kinds", MIXES)
@pytest.mark.parametrize("t", [1, 2, 7, 40])
def test_each_projection_keeps_its_type(kinds, t):
    packed = _experts(kinds)
    b = create_backend("cpu-gguf", ExpertWeights(None, None, packed=packed))
    g = torch.Generator().manual_seed(t)
    x, tw = torch.randn(t, H, generator=g), torch.rand(t, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    deq13 = torch.stack([m.dequantize() for m in packed.w13])
    deq2 = torch.stack([m.dequantize() for m in packed.w2])
    ref, flip = _emulated(deq13, deq2, x, tw, ids, kinds)
    out = b.forward(x, tw, ids)
    assert float((out - ref).abs().max()) <= 2e-6 * float(ref.abs().max()) + 4 * flip
    # the file's bytes, no wider copy: the layer's size is the sum of its types' blocks
    if "q8_0" not in kinds:
        assert b.nbytes() == packed.nbytes
    names = {"q8_0": "int8", "q4_K": "int4"}
    assert b.formats == tuple(names.get(k, k).removeprefix("random_") for k in kinds)


@NEEDS_GGML
@pytest.mark.parametrize("kind", ["IQ4_XS", "IQ4_NL"])
def test_i_quant_blocks_read_as_gguf_reads_them(kind):
    """llama.cpp's own IQ4_XS / IQ4_NL blocks (its quantizer): our rows hold gguf's numbers."""
    w = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32)
    w[2, 64:96] = 0.0  # an all-zero sub-block
    raw = ggml_quantize(w, kind)
    ours = (iq4_xs_rows if kind == "IQ4_XS" else iq4_nl_rows)(raw).dequantize().numpy()
    assert np.array_equal(
        ours, gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    )


@NEEDS_GGML
def test_iq4_nl_rows_off_256_pad_with_zero_blocks():
    """IQ4_NL is what llama.cpp's IQ4_XS files hold where a row is off 256 (here I = 96): the
    kernel pads rows to 256 with zero blocks; the padded activations stay zero."""
    g = torch.Generator().manual_seed(3)
    e, h, inter = 4, 256, 96
    w13 = [_iq4("IQ4_NL")(torch.randn(2 * inter, h, generator=g) * 0.05) for _ in range(e)]
    w2 = [_iq4("IQ4_NL")(torch.randn(h, inter, generator=g) * 0.05) for _ in range(e)]
    b = create_backend("cpu-gguf", ExpertWeights(None, None, packed=PackedExperts(w13, w2)))
    x, tw = torch.randn(3, h, generator=g), torch.rand(3, 2, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [3, 1]])
    glu, ref = gated_activation("silu"), torch.zeros(3, h, dtype=torch.float64)
    for t in range(3):
        for j in range(2):
            k = int(ids[t, j])
            hh = w13[k].dequantize().double() @ q8k_round(x[t]).double()
            a = (glu(hh[:inter], hh[inter:]) * tw[t, j]).float()
            a = q8k_round(torch.nn.functional.pad(a, (0, 256 - inter)))[:inter]
            ref[t] += w2[k].dequantize().double() @ a.double()
    out = b.forward(x, tw, ids)
    assert float((out - ref.float()).abs().max()) <= 1e-3 * float(ref.abs().max())


@pytest.mark.parametrize("kind", ["IQ4_XS", "IQ4_NL"])
def test_random_i_quant_blocks_read_as_gguf_reads_them(kind):
    """Random blocks (the kernels' tests without llama.cpp) decode as gguf decodes them."""
    raw = random_iq4(kind, 4, 512, 0)
    ours = (iq4_xs_rows if kind == "IQ4_XS" else iq4_nl_rows)(raw).dequantize().numpy()
    theirs = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    assert np.array_equal(ours, theirs)
    assert 0.0 < np.abs(theirs).max() < 0.2


# quantizer, rows, the bound on |w - w_hat| for 0.1-scaled normal weights (amax ~0.3-0.45 per
# 16 columns: q6_K's half step amax / 62, q5_K's (max - min) / 62, q3_K's amax / 8, q2_K's
# (max - min) / 6 and its minimum's rounding)
KQUANTS = {
    "q6_K": (quantize_q6_k, q6_k_rows, 0.012),
    "q5_K": (quantize_q5_k, q5_k_rows, 0.02),
    "q3_K": (quantize_q3_k, q3_k_rows, 0.06),
    "q2_K": (quantize_q2_k, q2_k_rows, 0.15),
}


@pytest.mark.parametrize("kind", list(KQUANTS))
def test_blocks_read_as_gguf_reads_them(kind):
    g = np.random.default_rng(0)
    w = g.standard_normal((6, 512)).astype(np.float32) * 0.1
    w[1, :40] = 0.0  # an all-zero sub-block
    quantize, rows, bound = KQUANTS[kind]
    raw = quantize(w)
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    theirs = gguf.quants.dequantize(raw, qtype)
    ours = rows(raw).dequantize().numpy()
    assert np.array_equal(ours, theirs)
    # the reference quantizers' own error: half a step of the sub-block's scale, plus the
    # scale's rounding to a multiple of d (q6_K, q5_K, q3_K 6-bit, q2_K 4-bit)
    assert np.abs(theirs - w).max() < bound


@pytest.mark.parametrize("kind", ["Q3_K", "Q2_K"])
def test_random_k_quant_blocks_read_as_gguf_reads_them(kind):
    """Every bit pattern is a valid q3_K / q2_K block (the fp16 d and dmin set finite)."""
    g = np.random.default_rng(2)
    bb, at = (110, (108,)) if kind == "Q3_K" else (84, (80, 82))
    raw = g.integers(0, 256, (5, 3, bb), dtype=np.uint8)
    for o in at:
        raw[..., o : o + 2] = g.uniform(-1e-3, 1e-3, (5, 3, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(5, -1)
    theirs = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    ours = (q3_k_rows if kind == "Q3_K" else q2_k_rows)(raw).dequantize().numpy()
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize(
    "kinds",
    [("q6_K", "q6_K"), ("q5_K", "q5_K"), ("q4_K", "q6_K"), ("random_iq4_xs", "q5_K"),
     ("q4_K", "q4_K"), ("random_iq4_xs", "random_iq4_xs"), ("q5_K", "q8_0"),
     ("random_iq4_nl", "random_iq4_nl"), ("q8_0", "q6_K"), ("q8_0", "q8_0"), ("q3_K", "q3_K"),
     ("q2_K", "q2_K"), ("q4_K", "q2_K"), ("q2_K", "q6_K"),
     *((f"random_{k.lower()}",) * 2 for k in GRIDS), ("random_iq1_s", "q6_K")],
)  # fmt: skip
def test_prefill_tiles_agree_with_the_row_kernels(kinds):
    """An expert meeting many tokens (prefill) runs its K-quant / IQ4 / q8_0 rows dequantized to
    int16 panels on the GEMM tiles (moe_kgemm.h): the same rounded activations and exact integer
    sums per scale group as the row kernels that take one or two tokens, so a token's output is
    its single-token call's up to the order of fp32 additions, unless that order moved one of
    phase 2's activations across an int8 rounding boundary (`flip`, one step times a weight).
    130 tokens on 2 experts: 130 pairs each, past the tiles' threshold of 8 and their blocks of
    96 pairs; H = 256 and INTER = 512 give phase 1 one super-block per row and phase 2 two."""
    packed = _experts(kinds, seed=3)
    b = create_backend("cpu-gguf", ExpertWeights(None, None, packed=packed))
    g = torch.Generator().manual_seed(5)
    t = 130
    x, tw = torch.randn(t, H, generator=g), torch.rand(t, 2, generator=g)
    ids = torch.tensor([[1, 6]] * t)
    full = b.forward(x, tw, ids)
    alone = torch.cat([b.forward(x[i : i + 1], tw[i : i + 1], ids[i : i + 1]) for i in range(t)])
    deq13 = torch.stack([m.dequantize() for m in packed.w13])
    deq2 = torch.stack([m.dequantize() for m in packed.w2])
    ref, flip = _emulated(deq13, deq2, x, tw, ids, kinds)
    for out in (full, alone):
        assert float((out - ref).abs().max()) <= 2e-6 * float(ref.abs().max()) + 4 * flip
    if kinds[1] != "q8_0":  # q8_0's int16 rounding has 128x the boundaries, tiny steps
        same = (full - alone).abs().amax(dim=1) <= 2e-6 * float(alone.abs().max())
        assert int(same.sum()) >= 0.9 * t  # a flip moves one token's row; most have none
