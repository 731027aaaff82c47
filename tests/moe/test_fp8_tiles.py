"""FP8 experts at prefill on bf16 tiles (native/moe_prefill.c, AVX512-BF16 + GFNI builds): an
expert meeting 8 pairs or more converts each strip of 16 rows to bf16 once and runs vdpbf16ps
tiles against all its pairs; fewer pairs, and every other build, run the row kernel. The two
sum the same products in another fp32 order: a token's result batched equals it alone to fp32
rounding, and both equal the dequantized experts to FP8's own error."""

from __future__ import annotations

import pytest
import torch

from hetserve import native
from hetserve.moe.experts import ClampedSwiGLU, ExpertWeights, create_backend
from hetserve.quant.packed import PackedExperts
from tests.moe.test_packed_experts import PACKERS

pytestmark = pytest.mark.skipif(
    bool(native.native_unavailable_reason()), reason="native kernels unavailable"
)
TILES = native.isa() in ("avx512bf16", "amx")  # the builds with the bf16 tiles


def _alone(b, x, tw, ids):
    rows = [b.forward(x[t : t + 1], tw[t : t + 1], ids[t : t + 1]) for t in range(len(x))]
    return torch.cat(rows)


@pytest.mark.parametrize(
    ("h", "inter", "e", "k", "t", "bias"),
    [
        (512, 256, 3, 2, 40, False),  # ~27 pairs an expert: the tiles, 4 groups of 128
        (256, 384, 2, 1, 230, True),  # ~115 pairs: past a block of 96; biases
        (512, 256, 8, 2, 12, False),  # ~3 pairs an expert: the row kernel alone
    ],
)
@pytest.mark.parametrize("act", ["silu", "clamped"])
def test_fp8_tiles_agree_with_the_row_kernel(h, inter, e, k, t, bias, act):
    pack = PACKERS["fp8"][0]
    g = torch.Generator().manual_seed(h + t)
    w13 = [torch.randn(2 * inter, h, generator=g) * 0.05 for _ in range(e)]
    w2 = [torch.randn(h, inter, generator=g) * 0.05 for _ in range(e)]
    b13 = torch.randn(e, 2 * inter, generator=g) if bias else None
    b2 = torch.randn(e, h, generator=g) if bias else None
    packed = PackedExperts(tuple(pack(w) for w in w13), tuple(pack(w) for w in w2))
    activation = ClampedSwiGLU(1.702, 7.0) if act == "clamped" else "silu"
    b = create_backend(
        "cpu-fp8", ExpertWeights(None, None, b13, b2, packed=packed), activation=activation
    )
    x = torch.randn(t, h, generator=g) * torch.logspace(-1, 1, h)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    tw = torch.rand(t, k, generator=g)
    batch, alone = b.forward(x, tw, ids), _alone(b, x, tw, ids)
    scale = float(alone.abs().max())
    assert scale > 0
    # vdpbf16ps rounds each pair's sum into fp32 lanes: another order, a few ulps apart (the
    # clamped activation's 115 pairs an expert: 2.3e-6 of the largest output)
    assert float((batch - alone).abs().max()) <= 1e-5 * scale
    if TILES and t > 3 * e:  # the tiles ran: another order of the same fp32 sums
        assert not torch.equal(batch, alone)
    # the dequantized experts (the file's exact numbers) in fp32: FP8's bound, no more
    dense = ExpertWeights(
        torch.stack([m.dequantize() for m in packed.w13]),
        torch.stack([m.dequantize() for m in packed.w2]), b13, b2,
    )  # fmt: skip
    ref = create_backend("torch", dense, activation=activation).forward(x, tw, ids)
    assert float((batch - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
