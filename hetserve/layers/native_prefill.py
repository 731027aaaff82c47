"""Prefill attention on the native kernel (hetserve/native/prefill_attention.c).

`layers.attention.paged_attention` calls `native_prefill_ok` once per layer and forward, and
`native_prefill_attention` for each prompt chunk when it says yes (MLA's prefill,
model/deepseek.py, the same over the per-head K/V it expands from the latent rows:
`native_dense_attention`); otherwise (not CPU fp32
inference, a cache dtype without a kernel, gradients wanted, native kernels off or unbuilt)
the chunk takes the gather + SDPA path. The kernel reads K/V in place through the chunk's
context slots, so nothing is gathered and no [q_len, kv_len] mask is built. A bad slot is a
RuntimeError (the kernel checks each before reading it).
"""

from __future__ import annotations

import torch

from hetserve import envs
from hetserve.native import optional_kernel

# The kernel of each cache dtype (fp16 widened by F16C; int8 widened with its row scales).
_PREFILL_KERNELS = {
    torch.float32: "hetserve_prefill_attention",
    torch.float16: "hetserve_prefill_attention_f16",
    torch.int8: "hetserve_prefill_attention_i8",
}


def native_prefill_ok(
    q: torch.Tensor, entries: list[torch.Tensor], sinks: torch.Tensor | None = None
) -> bool:
    """Whether `native_prefill_attention` applies to q [T, H, D] over a layer's cache entries
    (K, V) with these sinks."""
    kernel = _PREFILL_KERNELS.get(entries[0].dtype)
    return (
        kernel is not None
        and len(entries) == 2
        and q.is_cpu
        and q.dtype is torch.float32
        and not q.requires_grad
        and all(t.dtype is entries[0].dtype and t.is_cpu for t in entries)
        and (sinks is None or (sinks.is_cpu and sinks.dtype is torch.float32))
        and envs.native_kernels()
        and optional_kernel(kernel) is not None
    )


def native_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None = None,
    scales: list[torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    bf16: bool = False,
) -> torch.Tensor:
    """Causal attention of q [T, H, D], the last T of the kv_len = len(kv_slots) context tokens
    (positions kv_len - T .. kv_len - 1), over k_cache [slots, Hkv, D] / v_cache [slots, Hkv,
    Dv] read at kv_slots [kv_len] (int64, CPU). window: sliding window or None; sinks [H];
    scales (int8 cache): K's and V's [slots, Hkv]. Writes `out` [T, H, Dv] (contiguous) when
    given, else a new tensor; returns it. `bf16`: the products in bf16 (q, K, the softmax
    weights and V rounded to bf16, fp32 sums: `bf16_products_ok`), where this build and the
    head sizes allow it; fp32 otherwise."""
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    t, h, dim = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    if out is None:
        out = torch.empty(t, h, dv, dtype=torch.float32)
    assert out.is_contiguous() and out.shape == (t, h, dv)
    # named, so that no temporary is freed before the kernel reads it
    slots = kv_slots.to(torch.int64).contiguous()
    sink = None if sinks is None else sinks.contiguous()
    extra = []
    if k_cache.dtype is torch.int8:
        if scales is None or len(scales) != 2:
            raise ValueError("an int8 KV cache needs its K and V scales")
        extra = [s.contiguous() for s in scales]
    rc = optional_kernel(_PREFILL_KERNELS[k_cache.dtype])(
        *(torch.get_num_threads(), t, slots.shape[0] - t, h, hkv, dim, dv, window or 0),
        *(k_cache.shape[0], scale),
        None if sink is None else sink.data_ptr(),
        *(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr()),
        out.data_ptr(),
        *(s.data_ptr() for s in extra),
        int(bf16),
    )
    if rc != 0:
        raise RuntimeError(f"native prefill attention failed (code {rc})")
    return out


def bf16_products_ok(d: int, dv: int) -> bool:
    """Whether the prefill kernel multiplies in bf16 when asked, for heads of d / dv dimensions:
    the avx512bf16 build (vdpbf16ps, twice the fp32 FMA rate), d and dv multiples of 16 up to
    512."""
    fn = optional_kernel("hetserve_prefill_bf16_ok")
    return fn is not None and bool(fn(d, dv))


def native_dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    bf16: bool = False,
) -> torch.Tensor | None:
    """Causal attention of q [T, H, D], the last T of L tokens, over their whole context k
    [L, Hkv, D], v [L, Hkv, Dv] held as plain rows (a one-block "cache"); None where the kernel
    does not apply (the caller runs SDPA). `bf16`: as native_prefill_attention's."""
    if not native_prefill_ok(q, [k, v]):
        return None
    slots = torch.arange(k.shape[0])
    return native_prefill_attention(q, k, v, slots, scale, window, bf16=bf16)
