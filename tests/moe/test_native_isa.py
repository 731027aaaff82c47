"""The native kernels' instruction sets: where the CPU has AVX-512 (BW/VL/VNNI) the q4_K, int4,
MXFP4, FP8 and fp32 microkernels take 512-bit paths. The integer formats must give the AVX2 build's
results bit for bit (the same integer sums, the same fp32 steps); FP8 sums its fp32 products in
another order, or (avx512bf16: BF16 and GFNI too) multiplies bf16 pairs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetserve import native
from hetserve.errors import InvalidInputError
from hetserve.layers.int8_linear import Int8Linear
from hetserve.moe.experts import ExpertWeights, create_backend
from hetserve.quant.packed import PackedExperts
from tests.moe.test_gguf_experts import PACK, E, H, K, _experts
from tests.moe.test_odd_sizes import DENSE
from tests.moe.test_packed_experts import PACKERS

pytestmark = [
    pytest.mark.skipif(
        bool(native.native_unavailable_reason()), reason="native kernels unavailable"
    ),
    pytest.mark.skipif(
        not native.cpu_has("avx512"), reason="this CPU lacks AVX-512 BW/VL/VNNI: one build only"
    ),
]


def _libs():
    libs = {}
    for name in native.ISA_FLAGS:
        if not native.cpu_has(name):
            continue  # avx512bf16 where the CPU has BF16 and GFNI as well
        lib, err = native.build_for(name)
        assert lib is not None, err
        libs[name] = lib
    return libs


@pytest.mark.parametrize("n", [36, 22])  # 22: a last quad of zero rows (padding)
@pytest.mark.parametrize("t", [1, 2, 3, 5])
def test_q4k_linear_avx512_equals_avx2(t, n):
    k = 768  # three super-blocks per row; nine row quads, or six
    g = torch.Generator().manual_seed(t)
    lin = nn.Linear(k, n, bias=False)
    lin.packed_weight = PACKERS["q4k"][0](torch.randn(n, k, generator=g) * 0.1)
    q = Int8Linear(lin)
    assert q.kernel == "native"
    x = torch.randn(t, k, generator=g) * torch.logspace(-2, 1, k)  # uneven super-blocks
    out = {}
    for name, lib in _libs().items():
        q._fn = lib.hetserve_qlinear
        out[name] = q(x)
    assert all(torch.equal(out["avx2"], got) for got in out.values())
    assert out["avx2"].abs().max() > 0


@pytest.mark.parametrize("fmt", ["q4k", "int4", "mxfp4", "int8", "fp8"])
@pytest.mark.parametrize("t", [1, 2, 7])
def test_packed_experts_avx512_equal_avx2(fmt, t):
    """Every format with a 512-bit path, at token counts covering the pair tails: the integer
    formats bit for bit (on every build this CPU runs); FP8 (fp32 multiply-adds in 16 lanes
    instead of 8) to fp32 rounding, and on the avx512bf16 build (inputs as two bf16, within
    2^-18 of each; subnormal weights read as zero) to 5e-5. q8_0 has no 512-bit path: the same
    code under the wider flags must not change either."""
    pack, backend = PACKERS[fmt]
    e, h, inter, k = 6, 512, 256, 2
    g = torch.Generator().manual_seed(10 + t)
    packed = PackedExperts(
        tuple(pack(torch.randn(2 * inter, h, generator=g) * 0.05) for _ in range(e)),
        tuple(pack(torch.randn(h, inter, generator=g) * 0.05) for _ in range(e)),
    )
    b = create_backend(backend, ExpertWeights(None, None, packed=packed))
    x = torch.randn(t, h, generator=g) * torch.logspace(-2, 1, h)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    tw = torch.rand(t, k, generator=g)
    out = {}
    for name, lib in _libs().items():
        b._bind(lib)
        out[name] = b.forward(x, tw, ids)
    scale = out["avx2"].abs().max()
    for name, got in out.items():
        if fmt != "fp8":
            assert torch.equal(out["avx2"], got), name
        else:
            tol = 5e-5 if name == "avx512bf16" else 1e-5
            assert (out["avx2"] - got).abs().max() <= tol * scale, name
    assert scale > 0


@pytest.mark.parametrize("t", [1, 2, 3, 8])
def test_fp32_experts_avx512_close_to_avx2(t):
    """fp32 has a 512-bit quad too (rows one after the other for one token, two accumulators
    per row and token): its sums run in another order than the AVX2 build's, so to fp32
    rounding; the AVX2 form is what CPUs without AVX-512 run, checked here against the torch
    reference as well."""
    e, h, inter, k = 6, 512, 256, 2
    g = torch.Generator().manual_seed(20 + t)
    w = ExpertWeights(
        torch.randn(e, 2 * inter, h, generator=g) * 0.05,
        torch.randn(e, h, inter, generator=g) * 0.05,
    )
    b = create_backend("cpu-fp32", w, kernel="native")
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    tw = torch.rand(t, k, generator=g)
    ref = create_backend("torch", w).forward(x, tw, ids)
    scale = ref.abs().max()
    for name, lib in _libs().items():
        b._bind(lib)
        assert (b.forward(x, tw, ids) - ref).abs().max() <= 1e-5 * scale, name
    assert scale > 0


def test_isa_setting_is_checked(monkeypatch):
    before = native.isa()
    monkeypatch.setenv("HETSERVE_NATIVE_ISA", "sse9")
    native.isa.cache_clear()
    try:
        with pytest.raises(InvalidInputError, match="HETSERVE_NATIVE_ISA='sse9' is not one of"):
            native.isa()
        monkeypatch.setenv("HETSERVE_NATIVE_ISA", "avx2")
        native.isa.cache_clear()
        assert native.isa() == "avx2"
    finally:
        monkeypatch.undo()
        native.isa.cache_clear()
    assert native.isa() == before


@pytest.mark.parametrize("name", ["fp32", "int8", "int4-g64", "mxfp4", "fp8"])
@pytest.mark.parametrize("t", [1, 2, 7])
def test_odd_sizes_avx512_equal_avx2(name, t):
    """Layers at sizes off every kernel unit (hidden 100, intermediate 40: stored padded) on
    each build: the integer formats bit for bit, fp32 and FP8 as their aligned tests allow."""
    backend, kernel, opts, _, _ = DENSE[name]
    e, h, inter, k = 5, 100, 40, 3
    g = torch.Generator().manual_seed(30 + t)
    w = ExpertWeights(
        torch.randn(e, 2 * inter, h, generator=g) * 0.1, torch.randn(e, h, inter, generator=g) * 0.1
    )
    b = create_backend(backend, w, kernel=kernel, **opts)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    tw = torch.rand(t, k, generator=g)
    out = {}
    for isa_name, lib in _libs().items():
        b._bind(lib)
        out[isa_name] = b.forward(x, tw, ids)
    scale = out["avx2"].abs().max()
    for isa_name, got in out.items():
        if name in ("fp32", "fp8"):
            tol = 5e-5 if isa_name == "avx512bf16" and name == "fp8" else 1e-5
            assert (out["avx2"] - got).abs().max() <= tol * scale, isa_name
        else:
            assert torch.equal(out["avx2"], got), isa_name
    assert scale > 0


@pytest.mark.parametrize("t", [8, 29])
def test_int8_prefill_tiles_avx512_equal_avx2(t):
    """Prefill's GEMM tiles (16 tokens or more per expert or linear on AVX-512, 8 on AVX2: at 8
    AVX-512's 4-token rows meet AVX2's tiles): vpdpwssd on 16 rows per vector on AVX-512,
    vpmaddwd on 8 on AVX2, the same int32 sums: bit for bit, with sizes off the units (hidden
    100, intermediate 40; a linear of 22 rows), biases too."""
    e, h, inter, k = 3, 100, 40, 3
    g = torch.Generator().manual_seed(40 + t)
    w = ExpertWeights(
        torch.randn(e, 2 * inter, h, generator=g) * 0.1,
        torch.randn(e, h, inter, generator=g) * 0.1,
        torch.randn(e, 2 * inter, generator=g),
        torch.randn(e, h, generator=g),
    )
    b = create_backend("cpu-int8", w, kernel="native")
    lin = Int8Linear(nn.Linear(h, 22))
    x = torch.randn(3 * t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(3 * t)])
    tw = torch.rand(3 * t, k, generator=g)
    out = {}
    for name, lib in _libs().items():
        b._bind(lib)
        lin._fn = lib.hetserve_qlinear
        out[name] = (b.forward(x, tw, ids), lin(x))
    for name, (experts, linear) in out.items():
        assert torch.equal(out["avx2"][0], experts), name
        assert torch.equal(out["avx2"][1], linear), name
    assert out["avx2"][0].abs().max() > 0


def _same_on_every_build(b, x, tw, ids):
    """Experts `b`'s forward on every build this CPU has, held to the AVX2 build's bits."""
    out = {}
    for name, lib in _libs().items():
        b._bind(lib)
        out[name] = b.forward(x, tw, ids)
    for name, got in out.items():
        assert torch.equal(out["avx2"], got), name
    return out["avx2"]


@pytest.mark.parametrize(
    "kinds",
    [("q6_K", "q6_K"), ("q5_K", "q5_K"), ("q3_K", "q2_K"), ("q4_K", "q6_K"),
     ("random_iq4_xs", "random_iq4_nl"), ("random_iq2_xxs", "random_iq3_s"),
     ("random_iq3_xxs", "random_iq2_xs"), ("random_iq2_s", "random_iq1_m"),
     ("random_iq1_m", "random_iq1_s")],
)  # fmt: skip
@pytest.mark.parametrize("t", [1, 2, 7, 40])
def test_gguf_experts_avx512_equal_avx2(kinds, t):
    """The GGUF block types' row kernels and (40 tokens: 40 pairs on each of 3 experts) their
    prefill tiles give the same bits on every build: the AVX-512 VNNI build fuses some integer
    multiply-adds (vpdpbusd) where the AVX2 one adds vpmaddwd's sums, the avx512bf16 build
    looks IQ3_XXS, IQ3_S and IQ2_XXS points up by planes, activations in plane order, and the
    AVX-512 builds take IQ2_XS, IQ2_S, IQ1_S and IQ1_M 64 columns a vector (quad_iqgl)."""
    b = create_backend("cpu-gguf", ExpertWeights(None, None, packed=_experts(kinds, seed=7)))
    g = torch.Generator().manual_seed(40 + t)
    x, tw = torch.randn(t, H, generator=g), torch.rand(t, K, generator=g)
    ids = (torch.tensor([[1, 6, 3]] * t) if t == 40 else
           torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]))  # fmt: skip
    assert _same_on_every_build(b, x, tw, ids).abs().max() > 0


@pytest.mark.parametrize("kind", ["random_iq2_xxs", "random_iq2_xs", "random_iq3_xxs",
                                  "random_iq3_s"])  # fmt: skip
@pytest.mark.parametrize("t", [1, 2, 3])
def test_grid_planes_odd_super_blocks_equal_avx2(kind, t):
    """Rows of 1280 and 768 columns (5 and 3 super-blocks: the IQ2_XXS planes kernel takes two
    a vector and an odd last one alone; 3 tokens: a pair and one) give every build's bits."""
    h, inter = 1280, 768
    g = torch.Generator().manual_seed(5)
    w13 = torch.randn(E, 2 * inter, h, generator=g) * 0.05
    w2 = torch.randn(E, h, inter, generator=g) * 0.05
    packed = PackedExperts(tuple(PACK[kind](w) for w in w13), tuple(PACK[kind](w) for w in w2))
    b = create_backend("cpu-gguf", ExpertWeights(None, None, packed=packed))
    x, tw = torch.randn(t, h, generator=g), torch.rand(t, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    out = _same_on_every_build(b, x, tw, ids)
    # and near the file's numbers in float64 (the activations' int8 rounding well inside 5%)
    deq13 = torch.stack([m.dequantize() for m in packed.w13]).double()
    deq2 = torch.stack([m.dequantize() for m in packed.w2]).double()
    ref = torch.zeros(t, h, dtype=torch.float64)
    for i in range(t):
        for j in range(K):
            e = int(ids[i, j])
            a = deq13[e] @ x[i].double()
            act = torch.nn.functional.silu(a[:inter]) * a[inter:] * float(tw[i, j])
            ref[i] += deq2[e] @ act
    assert float((out.double() - ref).abs().max()) <= 0.05 * float(ref.abs().max())
