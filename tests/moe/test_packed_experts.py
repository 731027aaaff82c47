"""Experts packed in published formats (FP8 blocks, MXFP4, int4 groups, GGUF q4_K, grouped
int8) and the native kernels that read them, against a torch reference that rounds activations
exactly as the kernel does (int16 per row for the integer formats, int8 per 256 for q4_K, a
sum of two bf16 for FP8 where the avx512bf16 build reads FP8 with vdpbf16ps, which also reads
e4m3 subnormals as zero), with biases and gpt-oss's clamped SwiGLU as well as silu."""

from __future__ import annotations

import time

import pytest
import torch

from hetserve.errors import InvalidInputError
from hetserve.moe.experts import ClampedSwiGLU, ExpertWeights, create_backend, gated_activation
from hetserve.native import fp8_activations
from hetserve.quant.layout import pack_int4_rows
from hetserve.quant.packed import Fp8Rows, Int4Rows, Int8Rows, Mxfp4Rows, PackedExperts, Q4KRows
from hetserve.quant.quantize import (
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    q8k_round,
    quantize_fp8_blocks,
    quantize_int4_groupwise,
    quantize_mxfp4,
)
from hetserve.testing.tiny_gguf import quantize_q4_k

E, H, INTER, K = 8, 256, 256, 3  # q4_K rows need multiples of 256


@pytest.fixture(autouse=True)
def _native():
    from hetserve.native import native_unavailable_reason

    if native_unavailable_reason() is not None:
        pytest.skip(f"native kernel unavailable: {native_unavailable_reason()}")


