"""The engine's own record of its steps: what each computed (its `StepShape`) and how long it
took, handed to the engine's cost model (which refines its fit with it) and kept by kind
(decode-only, mixed, prefill-only) as histograms that `EngineStats` carries to `/metrics` and
the benchmarks, beside what the model had predicted. With HETSERVE_STEP_TRACE set, every step
is also a JSON line in that file (`StepTrace`): where a stream's tail latency comes from.

Who calls it: `EngineCore.step`, on the engine thread, once per step that ran; `stats()`
snapshots it for any thread.
"""

from __future__ import annotations

import bisect
import gc
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from hetserve.core.stats import Histogram, StepKindStats
from hetserve.engine.execute import StepResult
from hetserve.kv.step_time import StepKind, StepShape, chunk_pairs
from hetserve.kv.tier_policy import CostModel
from hetserve.sched.scheduler import ScheduledRequest

STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
CHUNK_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def shape_of(scheduled: Sequence[ScheduledRequest]) -> StepShape:
    """The shape of a scheduled step (before `Scheduler.update` advances the requests)."""
    decodes = decode_context = tokens = pairs = context = chunks = 0
    for s in scheduled:
        new, done = s.num_new_tokens, s.request.num_computed_tokens
        if s.drafts:  # a decode, its drafts costed as chunk tokens (StepShape.plus_drafts)
            k = len(s.drafts)
            decodes += 1
            decode_context += done + 1
            tokens += k
            pairs += chunk_pairs(k, done + 1)
            context += done + 1 + k
        elif new == 1:
            decodes += 1
            decode_context += done + 1
        else:
            tokens += new
            pairs += chunk_pairs(new, done)
            context += done + new
            chunks += 1
    return StepShape(decodes, decode_context, tokens, pairs, context, chunks)


class _Counts:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> Histogram:
        return Histogram(self.bounds, tuple(self.counts), self.total)


class StepTrace:
    """One JSON line per step: its shape, the model's prediction before the step refined it,
    the measured time and its batch's part, the gap since the previous step ended (the engine
    thread waiting or yielding the interpreter) and the garbage collections that ran in it."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = path.open("a", buffering=1)
        self._last_end: float | None = None
        self._gc_s = 0.0
        self._gc_n = 0
        self._gc_t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_t0
            self._gc_n += 1

    def write(
        self,
        shape: StepShape,
        predicted: float | None,
        seconds: float,
        batch_s: float,
        slice_s: float = 0.0,
        piece: tuple[int, tuple[int, int]] | None = None,
        ledger: tuple[float, float] | None = None,
    ) -> None:
        """`piece`: the step's layer slice, (its chunk's tokens, its layers [a, b)); `ledger`:
        its prompt's (allowance, debt after the step), seconds, where the step budget's ledger
        judged a prompt chunk in it by efficiency (no step limit)."""
        end = time.perf_counter()
        start = end - seconds
        gap = None if self._last_end is None else start - self._last_end
        self._last_end = end
        row = {
            "t": round(end, 6),
            "kind": shape.kind.value,
            "decodes": shape.decodes,
            "decode_context": shape.decode_context,
            "chunk_tokens": shape.chunk_tokens,
            "chunk_context": shape.chunk_context,
            "predicted_ms": None if predicted is None else round(predicted * 1e3, 3),
            "ms": round(seconds * 1e3, 3),
            "batch_ms": round(batch_s * 1e3, 3),
            "slice_ms": round(slice_s * 1e3, 3),
            "slice_tokens": None if piece is None else piece[0],
            "slice_layers": None if piece is None else list(piece[1]),
            "gap_ms": None if gap is None else round(gap * 1e3, 3),
            "gc": self._gc_n,
            "gc_ms": round(self._gc_s * 1e3, 3),
            "allowance_ms": None if ledger is None else round(ledger[0] * 1e3, 3),
            "debt_ms": None if ledger is None else round(ledger[1] * 1e3, 3),
        }
        self._gc_n, self._gc_s = 0, 0.0
        self._file.write(json.dumps(row) + "\n")


class StepLog:
    def __init__(self, cost: CostModel, trace: Path | None = None) -> None:
        self.cost = cost
        self.trace = None if trace is None else StepTrace(trace)
        self._seconds = {k: _Counts(STEP_SECONDS) for k in StepKind}
        self._chunks = {k: _Counts(CHUNK_TOKENS) for k in StepKind}
        self._predicted = dict.fromkeys(StepKind, 0.0)
        self._measured = dict.fromkeys(StepKind, 0.0)

    def observe(
        self,
        scheduled: Sequence[ScheduledRequest],
        shape: StepShape,
        seconds: float,
        batch_s: float,
        result: StepResult,
    ) -> None:
        """A step of `shape` took `seconds`, `batch_s` of them computing its batch. A layer
        slice (at most one a step) is not in `shape`: its time (`result.slice_s`, within
        `batch_s`) is left out of the fit, which `observe_slice` is told apart."""
        # Decode-only steps are not predicted: nothing was sized by them, and a prediction
        # would refit the model every step of a long decode.
        kind = shape.kind
        traced = self.trace is not None
        predicted = None
        if kind is not StepKind.DECODE or traced:
            predicted = self.cost.steps.predict(shape)
        if self.trace is not None:
            piece = next(((s.num_new_tokens, s.layers) for s in scheduled if s.layers), None)
            ledger = next(
                ((s.allowance_s, s.request.prefill_debt_s) for s in scheduled
                 if s.allowance_s is not None),
                None,
            )  # fmt: skip
            self.trace.write(shape, predicted, seconds, batch_s, result.slice_s, piece, ledger)
        if kind is StepKind.DECODE:
            predicted = None
        sliced = [s for s in scheduled if s.layers is not None]
        if shape.tokens:
            own_s = batch_s - result.slice_s
            own_tokens = result.prompt_tokens - result.slice_prompt_tokens
            self.cost.observe_step(own_s, own_tokens, shape, seconds - batch_s)
        seen = kind  # the histograms: what the streams waited, a slice's step has a chunk
        if sliced:
            seen = StepKind.MIXED if shape.decodes else StepKind.PREFILL
        self._seconds[seen].add(seconds)
        if shape.chunks or sliced:
            for s in scheduled:  # a slice's chunk once, at its first layer
                chunk = s.num_new_tokens > 1 and not s.drafts  # a drafted decode is none
                if chunk and (s.layers is None or s.layers[0] == 0):
                    self._chunks[seen].add(s.num_new_tokens)
        if predicted is not None:  # the batch's prediction against the batch's part
            self._predicted[kind] += predicted
            self._measured[kind] += seconds - result.slice_s

    def observe_slices(self, scheduled: Sequence[ScheduledRequest], result: StepResult) -> None:
        """The step's layer slice (at most one) refines the cost of a layer of a chunk; called
        before `Scheduler.update` advances the requests."""
        for s in scheduled:
            if s.layers is not None and s.request.request_id not in result.failed:
                a, b = s.layers
                done = s.request.num_computed_tokens
                self.cost.steps.observe_slice(s.num_new_tokens, done, b - a, result.slice_s)

    def stats(self) -> dict[str, StepKindStats]:
        return {
            k.value: StepKindStats(
                self._seconds[k].snapshot(),
                self._chunks[k].snapshot(),
                self._predicted[k],
                self._measured[k],
            )
            for k in StepKind
        }
