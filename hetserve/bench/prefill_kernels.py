"""`bench prefill`'s kernels table: the prefill kernels alone at the model's shapes (random
weights), each as operations/s and a fraction of the peak of its arithmetic (peaks.py):

- the routed experts of one layer on `cpu-int8` (T tokens routed top-k uniformly at random),
  with int16 activations and with int8 ones (W8A8, `--activation-bits 8`);
- the attention's fused q/k/v projection as an `Int8Linear`, the same two ways;
- causal attention of a T-token prompt (fp32): torch SDPA, and the native prefill kernel over a
  paged cache (its `vs peer`: SDPA's time over its time), at the model's head shape and at
  32 query / 4 KV heads of 128; past 2048 tokens also as the engine runs the prompt by
  default, in 2048-token chunks (the gather path then hands SDPA a mask).

Best of 3 calls after a warm-up call (1 call for attention past 2e11 operations). The issue's
goal for the expert GEMMs (>= 0.5 of the int8 peak) is read off the first row.
"""

from __future__ import annotations

import time


def _best_seconds(fn, calls: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _row(kernel: str, tokens: int, ops: float, seconds: float, peaks, kind: str) -> dict:
    gops = ops / seconds / 1e9
    peak = peaks.gops.get(kind)
    return {"kernel": kernel, "tokens": tokens, "gops": gops, "peak_kind": kind,
            "of_peak": gops / peak if peak else None, "seconds": seconds}  # fmt: skip


def _experts(cfg: dict, tokens: list[int], threads: int, peaks) -> list[dict]:
    import torch

    from hetserve.moe.experts import ExpertWeights, create_backend

    h = cfg["hidden_size"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    e = cfg.get("num_experts") or cfg.get("num_local_experts")
    k = cfg["num_experts_per_tok"]
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(e, 2 * inter, h, generator=g) * h**-0.5
    w2 = torch.randn(e, h, inter, generator=g) * inter**-0.5
    weights = ExpertWeights(w13, w2)
    backends = {bits: create_backend("cpu-int8", weights, num_threads=threads,
                                     activation_bits=bits) for bits in (16, 8)}  # fmt: skip
    del w13, w2, weights
    rows = []
    for t in tokens:
        x = torch.randn(t, h, generator=g)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        tw = torch.rand(t, k, generator=g)
        for bits, backend in backends.items():
            secs = _best_seconds(lambda b=backend, x=x, ids=ids, tw=tw: b.forward(x, tw, ids))
            name = f"experts cpu-int8 {e}x({h}x{inter}) top-{k}" + _W8A8[bits]
            rows.append(_row(name, t, 2 * t * k * 3 * h * inter, secs, peaks, "int8"))
    return rows


_W8A8 = {16: "", 8: " w8a8"}  # the row names' suffix per activation bits


def _linear(cfg: dict, tokens: list[int], peaks) -> list[dict]:
    import torch
    from torch import nn

    from hetserve.layers.int8_linear import Int8Linear

    h = cfg["hidden_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    n = (cfg["num_attention_heads"] + 2 * cfg.get("num_key_value_heads", 1)) * hd
    dense = nn.Linear(h, n, bias=False)
    lins = {bits: Int8Linear(dense, activation_bits=bits) for bits in (16, 8)}
    rows = []
    for t in tokens:
        x = torch.randn(t, h)
        for bits, lin in lins.items():
            secs = _best_seconds(lambda lin=lin, x=x: lin(x))
            name = f"int8 linear qkv {h}->{n}" + _W8A8[bits]
            rows.append(_row(name, t, 2 * t * h * n, secs, peaks, "int8"))
    return rows


def _attention(cfg: dict, tokens: list[int], peaks) -> list[dict]:
    """Causal attention of a T-token prompt at the model's head shape and at REFERENCE_SHAPE:
    torch SDPA on contiguous K/V (what the gather path runs after gathering; its flash kernel,
    no mask) against the native kernel reading a paged fp32 cache in place, with fp32 products
    and, where the build has them, bf16 ones (against the bf16 peak)."""
    nq, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", 1)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nq
    shapes = list(dict.fromkeys([(nq, nkv, hd), REFERENCE_SHAPE]))
    return [row for shape in shapes for t in tokens for row in _attention_pair(shape, t, peaks)]


# A large-model attention shape (32 query heads sharing 4 KV heads of 128), beside the model's.
REFERENCE_SHAPE = (32, 4, 128)


def _attention_pair(shape: tuple[int, int, int], t: int, peaks) -> list[dict]:
    import torch

    from hetserve.kv.paged import PagedKVCache
    from hetserve.layers.attention import sdpa
    from hetserve.layers.native_prefill import (
        bf16_products_ok,
        native_prefill_attention,
        native_prefill_ok,
    )

    nq, nkv, hd = shape
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(t, n, hd, generator=g) for n in (nq, nkv, nkv))
    ops = 2 * nq * 2 * hd * (t * (t + 1) // 2)
    calls = 3 if ops < 2e11 else 1  # an 8k prompt at 32 heads is seconds a call here
    sdpa_s = _best_seconds(lambda: sdpa(q, k, v, None, hd**-0.5), calls)
    name = f"causal attention {nq}/{nkv}x{hd}"
    rows = [_row(f"{name} torch SDPA", t, ops, sdpa_s, peaks, "fp32")]
    bs = 16
    kv = PagedKVCache([[(nkv, hd), (nkv, hd)]], t // bs + 2, bs, torch.float32, "cpu")
    # the prompt's blocks in reverse order, as a long-running cache scatters them
    blocks = torch.arange(t // bs + 1, 0, -1)
    slots = (blocks.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:t]
    kv.write(0, slots, k, v)
    if not native_prefill_ok(q, list(kv.layers[0])):
        return rows
    secs = _best_seconds(
        lambda: native_prefill_attention(q, *kv.layers[0], slots, hd**-0.5, None), calls
    )
    rows.append(_row(f"{name} native paged", t, ops, secs, peaks, "fp32"))
    rows[-1]["vs_peer"] = sdpa_s / secs
    if bf16_products_ok(hd, hd):  # what all-int8 runs by default here (model/build.py)
        bf = _best_seconds(
            lambda: native_prefill_attention(q, *kv.layers[0], slots, hd**-0.5, None, bf16=True),
            calls,
        )
        rows.append(_row(f"{name} native paged, bf16 products", t, ops, bf, peaks, "bf16"))
        rows[-1]["vs_peer"] = sdpa_s / bf
    if t > CHUNK:
        rows += _chunked_pair(name, q, kv, slots, ops, t, calls, peaks)
    return rows


# The engine's default prefill chunk (max_num_batched_tokens): longer prompts arrive in chunks.
CHUNK = 2048


def _chunked_pair(name: str, q, kv, slots, ops: float, t: int, calls: int, peaks) -> list[dict]:
    """The prompt as the engine runs it by default, in CHUNK-token chunks: every chunk after
    the first is a query block beside earlier keys, which the gather path gives SDPA as a
    materialized [chunk, context] mask (torch then takes its unfused path), against the
    native kernel on the same chunks."""
    from hetserve.layers.attention import causal_mask, sdpa
    from hetserve.layers.native_prefill import native_prefill_attention

    scale = q.shape[-1] ** -0.5
    cuts = list(range(0, t, CHUNK)) + [t]

    def gathered() -> None:
        for a, b in zip(cuts, cuts[1:], strict=False):
            k, v = kv.gather(0, slots[:b])
            sdpa(q[a:b], k, v, causal_mask(b - a, b, None, "cpu"), scale)

    def native() -> None:
        for a, b in zip(cuts, cuts[1:], strict=False):
            native_prefill_attention(q[a:b], *kv.layers[0], slots[:b], scale, None)

    base = _best_seconds(gathered, calls)
    secs = _best_seconds(native, calls)
    label = f"{name} in {CHUNK}-token chunks"
    rows = [_row(f"{label}: gather + SDPA", t, ops, base, peaks, "fp32")]
    rows.append(_row(f"{label}: native paged", t, ops, secs, peaks, "fp32"))
    rows[-1]["vs_peer"] = base / secs
    return rows


def kernel_rows(cfg: dict, tokens_arg: str, threads: int, peaks) -> list[dict]:
    tokens = [int(x) for x in tokens_arg.split(",") if x.strip()]
    if not tokens or "kv_lora_rank" in cfg or not cfg.get("num_experts_per_tok"):
        return []
    return (
        _experts(cfg, tokens, threads, peaks)
        + _linear(cfg, tokens, peaks)
        + _attention(cfg, tokens, peaks)
    )
