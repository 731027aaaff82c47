"""Speculative decoding: drafts proposed before a step, checked by the step's forward.

Who calls it: `EngineCore.step` asks `Drafter.draft` for the running requests' drafts before
the scheduler runs (`Request.spec_token_ids`; the scheduler gives a decode its drafts where the
step's token budget and the KV pool have room, `ScheduledRequest.drafts`), and the
`StepExecutor` feeds a decode's last token and its drafts through the model as one row and
hands each such row's logits to `verify`.

Exactness: position j of a row holds the distribution of the token after the sequence and
its first j drafts. `verify` draws position 0, 1, ... in turn, exactly as decoding would draw
one token a step (the same logits processing on the same history, the same generator, one draw
per token), and stops after the first token that differs from its draft: every token it returns
is the one decoding would have produced, seeded sampling included. Draws never happen past that
token, so a sequence's generator advances exactly as without drafts. Greedy rows take the argmax
of every position at once.

Not drafted (decoded one token a step): sequences with a grammar (structured output), those
whose request hands its KV off after the prompt, and models with linear-attention state (their
state advances in place and could not be taken back: refused at start). Failure: a position
that fails to process is reported only if verification reaches it (the same request would fail
there without drafts); the caller fails that request alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from hetserve.config import SpeculativeConfig
from hetserve.core.ngram import propose
from hetserve.core.request import HandoffRole, Request
from hetserve.core.spec_policy import DraftRecord
from hetserve.engine.runner import ModelRunner, SeqInput
from hetserve.errors import InvalidInputError
from hetserve.kv.manager import KVCacheManager
from hetserve.layers.sampler import SamplingRow, sample

log = logging.getLogger(__name__)

# The cost of checking drafts, measured at start: one sequence at this context, the fastest of
# PROBE_ROUNDS rounds over every length (fewer once PROBE_SECONDS have passed, two at least).
PROBE_CONTEXT = 64
PROBE_ROUNDS = 8
PROBE_SECONDS = 2.0


def measure_costs(runner: ModelRunner, kv: KVCacheManager, k_max: int) -> list[float]:
    """A step's time checking k drafts over a decode step's, k = 0..k_max: one sequence's
    forward and logits at PROBE_CONTEXT tokens, the fastest of several rounds, in free blocks of the
    pool (before any request; what they compute is thrown away). Non-decreasing, >= 1. A pool
    too small to probe gives the worst case (each draft a whole step)."""
    bs = kv.block_size
    need = -(-(PROBE_CONTEXT + k_max + 1) // bs)
    if kv.pool.num_free < need:
        return [float(k + 1) for k in range(k_max + 1)]
    blocks = kv.pool.allocate(need)
    ids = [b.block_id for b in blocks]
    stats = runner.model.routing_stats
    if stats is not None:  # probe tokens are not routing decisions to count
        runner.model.attach_routing_stats(None)
    seqs = [SeqInput([1 + i for i in range(k + 1)], PROBE_CONTEXT, ids, as_decodes=True)
            for k in range(k_max + 1)]  # fmt: skip
    times = [float("inf")] * (k_max + 1)
    try:
        # Round-robin over k (a burst of load on a shared machine hits every length alike),
        # the fastest of each: PROBE_ROUNDS rounds, fewer where they would take long.
        start = time.perf_counter()
        for r in range(PROBE_ROUNDS + 1):  # the first warms up
            if r > 2 and time.perf_counter() - start > PROBE_SECONDS:
                break
            for k, seq in enumerate(seqs):
                t0 = time.perf_counter()
                runner.logits(runner.forward([seq]))
                if runner.device.type == "cuda":
                    torch.cuda.synchronize(runner.device)
                if r:
                    times[k] = min(times[k], time.perf_counter() - t0)
    finally:
        kv.pool.free(blocks)
        if stats is not None:
            runner.model.attach_routing_stats(stats)
    costs = [1.0]
    for t in times[1:]:
        costs.append(max(costs[-1], t / times[0]))
    return costs


class Drafter:
    """`costs`: a step checking k drafts over a decode step (`measure_costs`); None: every
    sequence checks as many drafts as the proposer finds (the config's `adaptive` off)."""

    def __init__(
        self, cfg: SpeculativeConfig, max_model_len: int, costs: list[float] | None = None
    ) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.costs = costs
        self.records: dict[str, DraftRecord] = {}  # running sequences' drafting so far

    def observe(self, drafted: dict[str, int], accepted: dict[str, list[int]]) -> None:
        """A step's drafted sequences: how many drafts each checked, which held."""
        for rid, checked in drafted.items():
            record = self.records.get(rid)
            if record is not None:
                record.observe(checked, len(accepted.get(rid, ())))

    def draft(self, running: list[Request], has_grammar) -> None:
        """Set each running request's drafts for its next step ([] where it gets none).
        `has_grammar(request_id)`: whether that sequence's output follows a grammar."""
        cfg = self.cfg
        if self.costs is not None:
            live = {req.request_id for req in running}
            self.records = {rid: r for rid, r in self.records.items() if rid in live}
        for req in running:
            req.spec_token_ids = []
            if req.num_tokens - req.num_computed_tokens != 1 or req.prefill_slice is not None:
                continue  # a prompt still to compute
            h = req.kv_handoff
            if (h is not None and h.role is HandoffRole.SEND) or has_grammar(req.request_id):
                continue
            max_tokens = req.params.max_tokens
            assert max_tokens is not None, "the engine resolves max_tokens at admission"
            # every draft accepted and the token after them: within max_tokens and the context
            room = min(
                cfg.num_speculative_tokens,
                max_tokens - len(req.output_token_ids) - 1,
                self.max_model_len - req.num_tokens,
            )
            if room < 1:
                continue
            if self.costs is not None:  # the length first: no lookup where none is checked
                record = self.records.setdefault(req.request_id, DraftRecord())
                room = record.length(self.costs, room)
                if room == 0:
                    continue
            req.spec_token_ids = propose(
                _recent(req), room, cfg.prompt_lookup_min, cfg.prompt_lookup_max
            )


def open_drafter(
    spec: SpeculativeConfig | None, runner: ModelRunner, kv: KVCacheManager, max_model_len: int
) -> Drafter | None:
    """The engine's Drafter (None without --speculative-config), its costs measured now where
    drafting adapts to them. A model with linear-attention state: InvalidInputError."""
    if spec is None:
        return None
    if runner.state is not None:
        raise InvalidInputError(
            "speculative decoding needs a model without linear-attention layers (their state "
            "advances in place and cannot take rejected drafts back); drop "
            "--speculative-config for this model"
        )
    k = spec.num_speculative_tokens
    costs = measure_costs(runner, kv, k) if spec.adaptive else None
    if costs is not None:
        log.info("speculative decoding: a step checking 1..%d drafts costs %s decode steps",
                 k, " / ".join(f"{c:.2f}" for c in costs[1:]))  # fmt: skip
    return Drafter(spec, max_model_len, costs)


# How far back the lookup searches a sequence (its cost grows with the tokens it reads: ~0.6 ms
# at 32k tokens a sequence a step, measured).
LOOKUP_WINDOW = 8192


def _recent(req: Request) -> list[int]:
    """The sequence's last LOOKUP_WINDOW tokens, copying no more than those."""
    out = req.output_token_ids
    if len(out) >= LOOKUP_WINDOW:
        return out[-LOOKUP_WINDOW:]
    return req.prompt_token_ids[-(LOOKUP_WINDOW - len(out)) :] + out


@dataclass
class Verified:
    """What one drafted row gives: the tokens it emits (its accepted drafts, then the token
    drawn after them), or the error of the position where verification stopped."""

    tokens: list[int]
    error: Exception | None = None


def draft_rows(row: SamplingRow, drafts: list[int]) -> list[SamplingRow]:
    """One sampling row per position of a drafted row: position j sees the output followed by
    the first j drafts (penalties, min_tokens and bad words read that history)."""
    out = row.output_token_ids
    return [
        SamplingRow(row.params, row.generator, row.prompt_token_ids, out + drafts[:j])
        for j in range(len(drafts) + 1)
    ]


def verify(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[int],
    errors: dict[int, Exception],
) -> Verified:
    """logits [len(drafts) + 1, V], processed (`process_logits` on `rows`, whose failures are
    `errors` by position): the tokens decoding would have produced from them."""
    if rows[0].params.greedy:
        best = logits.argmax(dim=-1).tolist()
        tokens: list[int] = []
        for j, token in enumerate(best):
            if j in errors:
                return Verified(tokens, errors[j])
            tokens.append(token)
            if j == len(drafts) or token != drafts[j]:
                break
        return Verified(tokens)
    tokens = []
    for j in range(len(drafts) + 1):
        if j in errors:
            return Verified(tokens, errors[j])
        drawn, failed = sample(logits[j : j + 1], [rows[j]])
        if 0 in failed:
            return Verified(tokens, failed[0])
        token = drawn[0]
        assert token is not None
        tokens.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return Verified(tokens)
