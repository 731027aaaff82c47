"""StepExecutor: one scheduled batch -> sampled tokens and logprobs, with fault isolation.

Called by `EngineCore.step` once per step, on the engine's thread. It computes and returns a
`StepResult`; it changes no engine state except the KV cache slots of the scheduled tokens,
the RNG of the rows it samples and a layer slice's hidden states (`Request.prefill_slice`,
which the scheduler drops with a failed request), so the engine commits only what succeeded.

Failure contract: a request whose own work fails (processing its logits, drawing its token, its
logprobs) is reported in `StepResult.failed` and the batch goes on. If the batched part (the
forward pass, the logits) raises, the step is run again one request at a time and only the
requests that fail alone are reported; the others get exactly what the batch would have given
them (the forward is batch-invariant, KV writes of a retried request land in its own slots, and
no row was sampled before the batched part finished).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from hetserve.core.outputs import PositionLogprobs
from hetserve.engine.lora import LoRAManager
from hetserve.engine.output import SeqState
from hetserve.engine.runner import ModelRunner, SeqInput
from hetserve.engine.speculative import draft_rows, verify
from hetserve.layers.sampler import SamplingRow, process_logits, sample, token_logprobs
from hetserve.sched.scheduler import ScheduledRequest
from hetserve.structured import MaskJob, start_masks

log = logging.getLogger(__name__)


def describe(exc: BaseException) -> str:
    """What a client is told about an engine-side failure of its request (one line)."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text[:300]


@dataclass
class StepResult:
    sampled: dict[str, int] = field(default_factory=dict)  # sequence id -> token
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)  # of the sampled token
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)  # by parent
    prompt_tokens: int = 0  # prompt (or recomputed) tokens run through the model
    failed: dict[str, str] = field(default_factory=dict)  # sequence id -> message
    slice_s: float = 0.0  # seconds the step's layer slices took (their layers' forward)
    slice_prompt_tokens: int = 0  # of prompt_tokens, those of slices that completed
    # Sequences whose grammar is complete and drew its end: their output ends here, whatever
    # min_tokens or ignore_eos say (the grammar allows nothing after it).
    ended: set[str] = field(default_factory=set)
    # Speculative decoding, by sequence id: the drafts that held, emitted before its sampled
    # token, their logprobs (where asked), and how many drafts the row checked
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    drafted: dict[str, int] = field(default_factory=dict)

    def merge(self, other: StepResult) -> None:
        self.sampled.update(other.sampled)
        self.logprobs.update(other.logprobs)
        self.accepted.update(other.accepted)
        self.accepted_logprobs.update(other.accepted_logprobs)
        self.drafted.update(other.drafted)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.prompt_tokens += other.prompt_tokens
        self.failed.update(other.failed)
        self.slice_s += other.slice_s
        self.slice_prompt_tokens += other.slice_prompt_tokens
        self.ended |= other.ended


