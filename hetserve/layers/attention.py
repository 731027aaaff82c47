"""Attention over paged KV: metadata per forward, and the gather-then-SDPA backend.

Tokens of all sequences in a forward are concatenated ([T, ...]); `AttentionMetadata.seqs` says
which rows belong to which sequence and where its whole context lives in the paged cache. The
backend writes the new K/V rows, gathers each sequence's context and runs SDPA per sequence.
A faster backend can replace `PagedAttentionBackend` behind the same two calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetserve.kv.paged import PagedKVCache
from hetserve.kv.state import StateCache
from hetserve.layers.linear_attention import StateBatch
from hetserve.layers.native_decode import native_decode_attention, native_decode_ok
from hetserve.layers.native_prefill import native_prefill_attention, native_prefill_ok
from hetserve.layers.sinks import batched_decode_sinks, sdpa_sinks


@dataclass
class SeqSpan:
    q_start: int
    q_len: int
    kv_len: int  # context length including this forward's tokens
    kv_slots: torch.Tensor  # [kv_len] slot of every context token
    window: int | None = None  # the model's sliding window (a layer may have its own)

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[q_len, kv_len] bool (True = attend); None: plain causal. Built on first use: the
        native prefill kernel needs none (at 8k tokens it would be 64 MiB)."""
        return causal_mask(self.q_len, self.kv_len, self.window, self.kv_slots.device)


@dataclass
class DecodeBatch:
    """All single-token sequences of a forward, attended in one call: the native kernel reads
    `tables`/`lens`; the padded-SDPA path (and MLA) use `slots` and `mask`, built on first use."""

    rows: torch.Tensor  # [B] their rows in the token batch
    tables: torch.Tensor  # [B, W] block tables padded with block 0 (L = W * block_size)
    lens: torch.Tensor  # [B] context lengths including the new token
    block_size: int
    sliding_window: int | None = None

    def _valid(self, window: int | None) -> torch.Tensor:
        """[B, L] True where a real (and in-window) key is."""
        k_pos = torch.arange(self.tables.shape[1] * self.block_size, device=self.lens.device)
        valid = k_pos.unsqueeze(0) < self.lens.unsqueeze(1)
        if window is not None:
            valid &= (self.lens.unsqueeze(1) - 1 - k_pos) < window
        return valid

    @functools.cached_property
    def slots(self) -> torch.Tensor:
        """[B, L] context slots, padding reading slot 0 (the null block's first)."""
        bs = self.block_size
        k_pos = torch.arange(self.tables.shape[1] * bs, device=self.tables.device)
        slots = self.tables[:, k_pos // bs] * bs + k_pos % bs
        return slots.masked_fill(~self._valid(None), 0)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, 1, L] attention mask for SDPA."""
        return self.mask_for(self.sliding_window)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The mask of a layer whose own window differs from the model's (gpt-oss)."""
        cache = self.__dict__.setdefault("_masks", {})
        if window not in cache:
            cache[window] = self._valid(window)[:, None, None, :]
        return cache[window]


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where this forward's K/V rows go
    seqs: list[SeqSpan]  # sequences attended one by one (prefill chunks)
    decode: DecodeBatch | None = None
    sliding_window: int | None = None

    @property
    def decode_only(self) -> bool:
        """Every sequence computes one token: the decode phase of placement rules."""
        return all(s.q_len == 1 for s in self.seqs)

    def seq_masks(self, window: int | None) -> list[torch.Tensor | None]:
        """Each prefill span's mask for a layer with its own window (gpt-oss alternates
        sliding and full layers); built once per forward and window."""
        if window == self.sliding_window:
            return [s.mask for s in self.seqs]
        cache = self.__dict__.setdefault("_window_masks", {})
        if window not in cache:
            device = self.positions.device
            cache[window] = [causal_mask(s.q_len, s.kv_len, window, device) for s in self.seqs]
        return cache[window]


def causal_mask(
    q_len: int, kv_len: int, sliding_window: int | None, device: torch.device | str
) -> torch.Tensor | None:
    """Query i sits at absolute position kv_len - q_len + i and sees keys j <= that position
    (and, with a window W, keys with position - j < W)."""
    if sliding_window is None or kv_len <= sliding_window:
        if q_len == 1 or q_len == kv_len:  # decode, or a whole prefill: SDPA's causal path
            return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    return mask


def build_metadata(
    spans: list[tuple[int, int, list[int]]],
    block_size: int,
    device: torch.device | str,
    sliding_window: int | None = None,
    decode_rows: frozenset[int] = frozenset(),
) -> AttentionMetadata:
    """spans: per sequence (num_computed_before, num_new, block ids covering its context).

    Single-token sequences (decodes) are laid out together with a few tensor ops whatever their
    number; multi-token chunks get their own span (few per step). The spans whose indices are
    in `decode_rows` (a speculative decode's last token and drafts) are decodes too, one row
    per token over the context up to and including itself: each token is computed exactly as
    decoding computes it (every row's K/V is written before any row attends)."""
    num_tokens = sum(new for _, new, _ in spans)
    positions = torch.empty(num_tokens, dtype=torch.long)
    slot_mapping = torch.empty(num_tokens, dtype=torch.long)
    offsets = torch.arange(block_size)
    seqs, decodes = [], []
    q_start = 0
    for i, (computed, new, blocks) in enumerate(spans):
        kv_len = computed + new
        # A lone decoding sequence joins the batch on CPU (the native kernel); on an
        # accelerator its plain causal SDPA (no mask) is the faster path.
        if i in decode_rows:
            decodes += [(q_start + j, computed + j + 1, blocks) for j in range(new)]
        elif new == 1 and (len(spans) > 1 or torch.device(device).type == "cpu"):
            decodes.append((q_start, kv_len, blocks))
        else:
            table = torch.tensor(blocks, dtype=torch.long)
            slots = (table.unsqueeze(1) * block_size + offsets).flatten()[:kv_len]
            positions[q_start : q_start + new] = torch.arange(computed, kv_len)
            slot_mapping[q_start : q_start + new] = slots[computed:]
            seqs.append(SeqSpan(q_start, new, kv_len, slots.to(device), sliding_window))
        q_start += new
    decode = None
    if decodes:
        decode = _decode_batch(decodes, block_size, positions, slot_mapping, sliding_window)
        if torch.device(device).type != "cpu":
            decode = DecodeBatch(
                *(t.to(device) for t in (decode.rows, decode.tables, decode.lens)),
                block_size,
                sliding_window,
            )
    return AttentionMetadata(
        positions.to(device), slot_mapping.to(device), seqs, decode, sliding_window
    )


