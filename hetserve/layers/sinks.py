"""Attention with sinks (gpt-oss): each head has one learned logit that joins its softmax's
denominator only, so a head can attend to "nothing". SDPA has no such term, so this is the
explicit computation, used for prefill chunks and off-CPU decode of such layers (CPU decode
runs the native kernel, which takes the sinks directly)."""

from __future__ import annotations

import torch


def _attend(s: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """s [.., H, Tq, L] masked logits, v [.., H, L, Dv] -> [.., H, Tq, Dv]."""
    sink = sinks.float().view(-1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.cat((s, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return p @ v


def sdpa_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """As layers.attention.sdpa (q [Tq, H, D], k [L, Hkv, D], v [L, Hkv, Dv]; mask [Tq, L] or
    None: causal when Tq == L, none when Tq == 1) with sinks [H]."""
    tq, h = q.shape[:2]
    g = h // k.shape[1]
    kh = k.float().repeat_interleave(g, dim=1).transpose(0, 1)  # [H, L, D]
    vh = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
    s = (q.float().transpose(0, 1) @ kh.transpose(1, 2)) * scale  # [H, Tq, L]
    if mask is None and tq > 1:
        mask = torch.ones(tq, k.shape[0], dtype=torch.bool, device=q.device).tril(k.shape[0] - tq)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return _attend(s, vh, sinks).transpose(0, 1).to(q.dtype)


def batched_decode_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """As layers.attention.batched_decode_sdpa (q [B, H, D], k [B, L, Hkv, D], mask
    [B, 1, 1, L]) with sinks [H]."""
    g = q.shape[1] // k.shape[2]
    kh = k.float().repeat_interleave(g, dim=2).transpose(1, 2)  # [B, H, L, D]
    vh = v.float().repeat_interleave(g, dim=2).transpose(1, 2)
    s = (q.float().unsqueeze(2) @ kh.transpose(2, 3)) * scale  # [B, H, 1, L]
    s = s.masked_fill(~mask, float("-inf"))
    return _attend(s, vh, sinks).squeeze(2).to(q.dtype)
