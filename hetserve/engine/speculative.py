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

Drafts come from the sequence's own tokens (`ngram`: prompt lookup), or, for a request with a
`prediction` (OpenAI's Predicted Outputs), from that text: each sequence keeps a cursor in it
that moves with every token that matches and finds its place again by n-gram after an edit
(`_Cursor`). A prediction's tokens are also measured when not drafted (whether a draft would
have held), so the adaptive length sees a sequence come back into step with its prediction.

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

import numpy as np
import torch

from hetserve.config import SpeculativeConfig
from hetserve.core.ngram import align, propose
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
    """A step's time checking k drafts over a decode step's, k = 0..k_max (`step_seconds` at
    PROBE_CONTEXT). Non-decreasing, >= 1. A pool too small to probe gives the worst case (each
    draft a whole step)."""
    times = step_seconds(runner, kv, k_max, PROBE_CONTEXT)
    if times is None:
        return [float(k + 1) for k in range(k_max + 1)]
    costs = [1.0]
    for t in times[1:]:
        costs.append(max(costs[-1], t / times[0]))
    return costs


def step_seconds(
    runner: ModelRunner,
    kv: KVCacheManager,
    k_max: int,
    context: int,
    rounds: int = PROBE_ROUNDS,
    budget_s: float = PROBE_SECONDS,
) -> list[float] | None:
    """Seconds of one sequence's forward and logits with k drafts at `context` tokens, k =
    0..k_max: the fastest of `rounds` rounds (fewer, two at least, once `budget_s` has
    passed), in free blocks of the pool (what they compute is thrown away). None where the
    pool has too few free blocks."""
    bs = kv.block_size
    need = -(-(context + k_max + 1) // bs)
    if kv.pool.num_free < need:
        return None
    blocks = kv.pool.allocate(need)
    ids = [b.block_id for b in blocks]
    stats = runner.model.routing_stats
    if stats is not None:  # probe tokens are not routing decisions to count
        runner.model.attach_routing_stats(None)
    seqs = [SeqInput([1 + i for i in range(k + 1)], context, ids, as_decodes=True)
            for k in range(k_max + 1)]  # fmt: skip
    times = [float("inf")] * (k_max + 1)
    try:
        # Round-robin over k (a burst of load on a shared machine hits every length alike),
        # the fastest of each.
        start = time.perf_counter()
        for r in range(rounds + 1):  # the first warms up
            if r > 2 and time.perf_counter() - start > budget_s:
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
    return times


# A prediction's place is found again after an edit by the output's last n tokens, for the
# longest n in this range that occurs in it (longer than the prompt lookup's: a prediction is
# one long text where short n-grams recur, e.g. a file's closing brackets).
ALIGN_MIN, ALIGN_MAX = 3, 12


class _Cursor:
    """Where a sequence's output stands in its request's prediction."""

    def __init__(self, prediction: list[int]) -> None:
        self.reference = np.asarray(prediction, dtype=np.int64)
        self.at: int | None = 0  # the prediction's token expected next; None: not in step
        self.mark = 0  # where it was last in step (a search for its place prefers what follows)
        self.seen = 0  # output tokens accounted for
        self.checked = False  # the engine reported this sequence's last step's drafts

    def advance(self, out: list[int]) -> tuple[int, int]:
        """Take in the output's new tokens; returns (tokens a draft from the cursor would have
        tried, those that would have held): the held ones and the first miss."""
        new = out[self.seen :]
        self.seen = len(out)
        if not new:
            return 0, 0
        held = 0
        if self.at is not None:
            ahead = self.reference[self.at : self.at + len(new)]
            while held < len(ahead) and ahead[held] == new[held]:
                held += 1
            if held == len(new):
                self.at = self.mark = self.at + held
                return held, held
            tried = held + (1 if held < len(ahead) else 0)
        else:
            tried = 0
        self.at = align(self.reference, out[-ALIGN_MAX:], self.mark, ALIGN_MIN, ALIGN_MAX)
        if self.at is not None:
            self.mark = self.at
        return tried, held

    def drafts(self, k: int) -> list[int]:
        if self.at is None:
            return []
        return [int(t) for t in self.reference[self.at : self.at + k]]


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
        self.cursors: dict[str, _Cursor] = {}  # running sequences' places in their prediction

    def observe(self, drafted: dict[str, int], accepted: dict[str, list[int]]) -> None:
        """A step's drafted sequences: how many drafts each checked, which held."""
        for rid, checked in drafted.items():
            record = self.records.get(rid)
            if record is not None:
                record.observe(checked, len(accepted.get(rid, ())))
            cursor = self.cursors.get(rid)
            if cursor is not None:
                cursor.checked = True

    def draft(self, running: list[Request], has_grammar) -> None:
        """Set each running request's drafts for its next step ([] where it gets none).
        `has_grammar(request_id)`: whether that sequence's output follows a grammar."""
        cfg = self.cfg
        live = {req.request_id for req in running}
        self.cursors = {rid: c for rid, c in self.cursors.items() if rid in live}
        if self.costs is not None:
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
            cursor = self._cursor(req)
            tried = held = 0
            if cursor is not None:  # in step with its prediction, or not, whatever the room
                tried, held = cursor.advance(req.output_token_ids)
                if cursor.checked:
                    tried = 0  # the engine's observe counted these drafts
                cursor.checked = False
            if room < 1:
                continue
            if self.costs is not None:  # the length first: no lookup where none is checked
                record = self.records.setdefault(req.request_id, DraftRecord())
                if tried:  # what drafts from the prediction would have done
                    record.observe(tried, held)
                room = record.length(self.costs, room)
                if room == 0:
                    continue
            if cursor is not None:
                req.spec_token_ids = cursor.drafts(room)
            else:
                req.spec_token_ids = propose(
                    _recent(req), room, cfg.prompt_lookup_min, cfg.prompt_lookup_max
                )

    def _cursor(self, req: Request) -> _Cursor | None:
        if req.prediction is None:
            return None
        cursor = self.cursors.get(req.request_id)
        if cursor is None:
            cursor = self.cursors[req.request_id] = _Cursor(req.prediction)
        return cursor


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