class StepExecutor:
    def __init__(
        self,
        runner: ModelRunner,
        seqs: dict[str, SeqState],
        eos_ids: set[int],
        lora: LoRAManager | None = None,
    ):
        self.runner = runner
        self.seqs = seqs  # the engine's live sequences, by id (read only here)
        self.eos_ids = eos_ids
        self.lora = lora
        self.vocab_size: int = runner.model.config.vocab_size  # the width of a grammar's mask
        self._state_input = None  # (request id, start) -> its state slots, for this step

    def run(self, scheduled: list[ScheduledRequest], block_ids, state_input=None) -> StepResult:
        """`block_ids(request_id)` gives a sequence's KV block table; `state_input(request_id,
        start)` its linear-attention state slot, the checkpoint it resumes from and those it
        takes (models with such layers; `KVCacheManager.state_input`)."""
        self._state_input = state_input
        if self.lora is None:
            return self._run_isolated(scheduled, block_ids)
        # Each forward takes at most max_loras adapters, its rows ordered by adapter.
        result = StepResult()
        for group in self.lora.batches([s.request.lora_id for s in scheduled]):
            result.merge(self._run_isolated([scheduled[i] for i in group], block_ids))
        return result

    def _run_isolated(self, scheduled: list[ScheduledRequest], block_ids) -> StepResult:
        slices = [s for s in scheduled if s.layers is not None]
        if not slices:
            return self._run_batch(scheduled, block_ids)
        batch = [s for s in scheduled if s.layers is None]
        result = self._run_batch(batch, block_ids) if batch else StepResult()
        # After the batch: its decodes are sampled before the slices' layers run.
        for s in slices:
            try:
                result.merge(self._run_slice(s, block_ids))
            except Exception as exc:
                log.exception("a layer slice of request %s failed", s.request.request_id)
                result.failed[s.request.request_id] = describe(exc)
        return result

    def _run_batch(self, scheduled: list[ScheduledRequest], block_ids) -> StepResult:
        try:
            return self._run(scheduled, block_ids)
        except Exception as exc:
            if len(scheduled) == 1 or self.runner.state is not None:
                # A linear-attention state advances in place layer by layer: a batch that
                # failed part way cannot be replayed, so each of its requests fails.
                log.exception("a step of %d request(s) failed", len(scheduled))
                return StepResult(failed={s.request.request_id: describe(exc) for s in scheduled})
            log.exception(
                "a batched step failed; running its %d requests one by one", len(scheduled)
            )
        result = StepResult()
        for s in scheduled:
            try:
                result.merge(self._run([s], block_ids))
            except Exception as exc:
                log.exception("request %s failed in the engine step", s.request.request_id)
                result.failed[s.request.request_id] = describe(exc)
        return result

    def _inputs(self, scheduled: list[ScheduledRequest], block_ids) -> list[SeqInput]:
        inputs = []
        slots = self._lora_slots(scheduled)
        for s in scheduled:
            req = s.request
            start = req.num_computed_tokens
            own = s.num_new_tokens - len(s.drafts)  # a drafted decode: its last token, drafts
            tokens = req.all_token_ids[start : start + own] + s.drafts
            slot = slots.get(req.lora_id) if slots else None
            rid = req.request_id
            st = self._state_input(rid, start) if self._state_input is not None else None
            if st is None:
                inputs.append(SeqInput(tokens, start, block_ids(rid), slot,
                                       as_decodes=bool(s.drafts)))  # fmt: skip
            else:  # (models with state are never drafted)
                inputs.append(SeqInput(tokens, start, block_ids(rid), slot, *st))
        return inputs

    def _run(self, scheduled: list[ScheduledRequest], block_ids) -> StepResult:
        inputs = self._inputs(scheduled, block_ids)
        rows = [i for i, s in enumerate(scheduled) if s.samples]
        states = [self.seqs[scheduled[i].request.request_id] for i in rows]
        masks = self._start_masks(states)  # beside the forward, not after it
        hidden = self.runner.forward(inputs)
        return self._finish(scheduled, inputs, hidden, rows, states, masks)

    def _run_slice(self, s: ScheduledRequest, block_ids) -> StepResult:
        """Decoder layers [a, b) of a chunk; its final hidden states once b is the last."""
        assert s.layers is not None
        sl = s.request.prefill_slice
        assert sl is not None and sl.layer == s.layers[0]
        (inp,) = self._inputs([s], block_ids)
        rows = [0] if s.samples else []
        states = [self.seqs[s.request.request_id]] if rows else []
        masks = self._start_masks(states)
        t0 = time.perf_counter()
        hidden = self.runner.forward_layers(inp, *s.layers, sl.hidden)
        if hidden.is_cuda:  # its layers' time, not their launch's
            torch.cuda.synchronize(hidden.device)
        seconds = time.perf_counter() - t0
        if not s.completes:
            sl.hidden = hidden
            return StepResult(slice_s=seconds)
        sl.hidden = None
        result = self._finish([s], [inp], hidden, rows, states, masks)
        result.slice_s, result.slice_prompt_tokens = seconds, result.prompt_tokens
        return result

    def _finish(
        self,
        scheduled: list[ScheduledRequest],
        inputs: list[SeqInput],
        hidden: torch.Tensor,
        rows: list[int],
        states: list[SeqState],
        masks: tuple[list[int], MaskJob] | None,
    ) -> StepResult:
        """What a forward's final hidden states give: prompt logprobs, the sampled rows."""
        result = StepResult()
        for s in scheduled:
            req, start = s.request, s.request.num_computed_tokens
            result.prompt_tokens += max(0, min(req.num_prompt_tokens - start, s.num_new_tokens))
        ends = torch.tensor([len(i.token_ids) for i in inputs]).cumsum(0) - 1
        self._prompt_logprobs(scheduled, hidden, ends, result)
        if rows:
            drafts = [scheduled[i].drafts for i in rows]
            # a drafted decode's rows: its last token's and each draft's (positions end - k ..)
            end = ends.tolist()  # one conversion, not a tensor item per row (every step)
            at = [p for i, d in zip(rows, drafts, strict=True)
                  for p in range(end[i] - len(d), end[i] + 1)]  # fmt: skip
            logits = self.runner.logits(hidden[torch.tensor(at, device=hidden.device)])
            self._sample(states, logits, result, masks, drafts)
        return result

    def _start_masks(self, states: list[SeqState]) -> tuple[list[int], MaskJob] | None:
        """The grammar masks of the rows that have a grammar, started on the mask worker;
        None (and no cost) when no row has one."""
        rows = [r for r, st in enumerate(states) if st.grammar is not None]
        if not rows:
            return None
        matchers = [states[r].grammar for r in rows]
        return rows, start_masks(matchers, self.vocab_size)  # type: ignore[arg-type]

    def _lora_slots(self, scheduled: list[ScheduledRequest]) -> dict[str | None, int]:
        if self.lora is None:
            return {}
        ids = list(dict.fromkeys(s.request.lora_id for s in scheduled if s.request.lora_id))
        return self.lora.activate(ids) if ids else {}

    def _sample(
        self,
        states: list[SeqState],
        logits: torch.Tensor,
        result: StepResult,
        masks: tuple[list[int], MaskJob] | None,
        drafts: list[list[int]],
    ) -> None:
        """`logits` has a row per position: one per state, or, for a drafted decode, its last
        token's and one per draft (engine/speculative.py)."""
        first = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
        rows: list[SamplingRow] = []
        for st, d in zip(states, drafts, strict=True):
            req = st.request
            row = SamplingRow(req.params, st.generator, req.prompt_token_ids, req.output_token_ids)
            rows += draft_rows(row, d) if d else [row]
        if masks is not None:  # rows with a grammar have no drafts
            grammar_rows, job = masks
            disallowed = job.wait()
            for j, r in enumerate(grammar_rows):
                rows[first[r]].disallowed = disallowed[j, : logits.shape[-1]]
        need_lp = [r for r, st in enumerate(states) if st.logprobs is not None]
        lp_at = [p for r in need_lp for p in range(first[r], first[r + 1])]
        # Logprobs of the raw distribution (vLLM's default), so before any processing.
        raw_lp = logits[lp_at].log_softmax(-1) if need_lp else None
        lp_row = {p: j for j, p in enumerate(lp_at)}
        failed_at = process_logits(logits, rows, self.eos_ids)
        emitted, errors = self._draw(logits, rows, drafts, first, failed_at)
        for r in need_lp:
            if r not in emitted:
                continue
            try:
                k = states[r].request.params.logprobs
                lp = raw_lp[[lp_row[first[r] + j] for j in range(len(emitted[r]))]]
                entries = token_logprobs(lp, torch.tensor(emitted[r]), k)
                rid = states[r].request.request_id
                result.logprobs[rid] = entries[-1]
                if len(entries) > 1:
                    result.accepted_logprobs[rid] = entries[:-1]
            except Exception as exc:  # one request's failure
                errors[r] = exc
        tokens = [emitted[r][-1] if r in emitted else None for r in range(len(states))]
        if masks is not None:
            self._advance_grammars(states, masks[0], tokens, errors, result.ended)
        for r, st in enumerate(states):
            rid = st.request.request_id
            if drafts[r]:
                result.drafted[rid] = len(drafts[r])
            if r in errors:
                log.error("request %s failed while sampling: %s", rid, describe(errors[r]))
                result.failed[rid] = describe(errors[r])
            elif r in emitted:
                result.sampled[rid] = emitted[r][-1]
                if len(emitted[r]) > 1:
                    result.accepted[rid] = emitted[r][:-1]

    @staticmethod
    def _draw(
        logits: torch.Tensor,
        rows: list[SamplingRow],
        drafts: list[list[int]],
        first: list[int],
        failed_at: dict[int, Exception],
    ) -> tuple[dict[int, list[int]], dict[int, Exception]]:
        """The tokens each state emits (by state index) and the states that failed: rows
        without drafts in one batched draw, drafted ones verified position by position."""
        emitted: dict[int, list[int]] = {}
        errors: dict[int, Exception] = {}
        plain = [r for r, d in enumerate(drafts) if not d]
        if plain:
            at = [first[r] for r in plain]
            sub = logits if len(at) == logits.shape[0] else logits[at]
            skip = {j for j, p in enumerate(at) if p in failed_at}
            tokens, failed = sample(sub, [rows[p] for p in at], skip=skip)
            for j, r in enumerate(plain):
                exc = failed_at.get(at[j]) or failed.get(j)
                if exc is not None:
                    errors[r] = exc
                elif tokens[j] is not None:
                    emitted[r] = [tokens[j]]  # type: ignore[list-item]
        for r, d in enumerate(drafts):
            if not d:
                continue
            a, b = first[r], first[r + 1]
            bad = {p - a: exc for p, exc in failed_at.items() if a <= p < b}
            v = verify(logits[a:b], rows[a:b], d, bad)
            if v.error is not None:
                errors[r] = v.error
            else:
                emitted[r] = v.tokens
        return emitted, errors

    def _advance_grammars(
        self,
        states: list[SeqState],
        rows: list[int],
        tokens: list[int | None],
        errors: dict,
        ended: set[str],
    ) -> None:
        # Like a row's RNG, its matcher moves with the token it drew: both belong to this draw.
        for r in rows:
            token, matcher = tokens[r], states[r].grammar
            if token is None or r in errors or matcher is None:
                continue
            if not matcher.accept(token):
                errors[r] = RuntimeError(f"the grammar refused token {token}: {matcher.error}")
            elif matcher.done and token in self.eos_ids:
                ended.add(states[r].request.request_id)

    def _prompt_logprobs(self, scheduled, hidden, ends, result: StepResult) -> None:
        for i, s in enumerate(scheduled):
            st = self.seqs[s.request.request_id]
            parent = st.parent
            if parent.prompt_logprobs is None or st.index != 0:
                continue
            start = s.request.num_computed_tokens
            plen = len(parent.prompt_token_ids)
            # Positions p in this chunk whose next token p+1 is a prompt token not yet scored.
            first = max(start, len(parent.prompt_logprobs) - 1)
            last = min(start + s.num_new_tokens, plen - 1)
            if first >= last:
                continue
            row0 = int(ends[i]) - s.num_new_tokens + 1
            h = hidden[row0 + first - start : row0 + last - start]
            lp = self.runner.logits(h).log_softmax(-1)
            chosen = torch.tensor(parent.prompt_token_ids[first + 1 : last + 1], device=lp.device)
            k = s.request.params.prompt_logprobs
            result.prompt_logprobs[parent.request_id] = token_logprobs(lp, chosen, k)
