"""The fused head of a GQA layer (q/k norm + rotary + KV cache write, one C call) against the
module path it replaces: RMSNorm and RotaryEmbedding modules, then PagedKVCache.write."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hetserve.kv.paged import PagedKVCache
from hetserve.layers.attention import ForwardContext, build_metadata
from hetserve.layers.native_decode import native_qk_rope_cache
from hetserve.layers.norm import RMSNorm
from hetserve.layers.rotary import RopeConfig, RotaryEmbedding
from hetserve.native import native_unavailable_reason

pytestmark = pytest.mark.skipif(
    native_unavailable_reason() is not None,
    reason=f"native kernels unavailable: {native_unavailable_reason()}",
)
BS = 8


def _layer(nq, nkv, d, qk_norm, interleaved, seed, kv_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    norms = (None, None)
    if qk_norm:
        norms = tuple(RMSNorm(d, 1e-6).requires_grad_(False) for _ in range(2))
        for n in norms:
            n.weight.copy_(torch.rand(d, generator=g) + 0.5)
    rope = RotaryEmbedding(d, 64, RopeConfig(theta=10000.0), interleaved=interleaved)
    attn = SimpleNamespace(layer_idx=0, q_norm=norms[0], k_norm=norms[1], rotary=[rope])
    kv = PagedKVCache([[(nkv, d), (nkv, d)]], 12, BS, kv_dtype, "cpu")
    # a prefill chunk of 5 tokens and two decodes, in blocks out of order
    meta = build_metadata([(0, 5, [3]), (20, 1, [7, 2, 9]), (9, 1, [4, 11])], BS, "cpu")
    qkv = torch.randn(meta.positions.shape[0], (nq + 2 * nkv) * d, generator=g)
    return attn, norms, rope, ForwardContext(meta, kv), qkv


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("nq,nkv,d", [(4, 2, 16), (6, 1, 24), (3, 3, 10)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
def test_fused_equals_module_path(qk_norm, interleaved, nq, nkv, d, kv_dtype):
    attn, (qn, kn), rope, ctx, qkv = _layer(nq, nkv, d, qk_norm, interleaved, nq * d, kv_dtype)
    t = qkv.shape[0]
    q, k, v = qkv.split((nq * d, nkv * d, nkv * d), dim=-1)  # strided column views
    q_rot = native_qk_rope_cache(attn, q, k, v, ctx)
    assert q_rot is not None and q_rot.shape == (t, nq, d)
    k_cache, v_cache = (x.clone() for x in ctx.kv.layers[0])
    scales = [x.clone() for x in ctx.kv.scales[0]]  # int8's; none else
    k_rows = ctx.kv.rows(0, 0, ctx.meta.slot_mapping)

    for x in ctx.kv.parts():
        x.zero_()
    q_ref, k_ref = q.reshape(t, nq, d), k.reshape(t, nkv, d)
    if qk_norm:
        q_ref, k_ref = qn(q_ref), kn(k_ref)
    pos = ctx.meta.positions
    q_ref, k_ref = rope(q_ref, pos), rope(k_ref, pos)
    ctx.kv.write(0, ctx.meta.slot_mapping, k_ref, v.reshape(t, nkv, d))
    torch.testing.assert_close(q_rot, q_ref, rtol=1e-6, atol=1e-6)
    # fp16: both round to nearest-even; an fp32 ulp apart before rounding may land one fp16
    # ulp apart (1e-3 relative)
    if kv_dtype is torch.int8:
        # int8: the same rounding of K rows an fp32 ulp apart lands at most one step apart
        step = ctx.kv.scales[0][0][ctx.meta.slot_mapping].unsqueeze(-1)
        assert ((k_rows - ctx.kv.rows(0, 0, ctx.meta.slot_mapping)).abs() <= step * 1.001).all()
        assert torch.equal(scales[1], ctx.kv.scales[0][1])  # V quantized bit for bit
    else:
        tol = 1e-6 if kv_dtype is torch.float32 else 1e-3
        torch.testing.assert_close(k_cache, ctx.kv.layers[0][0], rtol=tol, atol=tol)
    assert torch.equal(v_cache, ctx.kv.layers[0][1])  # V is copied (or rounded) bit for bit
    written = set(ctx.meta.slot_mapping.tolist())
    untouched = [s for s in range(k_cache.shape[0]) if s not in written]
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_out_of_range_slot_raises_and_writes_nothing():
    attn, (qn, kn), rope, ctx, qkv = _layer(2, 1, 16, True, False, 0)
    q, k, v = qkv.split((32, 16, 16), dim=-1)
    ctx.meta.slot_mapping[-1] = ctx.kv.layers[0][0].shape[0]  # one past the last slot
    with pytest.raises(RuntimeError, match="out of range"):
        native_qk_rope_cache(attn, q, k, v, ctx)
    assert not ctx.kv.layers[0][0].any() and not ctx.kv.layers[0][1].any()


def test_declines_what_it_does_not_cover(monkeypatch):
    attn, (qn, kn), rope, ctx, qkv = _layer(2, 1, 16, True, False, 0)
    q, k, v = qkv.split((32, 16, 16), dim=-1)
    partial = RotaryEmbedding(8, 64, RopeConfig(theta=10000.0))  # rotary over half the head
    half_rotary = SimpleNamespace(layer_idx=0, q_norm=qn, k_norm=kn, rotary=[partial])
    assert native_qk_rope_cache(half_rotary, q, k, v, ctx) is None
    assert native_qk_rope_cache(attn, q.double(), k, v, ctx) is None
    assert native_qk_rope_cache(attn, q.requires_grad_(), k, v, ctx) is None
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    assert native_qk_rope_cache(attn, q.detach(), k, v, ctx) is None
