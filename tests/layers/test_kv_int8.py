"""The 8-bit KV cache's error, derived and checked (`--kv-cache-dtype int8`).

Each cached row (a token's K or V of one KV head; MLA: the token's latent row) is stored as
int8 with the scale s = absmax / 127, rounded to nearest: every element is off by at most
s / 2 = absmax / 254. Through one attention read, with E = scale * max_j |q|_1 * absmax(K_j) / 254
the largest score change, each softmax weight moves by a factor within [e^-2E, e^2E], so every
output element is off by at most

    (e^(2E) - 1) * max |V| + max_j absmax(V_j) / 254

against attention over the exact fp32 rows: `attention_bound` below, checked on the native
kernel. What that does to a model's logprobs depends on the layers after it; tests/engine's
test_kv_cache_dtype states the measured end-to-end figures and their bounds.
"""

from __future__ import annotations

import math

import pytest
import torch

from hetserve.kv.paged import PagedKVCache, quantize_rows
from hetserve.layers.attention import batched_decode_sdpa, build_metadata
from hetserve.layers.native_decode import native_decode_attention
from hetserve.native import native_unavailable_reason

BS = 16


def test_int8_rows_within_half_a_step_and_zero_rows_stay_zero():
    x = torch.randn(50, 4, 40) * torch.logspace(-3, 3, 50).view(50, 1, 1)
    x[3, 1] = 0.0
    q, s = quantize_rows(x, torch.int8)
    assert q.dtype is torch.int8 and s.shape == (50, 4) and q.abs().max() <= 127
    err = (q.float() * s.unsqueeze(-1) - x).abs()
    assert (err <= x.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-6)).all()
    assert s[3, 1] == 0 and not q[3, 1].any()


def test_fp8_rows_within_e4m3s_relative_step():
    x = torch.randn(64, 2, 32)
    q, s = quantize_rows(x, torch.float8_e4m3fn)
    back = q.float() * s.unsqueeze(-1)
    # 3 mantissa bits: 2^-4 relative for normal values; below e4m3's smallest normal
    # (2^-6 of the scale) the step is 2^-9 of the scale
    bound = torch.maximum(x.abs() * 2**-4, s.unsqueeze(-1) * 2**-10)
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


def attention_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> float:
    """The module docstring's bound for q [B, H, D] over k [B, L, Hkv, D], v [B, L, Hkv, Dv]."""
    e = scale * q.abs().sum(-1).max() * k.abs().amax(-1).max() / 254
    return float((math.exp(2 * e) - 1) * v.abs().max() + v.abs().amax(-1).max() / 254)


@pytest.mark.skipif(native_unavailable_reason() is not None, reason="native kernels unavailable")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_native_int8_attention_within_the_derived_bound(seed):
    gen = torch.Generator().manual_seed(seed)
    b, hkv, g, d, num_blocks = 6, 2, 4, 64, 40
    exact = PagedKVCache([[(hkv, d), (hkv, d)]], num_blocks, BS, torch.float32, "cpu")
    int8 = PagedKVCache([[(hkv, d), (hkv, d)]], num_blocks, BS, torch.int8, "cpu")
    slots = torch.arange(num_blocks * BS)
    rows = [torch.randn(len(slots), hkv, d, generator=gen) * 2 for _ in range(2)]
    exact.write(0, slots, *rows)
    int8.write(0, slots, *rows)
    lens = torch.randint(20, 100, (b,), generator=gen).tolist()
    spans = [
        (n - 1, 1, list(range(1 + 6 * i, 1 + 6 * i + -(-n // BS)))) for i, n in enumerate(lens)
    ]
    dec = build_metadata(spans, BS, "cpu").decode
    assert dec is not None
    q = torch.randn(b, hkv * g, d, generator=gen)
    scale = d**-0.5
    n = dec.slots.shape[1]
    k, v = (t.view(b, n, hkv, d) for t in exact.gather(0, dec.slots.flatten()))
    ref = batched_decode_sdpa(q, k, v, dec.mask, scale)
    out = native_decode_attention(q, *int8.layers[0], dec, int8, scale, None, None, int8.scales[0])
    err = (out - ref).abs().max().item()
    bound = attention_bound(q, k, v, scale)
    assert 0 < err <= bound + 1e-5
