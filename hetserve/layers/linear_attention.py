"""The stateful part shared by the linear-attention layers (Gated DeltaNet, Kimi Delta
Attention): a depthwise causal short convolution (+SiLU) over q|k|v, q and k L2-normalised (q
scaled), then the gated delta rule of `layers/delta_rule.py`, each sequence continuing the conv
window and the state kept in its state slot.

Who calls it: the runner builds a `StateBatch` per forward (`build_state_batch`) and puts it on
the `ForwardContext` beside the `StateCache`; a family's module computes its projections, decay
and rate and calls `linear_mix`. Without a state batch (a training forward) every sequence of
`ctx.meta.seqs` starts from zeros and nothing is stored.

Single-token sequences that continue a state (decodes) run batched, in one native call where
the kernels apply (hetserve/native/linear_attn.c: the state is read and rewritten in place);
every other sequence (a prefill chunk, a sequence that starts here) runs on its own in torch. A
span may ask for checkpoints: the conv window and state after its first n tokens copied into
another slot (prefix caching).

Precision: a family's input projections (what feeds q, k, v, the decay, the rate and the output
gate) are declared `precise_projections`: under all-int8 (the CPU default) they keep their int8
rounding error as an int8 residual (layers/int8_linear.py: 16-bit-class weights, 2 bytes a
weight) where every other linear is plain int8. The recurrence is not what amplifies their
rounding (noise of 0.6% on q, k, v or beta moves the delta rule's output by 0.7-1.1x that, on
the decay by 0.15x), but the layer's size in the residual stream: its output is RMS-normalised
per head and gated, so it does not shrink as softmax attention's average of values does, and
the same relative error lands ~3x larger in the residual (a tiny Qwen3-Next against its twin
with full attention in every layer: output / residual 0.59 vs 0.21; int8 input projections in
layers 0-2 move the prompt's logprobs by 0.018 nats mean vs 0.005 for full attention's q/k/v).
Finer int8 scales do not help (groups of 16 or 32 columns: 0.024-0.029 vs 0.015 per output
channel; these weights have no outlier channels); bf16 does (0.004), fp16 or the residual more
(0.0006). Bounds and figures: tests/model/test_hybrid_int8.py.

Failure: a slot out of range raises RuntimeError from the native path, IndexError from torch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetserve import envs
from hetserve.layers.delta_rule import (
    causal_conv,
    chunked_delta_rule,
    conv_step,
    l2_normalize,
    recurrent_step,
)
from hetserve.native import optional_kernel


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


@dataclass(frozen=True)
class LinearHeads:
    """Key heads of k_dim (q and k), value heads of v_dim; each key head serves
    v_heads / k_heads consecutive value heads."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def qkv(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv outputs [T, C] -> q, k [T, Hv, Dk] (normalised, q scaled; key heads repeated
        for their value heads) and v [T, Hv, Dv], fp32."""
        t, hk, dk = y.shape[0], self.k_heads, self.k_dim
        q, k, v = y.split((hk * dk, hk * dk, self.v_heads * self.v_dim), dim=-1)
        q = l2_normalize(q.reshape(t, hk, dk)) * dk**-0.5
        k = l2_normalize(k.reshape(t, hk, dk))
        r = self.v_heads // hk
        if r > 1:
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        return q, k, v.reshape(t, self.v_heads, self.v_dim).float()


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


def linear_mix(
    layer: int,
    mixed: torch.Tensor,
    conv_weight: torch.Tensor,
    heads: LinearHeads,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    ctx,
) -> torch.Tensor:
    """mixed [T, C]: the pre-conv q|k|v of every token; conv_weight [C, K]; log_decay [T, Hv]
    or [T, Hv, Dk] (<= 0); beta [T, Hv]. The conv window is state entry 0 of `layer`, the
    delta-rule state entry 1. Returns o [T, Hv, Dv] (fp32)."""
    batch = getattr(ctx, "states", None)
    cache = getattr(ctx, "state_cache", None)
    out = mixed.new_empty(mixed.shape[0], heads.v_heads, heads.v_dim, dtype=torch.float32)
    if batch is None or cache is None:  # training: every sequence from zeros, nothing kept
        for s in ctx.meta.seqs:
            sl = slice(s.q_start, s.q_start + s.q_len)
            q, k, v = heads.qkv(causal_conv(mixed[sl], None, conv_weight)[0])
            zero = q.new_zeros(heads.v_heads, heads.k_dim, heads.v_dim)
            out[sl] = chunked_delta_rule(q, k, v, log_decay[sl], beta[sl], zero)[0]
        return out
    windows, states = cache.layers[layer]
    if batch.decode_rows is not None:
        r, slots = batch.decode_rows, batch.decode_slots
        args = (mixed[r], conv_weight, heads, log_decay[r], beta[r], windows, states, slots)
        out[r] = _native_decode(*args) if _native_ok(mixed, states) else _torch_decode(*args)
    for s in batch.spans:
        out[s.q_start : s.q_start + s.q_len] = _span(
            s, mixed, conv_weight, heads, log_decay, beta, windows, states
        )
    return out


def _span(s: StateSpan, mixed, conv_weight, heads, log_decay, beta, windows, states):
    """One sequence's tokens in torch, with its checkpoints."""
    sl = slice(s.q_start, s.q_start + s.q_len)
    xs = mixed[sl]
    before = None if s.fresh else windows[s.slot]
    y, after = causal_conv(xs, before, conv_weight)
    kernel = conv_weight.shape[1]
    for n, dst in s.saves:  # the window after n tokens: the K-1 inputs that end there
        start = before if before is not None else xs.new_zeros(xs.shape[1], kernel - 1)
        windows[dst].copy_(torch.cat((start.to(xs.dtype), xs[:n].t()), 1)[:, n:])
    windows[s.slot].copy_(after)
    q, k, v = heads.qkv(y)
    g, b = log_decay[sl], beta[sl]
    state = q.new_zeros(heads.v_heads, heads.k_dim, heads.v_dim) if s.fresh else states[s.slot]
    # Checkpoints split the span: the state at each is what the tokens before it left.
    bounds = [0, *sorted({n for n, _ in s.saves if 0 < n < s.q_len}), s.q_len]
    for n, dst in s.saves:  # a save before the span's first token: the state it starts from
        if n == 0:
            states[dst].copy_(state)
    outs = []
    for a, e in zip(bounds, bounds[1:], strict=False):
        o, state = chunked_delta_rule(q[a:e], k[a:e], v[a:e], g[a:e], b[a:e], state)
        outs.append(o)
        for n, dst in s.saves:
            if n == e:
                states[dst].copy_(state)
    states[s.slot].copy_(state)
    return torch.cat(outs)


