"""Logits processing, batched sampling and logprobs.

Logprobs are those of the model's distribution (log-softmax of the raw logits, before any
processing), as vLLM reports them by default; logit_bias, min_tokens, penalties, a grammar's
token mask, temperature, min_p, top-k and top-p only shape the sampling distribution.

Fault isolation: every per-request step (processing a row, drawing a row) runs on its own, and
a row that raises is reported back by its index rather than failing the batch, so the engine can
fail that request alone.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from hetserve.core.outputs import Logprob, PositionLogprobs
from hetserve.core.sampling import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs of one sequence in this step."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # bool [V], True where its grammar forbids the token (structured output); None: no grammar
    disallowed: torch.Tensor | None = None

    def banned(self, eos_ids: Collection[int]) -> list[int]:
        """Token ids that may not end the output yet (min_tokens not reached)."""
        p = self.params
        if len(self.output_token_ids) >= p.min_tokens:
            return []
        stop = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop |= set(eos_ids)
        return sorted(stop)


def process_logits(
    logits: torch.Tensor, rows: list[SamplingRow], eos_ids: Collection[int]
) -> dict[int, Exception]:
    """Apply logit_bias, min_tokens masking, penalties and the grammar's mask in place, row
    by row. Returns the rows that failed (index -> exception); their logits are left as they
    are."""
    errors: dict[int, Exception] = {}
    for r, row in enumerate(rows):
        p = row.params
        banned = row.banned(eos_ids)
        if not (
            p.logit_bias or banned or p.penalized or p.restricted or row.disallowed is not None
        ):
            continue
        try:
            _process_row(logits[r], row, banned)
            if row.disallowed is not None:
                _apply_grammar(logits[r], row.disallowed, bool(banned))
        except Exception as exc:  # one request's failure, reported to the engine
            errors[r] = exc
    return errors


def _apply_grammar(row_logits: torch.Tensor, disallowed: torch.Tensor, banned: bool) -> None:
    # In place on the row (a gathered copy of the grammar rows cost ~1 ms a step at 131k
    # tokens x 8 rows); the mask was built beside the forward.
    row_logits.masked_fill_(disallowed.to(row_logits.device), float("-inf"))
    # min_tokens may have banned the only tokens the grammar allows (its end): the grammar
    # wins, as an output that does not parse helps no one.
    if banned and not torch.isfinite(row_logits).any():
        row_logits.masked_fill_(~disallowed.to(row_logits.device), 0.0)


def _process_row(row_logits: torch.Tensor, row: SamplingRow, banned: list[int]) -> None:
    p = row.params
    dev = row_logits.device
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=dev)
        row_logits.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=dev))
    restricted = p.restricted and _restrict(row_logits, row, banned)
    if banned and not restricted:
        row_logits[torch.tensor(banned, device=dev)] = float("-inf")
    if not p.penalized:
        return
    out = torch.tensor(row.output_token_ids, dtype=torch.long, device=dev)
    if p.repetition_penalty != 1.0:
        seen = torch.cat([torch.tensor(row.prompt_token_ids, device=dev), out]).unique()
        vals = row_logits[seen]
        rp = p.repetition_penalty
        row_logits[seen] = torch.where(vals > 0, vals / rp, vals * rp)
    if (p.presence_penalty or p.frequency_penalty) and out.numel():
        counts = torch.bincount(out, minlength=row_logits.shape[0]).to(row_logits.dtype)
        row_logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _restrict(row_logits: torch.Tensor, row: SamplingRow, banned: list[int]) -> bool:
    """allowed_token_ids, bad words, then min_tokens' ban; where together they leave nothing
    (only a stop token allowed, min_tokens not reached) the allowed tokens win, as an output
    outside them helps no one. A spent thinking budget's forced token overrides them all.
    False where nothing restricts this step (a budget alone, not spent): the caller bans."""
    p, dev = row.params, row_logits.device
    forced = thinking_forced(row) if p.thinking_budget is not None else None
    if forced is not None:  # the thinking budget is spent: its end is all there is
        keep = torch.zeros_like(row_logits, dtype=torch.bool)
        keep[forced] = True
        row_logits.masked_fill_(~keep, float("-inf"))
        return True
    if not (p.allowed_token_ids or p.bad_words_token_ids):
        return False
    keep = torch.zeros_like(row_logits, dtype=torch.bool)
    if p.allowed_token_ids:
        keep[torch.tensor(p.allowed_token_ids, device=dev)] = True
    else:
        keep[:] = True
    out = row.output_token_ids
    for word in p.bad_words_token_ids:
        head = list(word[:-1])
        if not head or (len(out) >= len(head) and out[len(out) - len(head) :] == head):
            keep[word[-1]] = False
    if not keep.any():  # this request alone fails (a bad word's tail closed the last one)
        raise ValueError("allowed_token_ids and bad_words leave no token to sample")
    fallback = keep.clone()
    if banned:
        keep[torch.tensor(banned, device=dev)] = False
    if not keep.any():
        keep = fallback
    row_logits.masked_fill_(~keep, float("-inf"))
    return True


# How far back in the prompt a thinking opened by the template is looked for.
PROMPT_TAIL = 64


def thinking_forced(row: SamplingRow) -> int | None:
    """The token a spent thinking budget forces now, or None (no thinking open, it ended by
    itself, its budget not spent, or the forced end written). Stateless: read from the prompt's
    tail and the output each step."""
    p, out = row.params, row.output_token_ids
    # Only a thinking opened within the last budget + forced tokens can still be forced: look
    # there alone (a long answer after its thinking costs nothing per step).
    reach = p.thinking_budget + len(p.think_forced_ids) + len(p.think_open_ids)
    lo = max(0, len(out) - reach)
    found = _after_last(out[lo:], p.think_open_ids)
    start = None if found is None else lo + found  # output index where the thinking began
    if start is None and lo > 0:
        return None  # any thinking opened before the window is done with
    if start is None:
        tail = row.prompt_token_ids[-PROMPT_TAIL:]
        opened = _after_last(tail, p.think_open_ids)
        if opened is None or (_after_last(tail, p.think_close_ids) or -1) >= opened:
            return None  # never opened, or the prompt closed it (thinking off)
        start = 0
    spent = start + p.thinking_budget  # assert-free: checked at construction
    if _after_last(out[start:spent], p.think_close_ids) is not None:
        return None  # it ended by itself within the budget
    written = len(out) - spent  # forced tokens already out
    if written < 0 or written >= len(p.think_forced_ids):
        return None
    return p.think_forced_ids[written]


def _after_last(seq: list[int], pattern: tuple[int, ...]) -> int | None:
    """The index right after the last occurrence of `pattern` in `seq` (None: nowhere); the
    scan for its last token runs in C (list.index on the reversed list)."""
    n, rev, at = len(pattern), seq[::-1], 0
    while True:
        try:
            j = rev.index(pattern[-1], at)
        except ValueError:
            return None
        end = len(seq) - j
        if end >= n and tuple(seq[end - n : end]) == pattern:
            return end
        at = j + 1


def _filter(logits: torch.Tensor, top_k: int | None, top_p: float, min_p: float) -> torch.Tensor:
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], skip: Collection[int] = ()
) -> tuple[list[int | None], dict[int, Exception]]:
    """logits [N, V] fp32 -> one token id per row (None for rows in `skip` or that failed).
    Greedy rows in one argmax; others row by row so each request's seed alone decides its
    tokens (batch composition never changes them)."""
    out: list[int | None] = logits.argmax(dim=-1).tolist()
    errors: dict[int, Exception] = {}
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy and i not in skip]
    # Per-request generators live on the host, so sampled rows are drawn there.
    host = logits[sampled].float().cpu() if sampled else None
    for j, i in enumerate(sampled):
        p = rows[i].params
        try:
            row = _filter(host[j] / p.temperature, p.top_k, p.top_p, p.min_p)
            probs = row.softmax(-1)
            # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p, one RNG call.
            noise = torch.empty_like(probs).exponential_(generator=rows[i].generator)
            out[i] = int((probs / noise).argmax())
        except Exception as exc:  # one request's failure, reported to the engine
            errors[i] = exc
            out[i] = None
    for i in skip:
        out[i] = None
    return out, errors


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
