"""Decode attention and the fused q/k norm + rotary + KV write on the native kernels
(hetserve/native/attention.c, small_ops.c).

`layers.attention.paged_attention` asks `native_decode_ok` once per layer and forward and then
calls `native_decode_attention` for the step's decode rows, read in place from the paged cache
(fp32, fp16 or int8); the GQA layers (model/llama.py, model/fused_decode.py) call
`native_qk_rope_cache` and take their module path where it returns None. Where a kernel does
not apply (not CPU fp32 inference, a cache dtype without a kernel, native kernels off or
unbuilt) the callers take the gather + SDPA path. A block table entry outside the cache or a
slot out of range is a RuntimeError (the kernels check each before reading or writing).
"""

from __future__ import annotations

import torch

from hetserve import envs
from hetserve.kv.paged import PagedKVCache
from hetserve.native import optional_kernel

# The native decode kernel of each cache dtype (fp16 widened in registers by F16C, int8 widened
# with its scales applied to scores and weights; bf16 and fp8 have no kernel yet and take the
# gather + SDPA path).
_DECODE_KERNELS = {
    torch.float32: "hetserve_paged_decode_attention",
    torch.float16: "hetserve_paged_decode_attention_f16",
    torch.int8: "hetserve_paged_decode_attention_i8",
}


def native_decode_ok(
    q: torch.Tensor, entries: list[torch.Tensor], sinks: torch.Tensor | None = None
) -> bool:
    kernel = _DECODE_KERNELS.get(entries[0].dtype)
    return (
        kernel is not None
        and q.is_cpu
        and q.dtype is torch.float32
        and all(t.dtype is entries[0].dtype for t in entries)
        and (sinks is None or (sinks.is_cpu and sinks.dtype is torch.float32))
        and envs.native_kernels()
        and optional_kernel(kernel) is not None
    )


def native_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    d,  # the step's layers.attention.DecodeBatch: its block tables and context lengths
    kv: PagedKVCache,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
    scales: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention read in place from the paged fp32, fp16 or int8 cache
    (hetserve/native/attention.c).
    q [B, H, D]; k_cache [slots, Hkv, D]; v_cache [slots, Hkv, Dv]; sinks [H]; scales (int8):
    K's and V's [slots, Hkv] -> [B, H, Dv]."""
    q = q.contiguous()
    b, h, dim = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    out = torch.empty(b, h, dv, dtype=torch.float32)  # CPU fp32 (checked by the caller)
    tables, lens = d.tables.contiguous(), d.lens.contiguous()
    rc = optional_kernel(_DECODE_KERNELS[k_cache.dtype])(
        *(torch.get_num_threads(), b, h, hkv, dim, dv, kv.block_size, tables.shape[1]),
        *(sliding_window or 0, kv.num_blocks, scale),
        None if sinks is None else sinks.contiguous().data_ptr(),
        *(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()),
        *(tables.data_ptr(), lens.data_ptr(), out.data_ptr()),
        *([] if k_cache.dtype is not torch.int8 else [t.data_ptr() for t in scales or ()]),
    )
    if rc != 0:
        raise RuntimeError(f"native decode attention failed (code {rc})")
    return out


# The fused q/k norm + rotary + cache write of each cache dtype (fp16 rounded as torch rounds).
_QK_ROPE_CACHE_KERNELS = {
    torch.float32: "hetserve_qk_rope_cache",
    torch.float16: "hetserve_qk_rope_cache_f16",
    torch.int8: "hetserve_qk_rope_cache_i8",
}


def qk_rope_cache_fits(q_norm, k_norm, rope, k_cache, v_cache) -> bool:
    """The parts of `native_qk_rope_cache`'s conditions fixed for a layer and its cache."""
    dim = k_cache.shape[-1]
    norms = [n for n in (q_norm, k_norm) if n is not None]
    return (
        optional_kernel("hetserve_qk_rope_cache") is not None
        and rope.dim == dim
        and v_cache.shape[-1] == dim
        and len(norms) != 1
        and all(n.weight.dtype == torch.float32 and n.weight.is_cpu for n in norms)
        and (not norms or q_norm.eps == k_norm.eps)
        and rope.cos.is_cpu
        and k_cache.dtype in _QK_ROPE_CACHE_KERNELS
        and v_cache.dtype is k_cache.dtype
        and k_cache.is_cpu
        and v_cache.is_cpu
        and optional_kernel(_QK_ROPE_CACHE_KERNELS[k_cache.dtype]) is not None
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def native_qk_rope_cache(
    attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx  # a ForwardContext
) -> torch.Tensor | None:
    """The per-head RMSNorm of q and k (`attn.q_norm`/`attn.k_norm`, RMSNorm or None), rotary
    (`attn.rotary[0]`, over the whole head) and the K/V cache write of the GQA layer `attn`
    (layer `attn.layer_idx`) in one C call (hetserve_qk_rope_cache). q, k, v [T, heads * D] may
    be column slices of one fused qkv output. Returns the rotated q [T, H, D] with K/V already
    in the cache, or None where the kernel does not apply (not CPU fp32 inference, partial
    rotary, ...): the caller then takes the module path."""
    q_norm, k_norm, rope = attn.q_norm, attn.k_norm, attn.rotary[0]
    entries = ctx.kv.layers[attn.layer_idx]
    if len(entries) != 2 or q.requires_grad or not envs.native_kernels():
        return None
    k_cache, v_cache = entries
    # What depends only on the layer and its cache is checked once per cache.
    memo = attn.__dict__.get("_qk_rope_cache_fits")
    if memo is None or memo[0] is not k_cache:
        memo = (k_cache, qk_rope_cache_fits(q_norm, k_norm, rope, k_cache, v_cache))
        attn.__dict__["_qk_rope_cache_fits"] = memo
    positions, slots = ctx.meta.positions, ctx.meta.slot_mapping
    if not (
        memo[1]
        and all(t.dtype is torch.float32 and t.is_cpu and t.stride(-1) == 1 for t in (q, k, v))
        and q.dim() == 2
        and positions.dtype is torch.long
        and slots.dtype is torch.long
        and not (q_norm is not None and q_norm.weight.requires_grad)
        and not (k_norm is not None and k_norm.weight.requires_grad)
    ):
        return None
    dim = k_cache.shape[-1]
    t, nq, nkv = q.shape[0], q.shape[1] // dim, k_cache.shape[1]
    q_out = torch.empty(t, nq, dim, dtype=torch.float32)
    has_norm = q_norm is not None
    norm_w = (q_norm.weight.data_ptr(), k_norm.weight.data_ptr()) if has_norm else (None, None)
    rc = optional_kernel(_QK_ROPE_CACHE_KERNELS[k_cache.dtype])(
        *(torch.get_num_threads(), t, nq, nkv, dim // 2, int(rope.interleaved)),
        *(q.stride(0), k.stride(0), v.stride(0), rope.cos.shape[0], k_cache.shape[0]),
        q_norm.eps if has_norm else 0.0,
        *(q.data_ptr(), k.data_ptr(), v.data_ptr(), *norm_w),
        *(rope.cos.data_ptr(), rope.sin.data_ptr(), positions.data_ptr(), slots.data_ptr()),
        *(q_out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()),
        *(t.data_ptr() for t in ctx.kv.scales[attn.layer_idx]),  # int8: K's, V's scales
    )
    if rc != 0:
        raise RuntimeError("position or KV slot out of range in the attention layer")
    return q_out
