"""Batched sampling and logprobs.

Logprobs are those of the model's distribution (log-softmax of the raw logits), as vLLM reports
them by default; temperature/top-k/top-p only shape the sampling distribution.
"""

from __future__ import annotations

import torch

from hetserve.core.outputs import Logprob, PositionLogprobs
from hetserve.core.sampling import SamplingParams


def _filter(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """logits [N, V] fp32 -> token ids [N]. Greedy rows in one argmax; others row by row so
    each request's seed alone decides its tokens (batch composition never changes them)."""
    out = logits.argmax(dim=-1).cpu()
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    # Per-request generators live on the host, so sampled rows are drawn there.
    rows = logits[sampled].float().cpu() if sampled else None
    for j, i in enumerate(sampled):
        p, gen = params[i], generators[i]
        row = _filter(rows[j] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p, one RNG call per row.
        noise = torch.empty_like(probs).exponential_(generator=gen)
        out[i] = (probs / noise).argmax()
    return out


def token_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> list[PositionLogprobs]:
    """logprobs [N, V] (log-softmaxed), chosen [N] -> per row {token: Logprob} with the chosen
    token and the top-k alternatives, ranks 1-based over the whole vocabulary."""
    n = logprobs.shape[0]
    chosen = chosen.to(logprobs.device)
    chosen_lp = logprobs.gather(1, chosen.view(-1, 1)).squeeze(1)
    ranks = (logprobs > chosen_lp.unsqueeze(1)).sum(-1) + 1
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    result: list[PositionLogprobs] = []
    chosen_l, lp_l, rank_l = chosen.tolist(), chosen_lp.tolist(), ranks.tolist()
    top_v = top_vals.tolist() if k > 0 else [[]] * n
    top_i = top_ids.tolist() if k > 0 else [[]] * n
    for r in range(n):
        entry = {chosen_l[r]: Logprob(lp_l[r], rank_l[r])}
        for j, (tid, val) in enumerate(zip(top_i[r], top_v[r], strict=True)):
            entry.setdefault(tid, Logprob(val, j + 1))
        result.append(entry)
    return result