def _dense(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.05
    w2 = torch.randn(E, H, INTER, generator=g) * 0.05
    return w13, w2, torch.randn(E, 2 * INTER, generator=g), torch.randn(E, H, generator=g) * 0.1


def _fp8(w):
    q, s = quantize_fp8_blocks(w)
    return Fp8Rows(q, s.repeat_interleave(128, dim=0)[: w.shape[0]])


def _int4(w, group=32):
    q, scale, low = quantize_int4_groupwise(w, group)
    return Int4Rows(pack_int4_rows(q), scale, low)


def _q4k(w):
    raw = quantize_q4_k(w.numpy())
    return Q4KRows(torch.from_numpy(raw.reshape(w.shape[0], -1, 144)))


PACKERS = {
    "fp8": (_fp8, "cpu-fp8"),
    "q4k": (_q4k, "cpu-int4"),
    "mxfp4": (lambda w: Mxfp4Rows(*quantize_mxfp4(w)), "cpu-mxfp4"),
    "int4": (_int4, "cpu-int4"),
    "int8": (Int8Rows.q8_0, "cpu-int8"),
}


def _packed(fmt: str, w13, w2) -> PackedExperts:
    pack = PACKERS[fmt][0]
    return PackedExperts(tuple(pack(w) for w in w13), tuple(pack(w) for w in w2))


def _kernel_view(m) -> torch.Tensor:
    """The weights as the kernel multiplies them: dequantized, and for FP8 on bf16 activations
    without e4m3's subnormals (exponent field 0; zero stays zero)."""
    w = m.dequantize()
    if isinstance(m, Fp8Rows) and fp8_activations() == "bf16x2":
        w = torch.where((m.w.view(torch.uint8) & 0x78) == 0, torch.zeros_like(w), w)
    return w


def _round16(v: torch.Tensor) -> torch.Tensor:
    """The kernel's activation rounding: per row to the int16 grid of step max|v| / 16383."""
    s = v.abs().amax(dim=-1, keepdim=True) / 16383
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(v * (1.0 / s)).clamp(-16383, 16383) * s


def _round_bf16x2(v: torch.Tensor) -> torch.Tensor:
    """hi + lo, hi = bf16(v), lo = bf16(v - hi), rounding to nearest even as vcvtneps2bf16."""
    hi = v.to(torch.bfloat16).float()
    return hi + (v - hi).to(torch.bfloat16).float()


# (rounding, levels): a flip of one rounding moves a value by at most max|v| / levels (bf16x2:
# one unit in the last place of lo, <= 2^-7 |lo| <= 2^-16 |v|)
ROUNDINGS = {
    "int16": (_round16, 16383),
    "q8k": (q8k_round, 127),
    "bf16x2": (_round_bf16x2, 1 << 16),
    None: (lambda v: v, 0),
}


def _rounding(fmt: str) -> str | None:
    if fmt == "fp8":
        return "bf16x2" if fp8_activations() == "bf16x2" else None
    return "q8k" if fmt == "q4k" else "int16"


def assert_emulated(out: torch.Tensor, emulated: tuple[torch.Tensor, float]) -> None:
    """The kernel against its emulation: fp32 rounding (2e-6 relative), plus now and then an
    activation that sits on a rounding boundary and lands on the other int16 step: each such
    flip moves outputs by at most one step times a weight (allowed: 4 per output; the
    activation rounding itself is all I steps of every pair)."""
    ref, flip = emulated
    err = (out - ref).abs()
    assert float(err.max()) <= 2e-6 * float(ref.abs().max()) + 4 * flip


def _emulated(w13, w2, b13, b2, act, x, tw, ids, rounding: str | None):
    """The layer as the kernel computes it, in float64 from the kernel's rounded activations;
    and what one activation landing on the neighbouring step can move an output by (a pair)."""
    glu = gated_activation(act)
    rnd, levels = ROUNDINGS[rounding]
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    flip = 0.0
    for t in range(x.shape[0]):
        xt = rnd(x[t])
        for j in range(ids.shape[1]):
            e, w = int(ids[t, j]), float(tw[t, j])
            h = w13[e].double() @ xt.double() + (0 if b13 is None else b13[e].double())
            a = (glu(h[:INTER], h[INTER:]) * w).float()
            if levels:
                step = float(a.abs().max()) / levels
                flip = max(
                    flip,
                    step * float(w2[e].abs().max())
                    + float(x[t].abs().max()) / levels * float(w13[e].abs().max()),
                )
                a = rnd(a)
            out[t] += w2[e].double() @ a.double() + (0 if b2 is None else w * b2[e].double())
    return out.float(), flip


def _routing(t: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    return x, torch.rand(t, K, generator=g), ids


@pytest.mark.parametrize("fmt", sorted(PACKERS))
@pytest.mark.parametrize("act", ["silu", ClampedSwiGLU(alpha=1.702, limit=0.3)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_kernel_matches_emulated_reference(fmt, act, bias):
    w13, w2, b13, b2 = _dense()
    b13, b2 = (b13, b2) if bias else (None, None)
    packed = _packed(fmt, w13, w2)
    weights = ExpertWeights(None, None, b13, b2, packed=packed)
    deq13 = torch.stack([_kernel_view(m) for m in packed.w13])
    deq2 = torch.stack([_kernel_view(m) for m in packed.w2])
    x, tw, ids = _routing(5)
    backend = create_backend(PACKERS[fmt][1], weights, activation=act)
    out = backend.forward(x, tw, ids)
    ref = _emulated(deq13, deq2, b13, b2, act, x, tw, ids, rounding=_rounding(fmt))
    assert_emulated(out, ref)
    # The torch backend on the dequantized weights differs only by the activation rounding:
    # int16 per row, or for q4_K int8 per 256 columns (llama.cpp's q8_K), ~100x coarser.
    plain = create_backend("torch", weights, activation=act).forward(x, tw, ids)
    tol = 3e-2 if fmt == "q4k" else 1e-3
    assert (out - plain).abs().max() <= tol * plain.abs().max()


@pytest.mark.parametrize("fmt", sorted(PACKERS))
def test_packed_kernels_keep_the_published_numbers(fmt):
    """Built from packed experts, a backend stores exactly those numbers: rebuilding it from the
    dequantized weights (re-quantizing) would give different outputs for most formats, while
    from the packed experts it equals the emulation of the packed values."""
    w13, w2, _, _ = _dense(seed=3)
    packed = _packed(fmt, w13, w2)
    x, tw, ids = _routing(3, seed=4)
    out = create_backend(PACKERS[fmt][1], ExpertWeights(None, None, packed=packed))
    deq = ExpertWeights(
        torch.stack([_kernel_view(m) for m in packed.w13]),
        torch.stack([_kernel_view(m) for m in packed.w2]),
    )
    ref = _emulated(deq.w13, deq.w2, None, None, "silu", x, tw, ids, rounding=_rounding(fmt))
    assert_emulated(out.forward(x, tw, ids), ref)
    assert out.nbytes() < 0.35 * (w13.nbytes + w2.nbytes)


@pytest.mark.parametrize("t", [1, 2, 7, 40])
@pytest.mark.parametrize("backend", ["cpu-mxfp4", "cpu-fp8"])
def test_new_backends_from_dense_weights(backend, t):
    """cpu-mxfp4 and cpu-fp8 on unquantized experts (the bench): quantized per expert, then the
    same kernel; token counts cover the microkernel tails and the 32-pair cache block."""
    w13, w2, _, _ = _dense(seed=5)
    x, tw, ids = _routing(t, seed=t)
    b = create_backend(backend, ExpertWeights(w13, w2))
    fmt = "mxfp4" if backend == "cpu-mxfp4" else "fp8"
    packed = _packed(fmt, w13, w2)
    deq13 = torch.stack([_kernel_view(m) for m in packed.w13])
    deq2 = torch.stack([_kernel_view(m) for m in packed.w2])
    ref = _emulated(deq13, deq2, None, None, "silu", x, tw, ids, rounding=_rounding(fmt))
    assert_emulated(b.forward(x, tw, ids), ref)


@pytest.mark.parametrize("t", [1, 2, 7, 40])
def test_q4k_token_counts(t):
    """q4_K super-blocks at token counts that cover the microkernel tails (pairs of tokens)
    and the 32-pair cache block; 4.5 bits per weight as in the file."""
    w13, w2, _, _ = _dense(seed=8)
    packed = _packed("q4k", w13, w2)
    x, tw, ids = _routing(t, seed=t)
    b = create_backend("cpu-int4", ExpertWeights(None, None, packed=packed))
    assert b.fmt == 5 and b.nbytes() == E * 3 * H * INTER * 9 // 16
    deq13 = torch.stack([_kernel_view(m) for m in packed.w13])
    deq2 = torch.stack([_kernel_view(m) for m in packed.w2])
    ref = _emulated(deq13, deq2, None, None, "silu", x, tw, ids, rounding="q8k")
    assert_emulated(b.forward(x, tw, ids), ref)


def test_packed_int4_keeps_its_group_size_and_int8_its_groups():
    w13, w2, _, _ = _dense(seed=6)
    int4 = ExpertWeights(None, None, packed=_packed("int4", w13, w2))
    assert create_backend("cpu-int4", int4).group_size == 32
    q4k = ExpertWeights(None, None, packed=_packed("q4k", w13, w2))
    assert create_backend("cpu-int4", q4k).group_size == 32
    int8 = ExpertWeights(None, None, packed=_packed("int8", w13, w2))
    assert create_backend("cpu-int8", int8).group_size == 32
    # An explicit other group size requantizes (expert by expert) instead.
    assert create_backend("cpu-int4", int4, group_size=64).group_size == 64


def test_fp8_and_mxfp4_codecs_are_exact_round_trips():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(200, 320, generator=g)
    q, s = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    deq = dequantize_fp8_blocks(q, s, (128, 128))
    q2, s2 = quantize_fp8_blocks(deq)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (200, 10, 16) and scales.dtype == torch.uint8
    again = quantize_mxfp4(dequantize_mxfp4(blocks, scales))
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)
    # Per block: elements within 6 x scale are off by at most half a step of the e2m1 grid.
    deq = dequantize_mxfp4(blocks, scales).view(200, 10, 32)
    scale = torch.exp2(scales.float() - 127)[..., None]
    inside = w.view(200, 10, 32).abs() <= 6 * scale
    assert ((deq - w.view(200, 10, 32)).abs() <= scale + 1e-7)[inside].all()


@pytest.mark.parametrize("fmt", [*sorted(PACKERS), "fp32"])
def test_touch_reads_exactly_the_routed_experts_bytes(fmt):
    """`touch` (bench moe-kernel's read-pattern limit) reads every byte the kernel streams for
    the experts a routing picks, once, and nothing of the others, the last expert included; a
    bad id is a typed error."""
    w13, w2, _, _ = _dense(seed=6)
    if fmt == "fp32":
        b = create_backend("cpu-fp32", ExpertWeights(w13, w2))
    else:
        b = create_backend(PACKERS[fmt][1], ExpertWeights(None, None, packed=_packed(fmt, w13, w2)))
    per_expert = sum(t.nbytes for t in b._tensors if t is not None) // E
    for ids in (torch.tensor([[E - 1, 0, 3]]), torch.tensor([[1, 2, 5], [5, 1, 6], [7, 2, 1]])):
        touched, seconds = b.touch(ids)
        assert touched == int(ids.unique().numel()) * per_expert and seconds > 0
        # the kernel's own time (C, entry to return) lies within the Python call around it
        x = torch.randn(ids.shape[0], b.hidden)
        t0 = time.perf_counter()
        b.forward(x, torch.rand(ids.shape), ids)
        wall = time.perf_counter() - t0
        assert 0 < b.last_kernel_seconds() <= wall
    with pytest.raises(InvalidInputError):
        b.touch(torch.tensor([[0, E, 1]]))


@pytest.mark.parametrize("gate_up,rows,chunk", [(True, 4, 16), (False, 4, 16), (True, 16, 4)])
def test_layouts_filled_expert_by_expert_equal_the_stacked_layer(gate_up, rows, chunk):
    from hetserve.moe.native_layout import stacked_quads
    from hetserve.quant.layout import interleave_quads, pair_gate_up

    gen = torch.Generator().manual_seed(0)
    mats = [torch.randint(-127, 128, (64, 96), generator=gen, dtype=torch.int8) for _ in range(3)]
    stacked = torch.stack(mats)
    want = interleave_quads(pair_gate_up(stacked, rows) if gate_up else stacked, chunk, rows)
    given = list(mats)
    assert torch.equal(stacked_quads(given, chunk, gate_up, rows), want)
    assert given == [None] * 3  # a list's entries are let go as they are laid out
    assert torch.equal(stacked_quads(tuple(mats), chunk, gate_up, rows), want)  # a tuple stays
    with pytest.raises(ValueError, match="differ in shape"):
        stacked_quads([*mats, mats[0][:32]], chunk, gate_up, rows)


@pytest.mark.parametrize("fmt", ["mxfp4", "int8", "q4k", "int4"])
@pytest.mark.parametrize("bias", [False, True])
def test_prefill_tiles_match_the_emulated_reference(fmt, bias):
    """Experts meeting many tokens (40 pairs each on 2 experts: prefill) run the GEMM tiles of
    moe_kgemm.h (MXFP4 and int4 tiles and q8_0 groups decoded once into int16 panels, their
    scales, and int4's minimums, per group of 32 columns; q4_K by super-block) on the same
    rounded activations as the row kernels: the emulation's bound holds, with biases and
    gpt-oss's clamped SwiGLU."""
    w13, w2, b13, b2 = _dense(seed=7)
    b13, b2 = (b13, b2) if bias else (None, None)
    packed = _packed(fmt, w13, w2)
    act = ClampedSwiGLU(alpha=1.702, limit=0.3)
    weights = ExpertWeights(None, None, b13, b2, packed=packed)
    deq13 = torch.stack([_kernel_view(m) for m in packed.w13])
    deq2 = torch.stack([_kernel_view(m) for m in packed.w2])
    x, tw, _ = _routing(40, seed=8)
    ids = torch.tensor([[2, 5, 7]] * 40)
    out = create_backend(PACKERS[fmt][1], weights, activation=act).forward(x, tw, ids)
    ref = _emulated(deq13, deq2, b13, b2, act, x, tw, ids, rounding=_rounding(fmt))
    assert_emulated(out, ref)


@pytest.mark.parametrize("fmt", list(PACKERS))
@pytest.mark.parametrize("handed_over", [True, False])
def test_a_handed_over_layer_lets_each_expert_go_as_it_is_laid_out(fmt, handed_over, monkeypatch):
    """ExpertWeights.handed_over (the streaming load's sole backend of a layer): the backend
    empties the packed lists as it lays the experts out, so each loaded matrix (or the codes
    taken from it) is freed once its layout is written, and nothing of the layer is left
    after; without it the caller's matrices stay. The same layout bytes either way."""
    import weakref

    from hetserve.moe import native_layout

    w13, w2, _, _ = _dense(11)
    name = PACKERS[fmt][1]
    opts = {"group_size": 32} if fmt in ("q4k", "int4") else {}
    kept = create_backend(name, ExpertWeights(None, None, packed=_packed(fmt, w13, w2)), **opts)
    p = _packed(fmt, w13, w2)
    given = ExpertWeights(None, None, packed=PackedExperts(list(p.w13), list(p.w2)),
                          handed_over=handed_over)  # fmt: skip
    refs = [weakref.ref(m) for m in (*p.w13, *p.w2)]
    del p
    worst, original = [], native_layout.taken

    def watched(mats):  # how many of the list's entries are alive as expert e is handed out
        entries = [weakref.ref(m) for m in mats]
        for e, m in original(mats):
            alive = sum(r() is not None for r in entries)
            worst.append(alive - (len(entries) - e + 1))  # <= 0: those before e-1 are gone
            yield e, m

    monkeypatch.setattr(native_layout, "taken", watched)
    backend = create_backend(name, given, **opts)
    assert worst
    if handed_over:
        assert max(worst) <= 0
        assert all(r() is None for r in refs)  # nothing of the loaded layer is left
    else:  # the caller's (its lists of the layer stay whole)
        assert all(r() is not None for r in refs) and None not in given.packed.w13
    for a, b in zip(kept._tensors, backend._tensors, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("fmt", sorted(PACKERS))
def test_prefill_rows_rounded_on_every_thread_match_one(fmt):
    """200 tokens: their activation rows (both phases) are rounded by the job's threads in
    blocks of rows; every row on its own, so the output is the one-thread call's, bit for bit,
    and it matches the emulation of the packed numbers."""
    w13, w2, _, _ = _dense(seed=7)
    packed = _packed(fmt, w13, w2)
    weights = ExpertWeights(None, None, packed=packed)
    x, tw, ids = _routing(200, seed=8)
    one = create_backend(PACKERS[fmt][1], weights, num_threads=1).forward(x, tw, ids)
    two = create_backend(PACKERS[fmt][1], weights, num_threads=2).forward(x, tw, ids)
    assert torch.equal(one, two)
    deq13 = torch.stack([_kernel_view(m) for m in packed.w13])
    deq2 = torch.stack([_kernel_view(m) for m in packed.w2])
    ref = _emulated(deq13, deq2, None, None, "silu", x, tw, ids, rounding=_rounding(fmt))
    assert_emulated(two, ref)