def _torch_decode(x, conv_weight, heads, log_decay, beta, windows, states, slots):
    w = windows.index_select(0, slots)
    y = conv_step(x, w, conv_weight)
    windows.index_copy_(0, slots, w)
    q, k, v = heads.qkv(y)
    st = states.index_select(0, slots)
    o = recurrent_step(q, k, v, log_decay.float(), beta.float(), st)
    states.index_copy_(0, slots, st)
    return o


def _native_ok(mixed: torch.Tensor, states: torch.Tensor) -> bool:
    return (
        mixed.is_cpu
        and mixed.dtype is torch.float32
        and states.is_cpu
        and not mixed.requires_grad
        and envs.native_kernels()
        and optional_kernel("hetserve_delta_decode") is not None
    )


def _native_decode(x, conv_weight, heads, log_decay, beta, windows, states, slots):
    x = x.contiguous()
    w = conv_weight.float().contiguous()
    g, b = log_decay.float().contiguous(), beta.float().contiguous()
    slots = slots.contiguous()
    out = torch.empty(x.shape[0], heads.v_heads, heads.v_dim, dtype=torch.float32)
    rc = optional_kernel("hetserve_delta_decode")(
        torch.get_num_threads(), x.shape[0], heads.k_heads, heads.v_heads, heads.k_dim,
        heads.v_dim, w.shape[1], int(g.dim() == 3), states.shape[0],
        slots.data_ptr(), windows.data_ptr(), w.data_ptr(), x.data_ptr(), g.data_ptr(),
        b.data_ptr(), states.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native linear-attention decode failed (code {rc})")
    return out


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, act
) -> torch.Tensor:
    """RMSNorm over the last dimension of x, times `weight`, times act(gate); fp32 math (the
    reference normalises in fp32 before gating)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf * act(gate.float())).to(gate.dtype)