def _decode_batch(
    decodes,
    block_size: int,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    sliding_window: int | None,
) -> DecodeBatch:
    """Block tables and lengths of all decodes; fills their positions and slot_mapping. Lists
    are flattened before becoming tensors (nested lists convert several times slower)."""
    n = len(decodes)
    width = max(len(blocks) for _, _, blocks in decodes)
    flat: list[int] = []
    row_len: list[int] = []
    for row, kv_len, blocks in decodes:
        flat += blocks
        if len(blocks) < width:
            flat += [0] * (width - len(blocks))
        row_len += (row, kv_len)
    tables = torch.tensor(flat, dtype=torch.long).view(n, width)
    rows, lens = torch.tensor(row_len, dtype=torch.long).view(n, 2).unbind(1)
    last = lens - 1
    positions[rows] = last
    block = tables.gather(1, (last // block_size).unsqueeze(1)).squeeze(1)
    slot_mapping[rows] = block * block_size + last % block_size
    return DecodeBatch(rows, tables, lens, block_size, sliding_window)


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv: PagedKVCache
    # Expert deferral: a MoE layer leaves here the future of its deferred experts' output,
    # which the model adds after the next layer has run.
    deferred: Future | None = None
    # Set while a decode forward is captured as CUDA graphs (engine/decode_graphs.py): routed
    # experts call host_call(fn, like, *inputs) instead of running, which splits the capture
    # there and returns the buffer their result lands in at every replay.
    host_call: Callable[..., torch.Tensor] | None = None
    # Linear-attention layers: the state slots (kv/state.py) and which slot each sequence of
    # this forward uses (layers/linear_attention.py); None for models without such layers.
    state_cache: StateCache | None = None
    states: StateBatch | None = None


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [Tq, H, D], k [L, Hkv, D], v [L, Hkv, Dv] -> [Tq, H, Dv]; GQA by head groups.
    Without a mask, Tq == L means a causal prefill and Tq == 1 a decode step."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None and q.shape[0] > 1,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[0].transpose(0, 1)


def batched_decode_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, D], k [B, L, Hkv, D], v [B, L, Hkv, Dv], mask [B, 1, 1, L] -> [B, H, Dv]."""
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=k.shape[2] != q.shape[1],
    )
    return out.squeeze(2)


def paged_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    ctx: ForwardContext,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Standard (GQA) attention: store this forward's K/V (k, v None: already stored), then
    attend over each context. `window`: this layer's sliding window where it has its own (else
    the model's); `sinks` [H]: gpt-oss's per-head sink logits."""
    if k is not None:
        ctx.kv.write(layer, ctx.meta.slot_mapping, k, v)
    meta, d = ctx.meta, ctx.meta.decode
    window = meta.sliding_window if window is None else window
    native = d is not None and native_decode_ok(q, ctx.kv.layers[layer], sinks)
    entries, scales = ctx.kv.layers[layer], ctx.kv.scales[layer]
    if native and not meta.seqs:  # a pure decode step: every row is a decode, in order
        return native_decode_attention(q, *entries, d, ctx.kv, scale, window, sinks, scales)
    out = q.new_empty(q.shape[0], q.shape[1], entries[1].shape[2])
    if native:
        out[d.rows] = native_decode_attention(
            q[d.rows], *entries, d, ctx.kv, scale, window, sinks, scales
        )
    elif d is not None:
        b, n = d.slots.shape
        k_all, v_all = ctx.kv.gather(layer, d.slots.flatten(), q.dtype)
        args = (q[d.rows], k_all.view(b, n, *k_all.shape[1:]), v_all.view(b, n, *v_all.shape[1:]))
        mask = d.mask_for(window)
        if sinks is None:
            out[d.rows] = batched_decode_sdpa(*args, mask, scale)
        else:
            out[d.rows] = batched_decode_sinks(*args, mask, scale, sinks)
    if meta.seqs and native_prefill_ok(q, entries, sinks):
        for s in meta.seqs:
            rows = out[s.q_start : s.q_start + s.q_len]  # a contiguous view the kernel fills
            qs = q[s.q_start : s.q_start + s.q_len]
            native_prefill_attention(
                qs, *entries, s.kv_slots, scale, window, sinks, scales, rows, ctx.kv.bf16_prefill
            )
        return out
    for s, mask in zip(meta.seqs, meta.seq_masks(window), strict=True):
        k_all, v_all = ctx.kv.gather(layer, s.kv_slots, q.dtype)
        qs = q[s.q_start : s.q_start + s.q_len]
        if sinks is None:
            out[s.q_start : s.q_start + s.q_len] = sdpa(qs, k_all, v_all, mask, scale)
        else:
            out[s.q_start : s.q_start + s.q_len] = sdpa_sinks(qs, k_all, v_all, mask, scale, sinks)
    return out
