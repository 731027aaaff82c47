"""The gated delta rule of linear-attention layers (Gated DeltaNet, Kimi Delta Attention).

Per head the layer keeps a state S [Dk, Dv]. Token t decays it (a_t, a scalar per head for
Gated DeltaNet, one factor per key channel for KDA), corrects what S predicts for k_t towards
v_t with rate beta_t, and reads it with q_t:

    S' = diag(a_t) S;   u_t = beta_t (v_t - S'^T k_t);   S_t = S' + k_t u_t^T;   o_t = S_t^T q_t

Two exact forms of the same recurrence:
  * `recurrent_step`: one token per sequence (decode), batched over sequences.
  * `chunked_delta_rule`: a sequence of T tokens in chunks of C (prefill). Within a chunk, with
    G_i the cumulative decay from the chunk start (diagonal per channel), the deltas satisfy a
    lower unit-triangular system  (I + A) U = beta (V - K_G S0),  A_ij = beta_i k_i^T
    diag(G_i / G_j) k_j (j < i), solved with one triangular solve; the outputs and the state at
    the chunk end are matrix products of U. Pairwise decays are taken as exp of log-space
    differences, never as a ratio of two exponentials (which overflows after a few hundred
    strongly decaying tokens).

Everything runs in fp32 (the state accumulates over the whole context). Callers pass q and k
already L2-normalised and q already scaled. Log decays are <= 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK = 64
# Per-channel decay builds [H, C, C, Dk] pairwise factors per chunk: at C = 64 that tensor (64 MiB
# for 32 heads of 128) drives torch's einsum off its fast path. Measured on this 2-core box,
# 512 tokens of 32 heads of 128: chunk 64 3.4 s, 32 5.1 s, 16 0.29 s, 8 0.26 s.
PER_CHANNEL_CHUNK = 16


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension, in fp32 (the reference kernels' form;
    eps inside the root, unlike F.normalize)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of B sequences. q, k [B, H, Dk]; v [B, H, Dv]; log_decay [B, H] or [B, H, Dk];
    beta [B, H]; state [B, H, Dk, Dv], updated in place. Returns o [B, H, Dv]."""
    decay = log_decay.exp()
    decay = decay[..., None, None] if decay.dim() == 2 else decay[..., None]
    state.mul_(decay)
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    delta = (v - predicted) * beta[..., None]
    state.add_(k[..., :, None] * delta[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of one sequence. q, k [T, H, Dk]; v [T, H, Dv]; log_decay [T, H] (one decay per
    head) or [T, H, Dk] (per key channel); beta [T, H]; state [H, Dk, Dv] before the first
    token; `chunk`: tokens per chunk (None: the default for the decay's kind). Returns
    (o [T, H, Dv], the state after token T). Nothing is changed in place, so it also runs
    under autograd (fine-tuning)."""
    t_len = q.shape[0]
    if chunk is None:
        chunk = PER_CHANNEL_CHUNK if log_decay.dim() == 3 else DEFAULT_CHUNK
    # [H, T, ...]: heads lead so every product below is a batched matmul over heads.
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    beta = beta.transpose(0, 1)
    log_decay = log_decay.transpose(0, 1)
    outs = []
    for s in range(0, t_len, chunk):
        e = min(s + chunk, t_len)
        out, state = _chunk(q[:, s:e], k[:, s:e], v[:, s:e], log_decay[:, s:e], beta[:, s:e], state)
        outs.append(out)
    return torch.cat(outs, dim=1).transpose(0, 1), state


def _chunk(q, k, v, log_decay, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk, heads first: q, k [H, C, Dk]; v [H, C, Dv]; log_decay [H, C] or [H, C, Dk];
    beta [H, C]; state [H, Dk, Dv]. Returns (o [H, C, Dv], the state after the chunk)."""
    c = q.shape[1]
    cum = log_decay.cumsum(1)  # log G_i
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    if cum.dim() == 2:  # one decay per head: pairwise factors [H, C, C]
        pair = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        kk = (k @ k.transpose(1, 2)) * pair
        qk = (q @ k.transpose(1, 2)) * pair
        g_now = cum.exp()[..., None]  # G_i, broadcast over Dk
        g_end = (cum[:, -1:] - cum).exp()[..., None]  # G_C / G_j
        g_total = cum[:, -1].exp()[:, None, None]
    else:  # per key channel: pairwise factors [H, C, C, Dk]
        diff = cum[:, :, None, :] - cum[:, None, :, :]
        pair = diff.masked_fill(~causal[None, :, :, None], float("-inf")).exp()
        kk = torch.einsum("hid,hjd,hijd->hij", k, k, pair)
        qk = torch.einsum("hid,hjd,hijd->hij", q, k, pair)
        g_now = cum.exp()
        g_end = (cum[:, -1:, :] - cum).exp()
        g_total = cum[:, -1, :].exp()[..., None]
    strict = kk.tril(-1) * beta[..., None]  # j < i only
    system = strict + torch.eye(c, dtype=q.dtype, device=q.device)
    rhs = beta[..., None] * (v - (k * g_now) @ state)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = (q * g_now) @ state + qk.tril() @ u
    return out, state * g_total + (k * g_end).transpose(1, 2) @ u


def causal_conv(
    x: torch.Tensor, conv_state: torch.Tensor | None, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution + SiLU of one sequence's T new inputs x [T, C], continuing
    from `conv_state` [C, K-1] (the K-1 inputs before them, oldest first; None: zeros).
    weight [C, K]. Returns (out [T, C], the new conv state [C, K-1])."""
    kernel = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[1], kernel - 1)
    full = torch.cat((conv_state.to(x.dtype), x.t()), dim=1)  # [C, K-1+T]
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]
    return F.silu(out).t(), full[:, full.shape[1] - (kernel - 1) :]


def conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token of B sequences: x [B, C]; conv_state [B, C, K-1] (shifted in place);
    weight [C, K]. Returns SiLU(conv) [B, C]."""
    window = torch.cat((conv_state, x.unsqueeze(-1).to(conv_state.dtype)), dim=-1)  # [B, C, K]
    conv_state.copy_(window[..., 1:])
    return F.silu((window * weight).sum(-1)).to(x.dtype)
