"""The int8 expert GEMMs on AMX tiles (native/moe_amx.h): the AVX paths' int32 sums, so their
results bit for bit. Everywhere: the AMX loops built on a C model of the tile instructions
(`amx-emulated`) against this CPU's own build, which checks the weight packing, the hi / lo
split of the int16 activations and the KBLOCK boundaries. On a CPU with AMX-INT8: the real
build against the AVX-512 one (and Linux must grant the tiles)."""

from __future__ import annotations

import pytest
import torch

from hetserve import native
from hetserve.moe.experts import ExpertWeights, create_backend

pytestmark = pytest.mark.skipif(
    bool(native.native_unavailable_reason()), reason="native kernels unavailable"
)


def _layer(h: int, inter: int, e: int, bias: bool, seed: int, bits: int = 16):
    g = torch.Generator().manual_seed(seed)
    w = ExpertWeights(
        torch.randn(e, 2 * inter, h, generator=g) * 0.1,
        torch.randn(e, h, inter, generator=g) * 0.1,
        torch.randn(e, 2 * inter, generator=g) if bias else None,
        torch.randn(e, h, generator=g) if bias else None,
    )
    return create_backend("cpu-int8", w, kernel="native", activation_bits=bits), g


def _outputs(
    libs: dict, h: int, inter: int, tokens: int, bias: bool, seed: int, bits: int = 16
) -> dict:
    e, k = 4, 2
    b, g = _layer(h, inter, e, bias, seed, bits)
    # activations over a wide range, so the int16 rows use their high bytes, signs both ways
    x = torch.randn(tokens, h, generator=g) * torch.logspace(-2, 1, h)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    tw = torch.rand(tokens, k, generator=g)
    out = {}
    for name, lib in libs.items():
        b._bind(lib)
        out[name] = b.forward(x, tw, ids)
    return out


@pytest.mark.parametrize(
    "h,inter,tokens,bias",
    [
        (256, 128, 40, False),  # about 20 pairs per expert: a whole and a partial A tile
        (192, 64, 33, True),  # ~16 pairs per expert: about the GEMM threshold, biases
        (4160, 64, 36, False),  # hidden past one KBLOCK (4096): two float adds per sum
    ],
)
def test_emulated_amx_tiles_equal_this_cpus_build(h, inter, tokens, bias):
    here, err = native.build_for(native.isa())
    emulated, err2 = native.build_for("amx-emulated")
    assert here is not None and emulated is not None, err or err2
    assert emulated.hetserve_amx_ready() == 1
    out = _outputs({"here": here, "emulated": emulated}, h, inter, tokens, bias, seed=h + tokens)
    assert torch.equal(out["here"], out["emulated"])
    assert out["here"].abs().max() > 0


def test_sizes_off_the_tile_take_the_avx_path():
    """K not a multiple of 64 (hidden 100): the tiles are not used, the AVX path's results."""
    here, _ = native.build_for(native.isa())
    emulated, _ = native.build_for("amx-emulated")
    out = _outputs({"here": here, "emulated": emulated}, 100, 40, 24, True, seed=3)
    assert torch.equal(out["here"], out["emulated"])


@pytest.mark.skipif(not native.cpu_has("amx"), reason="this CPU lacks AMX-INT8")
@pytest.mark.parametrize("bits", [16, 8])  # 8: W8A8, one TDPBSSD against the byte tiles
@pytest.mark.parametrize("tokens", [9, 40, 200])
def test_amx_tiles_equal_avx512(tokens, bits):
    amx, err = native.build_for("amx")
    avx, err2 = native.build_for("avx512bf16")
    assert amx is not None and avx is not None, err or err2
    assert amx.hetserve_amx_ready() == 1, "Linux refused the AMX tile state (arch_prctl)"
    out = _outputs({"amx": amx, "avx512": avx}, 2048, 1408, tokens, False, seed=tokens, bits=bits)
    assert torch.equal(out["amx"], out["avx512"])
    assert out["amx"].abs().max() > 0


@pytest.mark.parametrize("k,n,tokens", [(256, 40, 40), (128, 16, 17), (100, 22, 20)])
def test_emulated_amx_linears_equal_this_cpus_build(k, n, tokens):
    """The int8 linears' GEMM (16 tokens or more on AVX-512) on the same tiles: rows past the
    last quad (40 and 22 rows: a strip of zero quads), inputs the layout pads (100: stored as
    128)."""
    from torch import nn

    from hetserve.layers.int8_linear import Int8Linear

    g = torch.Generator().manual_seed(k + n)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.1)
        lin.bias.copy_(torch.randn(n, generator=g))
    q = Int8Linear(lin)
    assert q.kernel == "native"
    x = torch.randn(tokens, k, generator=g) * torch.logspace(-2, 1, k)
    out = {}
    for name in (native.isa(), "amx-emulated"):
        lib, err = native.build_for(name)
        assert lib is not None, err
        q._fn = lib.hetserve_qlinear
        out[name] = q(x)
    assert torch.equal(out[native.isa()], out["amx-emulated"])
    assert out["amx-emulated"].abs().max() > 0
