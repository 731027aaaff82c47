"""The sequence plumbing of linear-attention layers: which state slot each sequence of a forward
reads and writes, and the two stateful steps every such layer shares (a causal short
convolution, then the gated delta rule of `layers/delta_rule.py`).

Who calls it: the runner builds a `StateBatch` per forward (`build_state_batch`) and puts it on
the `ForwardContext` with the `StateCache`; the families' linear-attention modules call
`conv_mix` and `delta_mix` with their own projections. Without a state batch (a training
forward) every sequence of `ctx.meta.seqs` starts from zeros and nothing is stored.

Single-token sequences that continue a state (decodes) run batched; every other sequence (a
prefill chunk, a sequence that starts here) runs on its own. A span may ask for checkpoints:
the state after its first n tokens copied into another slot (prefix caching, `kv/manager.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetserve.layers.delta_rule import causal_conv, chunked_delta_rule, conv_step, recurrent_step


@dataclass
class StateSpan:
    q_start: int  # its first row in the token batch
    q_len: int
    slot: int | None  # the state slot it continues and advances; None: no cache (training)
    fresh: bool  # nothing computed before: start from zeros, whatever the slot holds
    saves: tuple[tuple[int, int], ...] = ()  # (tokens into the span, slot to copy the state to)


@dataclass
class StateBatch:
    spans: list[StateSpan]  # sequences run one by one
    decode_rows: torch.Tensor | None  # [B] rows of the continuing single-token sequences
    decode_slots: torch.Tensor | None  # [B] their state slots


def build_state_batch(
    seqs: list[tuple[int, int, int, tuple[tuple[int, int], ...]]], device: torch.device | str
) -> StateBatch:
    """seqs: per sequence of the forward, in token order, (tokens computed before, new tokens,
    state slot, checkpoint saves)."""
    spans, rows, slots = [], [], []
    q_start = 0
    for computed, new, slot, saves in seqs:
        if new == 1 and computed > 0 and not saves:
            rows.append(q_start)
            slots.append(slot)
        else:
            spans.append(StateSpan(q_start, new, slot, computed == 0, saves))
        q_start += new
    if not rows:
        return StateBatch(spans, None, None)
    return StateBatch(
        spans,
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(slots, dtype=torch.long, device=device),
    )


def _spans(ctx) -> list[StateSpan]:
    batch = getattr(ctx, "states", None)
    if batch is not None:
        return batch.spans
    return [StateSpan(s.q_start, s.q_len, None, True) for s in ctx.meta.seqs]


def _entries(ctx, layer: int) -> list[torch.Tensor] | None:
    cache = getattr(ctx, "state_cache", None)
    return None if cache is None or ctx.states is None else cache.layers[layer]


def conv_mix(layer: int, x: torch.Tensor, weight: torch.Tensor, ctx) -> torch.Tensor:
    """SiLU(depthwise causal conv) of x [T, C] (weight [C, K]), each sequence continuing its
    window from state entry 0 of `layer`."""
    entries = _entries(ctx, layer)
    if entries is None:  # training: no window carried in or out
        outs = [causal_conv(x[s.q_start : s.q_start + s.q_len], None, weight)[0]
                for s in _spans(ctx)]  # fmt: skip
        return torch.cat(outs) if outs else x
    windows = entries[0]
    out = torch.empty_like(x)
    batch = ctx.states
    if batch.decode_rows is not None:
        w = windows.index_select(0, batch.decode_slots)
        out[batch.decode_rows] = conv_step(x[batch.decode_rows], w, weight)
        windows.index_copy_(0, batch.decode_slots, w)
    kernel = weight.shape[1]
    for s in batch.spans:
        xs = x[s.q_start : s.q_start + s.q_len]
        before = None if s.fresh else windows[s.slot]
        out[s.q_start : s.q_start + s.q_len], after = causal_conv(xs, before, weight)
        for n, dst in s.saves:  # the window after n tokens: the K-1 inputs ending there
            start = before if before is not None else xs.new_zeros(xs.shape[1], kernel - 1)
            windows[dst].copy_(torch.cat((start.to(xs.dtype), xs[:n].t()), 1)[:, n:])
        windows[s.slot].copy_(after)
    return out


def delta_mix(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    ctx,
) -> torch.Tensor:
    """The gated delta rule over every sequence of the forward: q, k [T, H, Dk] (normalised,
    q scaled); v [T, H, Dv]; log_decay [T, H] or [T, H, Dk]; beta [T, H]; the state in entry
    1 of `layer`. Returns o [T, H, Dv] (fp32)."""
    entries = _entries(ctx, layer)
    h, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    if entries is None:
        outs = []
        for s in _spans(ctx):
            sl = slice(s.q_start, s.q_start + s.q_len)
            zero = q.new_zeros(h, dk, dv)
            outs.append(chunked_delta_rule(q[sl], k[sl], v[sl], log_decay[sl], beta[sl], zero)[0])
        return torch.cat(outs) if outs else q.new_empty(0, h, dv)
    states = entries[1]
    out = q.new_empty(q.shape[0], h, dv)
    batch = ctx.states
    if batch.decode_rows is not None:
        r = batch.decode_rows
        st = states.index_select(0, batch.decode_slots)
        out[r] = recurrent_step(q[r], k[r], v[r], log_decay[r], beta[r], st)
        states.index_copy_(0, batch.decode_slots, st)
    for s in batch.spans:
        state = q.new_zeros(h, dk, dv) if s.fresh else states[s.slot]
        # Checkpoints split the span: the state at each one is what the chunks before it left.
        cuts = [n for n, _ in s.saves if 0 < n < s.q_len]
        bounds = [0, *cuts, s.q_len]
        for a, b in zip(bounds, bounds[1:], strict=False):
            sl = slice(s.q_start + a, s.q_start + b)
            out[sl], state = chunked_delta_rule(q[sl], k[sl], v[sl], log_decay[sl], beta[sl], state)
            for n, dst in s.saves:
                if n == b:
                    states[dst].copy_(state)
        states[s.slot].copy_(state)
    return out


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, act
) -> torch.Tensor:
    """RMSNorm over the last dimension of x, times `weight`, times act(gate); fp32 math (the
    reference normalises in fp32 before gating)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf * act(gate.float())).to(gate.dtype)
