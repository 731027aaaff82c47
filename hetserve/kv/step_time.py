"""Step time: what one engine step costs, predicted from its shape and fitted from the steps
that ran. Pure: no clock, no I/O; the caller measures and hands the figures in.

Who calls it: the engine, which times a few probe forwards at start-up and every step it runs
and hands them to `observe`; the scheduler's chunk sizing (`sched/step_budget.py`), which asks
how long a step of a given shape would take; later the Conductor and the cluster simulator,
which predict time to first token (`prefill_time`) from a fitted model handed to them as data.
Bad input (no tokens, a non-positive time) is ignored, never raised: a step that ran is never
an error here.

The model has two parts, fitted one after the other so that each is fitted on the steps that
determine it. The decodes: a step of n decodes whose contexts add up to C costs

    decode(n, C) = d0 + d1 * n + d2 * C          (C: the cached K/V rows their kernel reads)

fitted on decode-only steps; d0 is what any step costs. The prompt chunks: k tokens of chunks
whose attention reads `pairs` (query, key) pairs (a chunk of k after c cached tokens reads
k*c + k*(k+1)/2 of them: attention is quadratic, later chunks cost more) and gathers `context`
K/V rows (its c + k) add

    chunks = a * k + b * pairs + g * context + f * m + e * (coverage(n + k) - coverage(n))

fitted on mixed and prefill-only steps, what their decode part does not explain; m is the
number of chunks, f what each costs however few its tokens (rows that leave the decode-only
path: measured serving the demo model, an 8-token chunk beside three decodes took ~3.5 ms more
than the decodes alone, the time of ~50 of its tokens in a long chunk). On a MoE,
coverage(T) = 1 - (1 - top_k/E)^T is the expected share of the E routed experts that T tokens
pick, each read once per step: a few prompt tokens beside a few decodes read many more experts
and cost far more per token than a long chunk's tokens (which read every expert anyway).

A chunk far longer than any the fit has seen is extrapolated (a fit on 64-token prompts beside
decodes predicted an 873-token chunk at 27 ms; it took 74), so `max_chunk` bounds a chunk
beside decodes to `GROWTH` times the longest of the latest ones (at most twice what a step
the fit just saw carried): chunks grow step by step, each step teaching the fit the next size. Every
coefficient is >= 0, fitted on relative error (a 20 ms decode step counts as much as a 5 s
prefill) over the latest steps of each kind (a long run of decodes must not wash out what
prefills taught); one stalled step is clipped. The engine's start-up probe stands in for each
kind until a few real steps of it were seen, and stays in the fit beside them scaled to the
served speed where served steps cannot tell its terms apart (a decode's cost per K/V row; a
chunk's cost per attention pair against per gathered row, which a prompt's chunks of one size
grow together). Both parts model the batch's compute (forward and
sampling), the one thing the probe can time too; what a step spends around it (scheduling,
detokenizing, handing tokens over, the server thread's turn at the interpreter) is a moving
average of its own, `overhead_s`, added to every prediction.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from hetserve.core.least_squares import NormalEquations

# Steps of each kind the fit remembers: enough to average out a noisy machine, few enough to
# follow it when it changes (another job starts) within a second of decoding.
WINDOW = 32
# Real steps of a kind that replace the start-up probe's steps of that kind in the fit.
MIN_STEPS = 4
# An observation further than this factor from the prediction is taken as this factor: one
# step stalled by another process must not move the model by more than a step's worth.
CLIP = 1.5
# Served decode steps whose contexts span less than this factor take the probe's cost per K/V
# row: too narrow a range to tell it from a drift of the machine's speed.
CONTEXT_SPAN = 2.0
# A chunk beside decodes is at most this many times the longest of the latest ones. (1.25
# made a long prompt spend ten steps growing its chunks from the probe's size: 20% of its
# time alone on the demo model; with the probe's chunks after a long context in the fit,
# doubling kept mixed steps within 0.7-1.3x of their prediction serving the small MoE.)
GROWTH = 2.0
# Weight of a new step in the overhead's moving average (and of a slower slice in the
# slices' scale).
EMA = 0.2
# Share of the way a slice faster than predicted moves the slices' scale (`observe_slice`).
SLICE_FOLLOW = 0.5
# Feature scales: keep the normal equations' entries near 1 (pairs reach 1e7).
_TOKEN_SCALE = 1e-3
_PAIR_SCALE = 1e-6


class StepKind(enum.Enum):
    DECODE = "decode"  # every row computes one token
    MIXED = "mixed"  # decodes and prompt chunks together
    PREFILL = "prefill"  # prompt chunks only


def chunk_pairs(new: int, computed: int) -> int:
    """Attention (query, key) pairs of `new` tokens computed after `computed` ones (causal)."""
    return new * computed + new * (new + 1) // 2


@dataclass(frozen=True)
class StepShape:
    """What a step computes, as the model sees it: its decodes (rows of one token) and its
    prompt chunks (rows of several)."""

    decodes: int = 0
    decode_context: int = 0  # the decodes' K/V rows (each one's context and itself)
    chunk_tokens: int = 0
    chunk_pairs: int = 0  # the chunks' attention (query, key) pairs: compute
    chunk_context: int = 0  # the chunks' K/V rows gathered (each one's context and itself)
    chunks: int = 0

    def plus(self, new: int, computed: int) -> StepShape:
        """This shape with one more row: `new` tokens after `computed` ones."""
        # positional construction: the scheduler adds every row of every step (dataclasses'
        # replace cost ~10 us a row, 3% of a small model's offline run)
        if new == 1:
            return StepShape(self.decodes + 1, self.decode_context + computed + 1,
                             self.chunk_tokens, self.chunk_pairs, self.chunk_context,
                             self.chunks)  # fmt: skip
        return StepShape(self.decodes, self.decode_context, self.chunk_tokens + new,
                         self.chunk_pairs + chunk_pairs(new, computed),
                         self.chunk_context + computed + new, self.chunks + 1)  # fmt: skip

    def plus_drafts(self, drafts: int, computed: int) -> StepShape:
        """This shape with a decode's `drafts` checked after its `computed` tokens: they cost
        what chunk tokens cost, but the row stays a decode (no chunk, the step's kind kept)."""
        return StepShape(self.decodes, self.decode_context, self.chunk_tokens + drafts,
                         self.chunk_pairs + chunk_pairs(drafts, computed),
                         self.chunk_context + computed + drafts, self.chunks)  # fmt: skip

    @property
    def tokens(self) -> int:
        return self.decodes + self.chunk_tokens

    @property
    def kind(self) -> StepKind:
        if not self.chunks:
            return StepKind.DECODE
        return StepKind.MIXED if self.decodes else StepKind.PREFILL


_Row = tuple[StepShape, float]


@dataclass
class StepTimeModel:
    """The fitted step time of one engine (see the module docstring). `experts` and `top_k`:
    the routed experts per MoE layer and how many each token picks (None: a dense model)."""

    experts: int | None = None
    top_k: int = 0
    layers: int = 1  # decoder layers (a layer slice's share of a chunk: `layer_time`)
    overhead_s: float = 0.0  # a step's time around its batch's compute (moving average)
    slice_scale: float = 1.0  # measured layer slices against `layer_time` (moving average)
    _recent: dict[StepKind, deque[_Row]] = field(
        default_factory=lambda: {k: deque() for k in StepKind}
    )
    _probes: dict[StepKind, list[_Row]] = field(default_factory=lambda: {k: [] for k in StepKind})
    _decode: tuple[float, ...] | None = None  # (d0, d1, d2)
    _chunk: tuple[float, ...] | None = None  # (a, b, g, f[, e])
    _probe_decode: tuple[float, ...] | None = None  # the decode part the probe alone fits
    _dirty: bool = False

    def decode_features(self, shape: StepShape) -> tuple[float, ...]:
        return (1.0, float(shape.decodes), shape.decode_context * _TOKEN_SCALE)

    def chunk_features(self, shape: StepShape) -> tuple[float, ...]:
        f = (
            shape.chunk_tokens * _TOKEN_SCALE,
            shape.chunk_pairs * _PAIR_SCALE,
            shape.chunk_context * _TOKEN_SCALE,
            float(shape.chunks),
        )
        if self.experts is None:
            return f
        return (*f, self._coverage(shape.tokens) - self._coverage(shape.decodes))

    def _coverage(self, tokens: int) -> float:
        assert self.experts is not None
        return 1.0 - (1.0 - min(1.0, self.top_k / self.experts)) ** tokens

    def predict(self, shape: StepShape) -> float | None:
        """Seconds a step of `shape` is predicted to take, all of it (its batch's compute and
        the overhead around it); None until steps of the kinds it needs were observed."""
        self._refit()
        return self._batch(shape, self._decode, self._chunk)

    def _batch(
        self,
        shape: StepShape,
        dec: tuple[float, ...] | None,
        chunk: tuple[float, ...] | None,
    ) -> float | None:
        if dec is None:
            return None
        t = _dot(dec, self.decode_features(shape)) + self.overhead_s
        if not shape.chunks:
            return t
        return None if chunk is None else t + _dot(chunk, self.chunk_features(shape))

    def prefill_time(self, tokens: int, computed: int = 0) -> float | None:
        """A lone prompt chunk of `tokens` after `computed` cached ones (what TTFT is made of)."""
        return self.predict(StepShape().plus(tokens, computed))

    def layer_time(self, tokens: int, computed: int = 0) -> float | None:
        """Seconds one decoder layer of a lone prompt chunk of `tokens` after `computed`
        takes: the chunk part of its prediction over the layers (a step's fixed costs are
        not the slice's), scaled by what slices measured; None until chunks were observed."""
        self._refit()
        if self._chunk is None or tokens <= 0:
            return None
        chunk = _dot(self._chunk, self.chunk_features(StepShape().plus(tokens, computed)))
        return max(chunk, 0.0) / self.layers * self.slice_scale

    def observe_slice(self, tokens: int, computed: int, layers: int, seconds: float) -> None:
        """`layers` decoder layers of a chunk of `tokens` after `computed` took `seconds`."""
        t = self.layer_time(tokens, computed)
        if t is None or not t > 0 or layers <= 0 or not seconds > 0:
            return
        ratio = seconds / (t * layers)
        if ratio < 1:
            # Faster than predicted: no stall makes a slice faster, so the scale goes halfway
            # there at once (the step budget bounds a prompt's time alone by its slices: the
            # demo model's first slices ran at a third of the fit's layer time, and a scale
            # moved a clipped EMA step a slice still over-predicted them when the prompt ended).
            self.slice_scale *= 1 - SLICE_FOLLOW * (1 - max(ratio, 1 / 4))
            return
        ratio = min(ratio, CLIP)  # one stall moves it a step
        self.slice_scale *= (1 - EMA) + EMA * ratio

    def observe(self, shape: StepShape, seconds: float, probe: bool = False) -> None:
        """A step of `shape` computed its batch in `seconds`. `probe`: a start-up probe (the
        fastest of repeated runs on an idle engine), used for its kind of step only until
        `MIN_STEPS` real ones were seen: serving conditions (other threads, other jobs) can
        make the same step several times slower."""
        if shape.tokens <= 0 or not seconds > 0:
            return
        kind = shape.kind
        if probe:
            self._probes[kind].append((shape, seconds))
            self._dirty = True
            return
        recent = self._recent[kind]
        if len(recent) >= MIN_STEPS:
            # Against the last fit, not a new one: a step's own bookkeeping must stay cheap.
            predicted = self._batch(shape, self._decode, self._chunk)
            if predicted is not None and predicted - self.overhead_s > 0:
                predicted -= self.overhead_s
                seconds = min(max(seconds, predicted / CLIP), predicted * CLIP)
        recent.append((shape, seconds))
        if len(recent) > WINDOW:
            recent.popleft()
        self._dirty = True

    def max_chunk(self) -> int | None:
        """The most prompt tokens a step beside decodes should carry: `GROWTH` times the most
        any of the latest `MIN_STEPS` mixed steps carried (before any, the most any probe or
        prompt-only step did); None: no chunk seen, nothing to bound by. The latest, not the
        longest ever: a window of chunks of one size deep in a prompt leaves the fit unable to
        tell a cost per token from one per chunk (seen: 46-token chunks at 15 ms, then a
        276-token one predicted at 15 ms took 66)."""
        rows: Iterable[_Row] = list(self._recent[StepKind.MIXED])[-MIN_STEPS:]
        if not rows:
            rows = itertools.chain(
                self._probes[StepKind.MIXED],
                self._probes[StepKind.PREFILL],
                self._recent[StepKind.PREFILL],
            )
        longest = max((s.chunk_tokens for s, _ in rows), default=0)
        return math.ceil(GROWTH * longest) if longest else None

    def observe_overhead(self, seconds: float) -> None:
        """A step spent `seconds` beyond its batch's compute."""
        if not seconds >= 0:
            return
        old = self.overhead_s
        # One stall (another thread's turn at the interpreter) moves it by a bounded amount.
        seconds = min(seconds, max(CLIP * old, 1e-3))
        self.overhead_s = (1 - EMA) * old + EMA * seconds

    def _rows(self, kind: StepKind, slowdown: float) -> list[_Row]:
        recent = list(self._recent[kind])
        if len(recent) >= MIN_STEPS:
            return recent
        return recent + [(shape, t * slowdown) for shape, t in self._probes[kind]]

    def _slowdown(self) -> float:
        """How much slower the engine runs its batches now than in the start-up probe: the
        median ratio of the real decode steps to what the probe's decodes alone predict. The
        probe's chunks stand in scaled by it (a first chunk beside decodes must not be sized
        by an idle engine's speed)."""
        probes, recent = self._probes[StepKind.DECODE], self._recent[StepKind.DECODE]
        if not probes or len(recent) < MIN_STEPS:
            return 1.0
        if self._probe_decode is None:
            eq = NormalEquations(3)
            for shape, t in probes:
                eq.add(self.decode_features(shape), t)
            self._probe_decode = eq.solve_nonnegative()
            if self._probe_decode is None:
                return 1.0
        fit = self._probe_decode
        ratios = sorted(t / p for x, t in recent if (p := _dot(fit, self.decode_features(x))) > 0)
        return ratios[len(ratios) // 2] if ratios else 1.0

    def _refit(self) -> None:
        """The decode part on decode-only steps, then the chunks on what the decode part
        leaves of the other steps (relative to their whole time)."""
        if not self._dirty:
            return
        self._dirty = False
        slowdown = self._slowdown()
        self._decode = self._fit_decode(slowdown) or self._decode
        # The probe's chunks stay, scaled to the served speed, as the decode part's do: served
        # chunks of one size deep in a prompt grow their attention pairs and their gathered
        # rows together, and only the probe's chunks after short and long contexts tell
        # those two costs apart (the step budget's efficiency rule weighs them differently).
        rows = [
            *self._recent[StepKind.MIXED],
            *self._recent[StepKind.PREFILL],
            *(
                (shape, t * slowdown)
                for k in (StepKind.MIXED, StepKind.PREFILL)
                for shape, t in self._probes[k]
            ),
        ]
        if self._decode is None or not rows:
            return
        eq = NormalEquations(len(self.chunk_features(rows[0][0])))
        for shape, t in rows:
            rest = t - _dot(self._decode, self.decode_features(shape))
            eq.add(self.chunk_features(shape), rest, weight=1.0 / t)
        self._chunk = eq.solve_nonnegative(self._chunk) or self._chunk

    def _fit_decode(self, slowdown: float) -> tuple[float, ...] | None:
        """(d0, d1, d2) on the decode-only steps. Served ones often have one width over a
        narrow range of contexts: d0, d1 and d2 cannot be told apart on them, and a drift of
        the machine's speed would fit as a cost per K/V row. So the probe's decodes, scaled
        to the served speed, stay in the fit, and over contexts that span less than a factor
        CONTEXT_SPAN the cost per K/V row is the probe's, scaled likewise."""
        recent = self._recent[StepKind.DECODE]
        rows = self._rows(StepKind.DECODE, slowdown)
        if len(recent) >= MIN_STEPS:
            rows += [(shape, t * slowdown) for shape, t in self._probes[StepKind.DECODE]]
        if not rows:
            return None
        spans = [s.decode_context for s, _ in recent]
        probe = self._probe_decode
        if len(recent) < MIN_STEPS or probe is None or max(spans) >= CONTEXT_SPAN * min(spans):
            eq = NormalEquations(3)
            for shape, t in rows:
                eq.add(self.decode_features(shape), t)
            return eq.solve_nonnegative(self._decode)
        per_row = probe[2] * slowdown
        eq = NormalEquations(2)
        for shape, t in rows:
            f = self.decode_features(shape)
            eq.add(f[:2], t - per_row * f[2], weight=1.0 / t)
        fit = eq.solve_nonnegative(None if self._decode is None else self._decode[:2])
        return None if fit is None else (*fit, per_row)

    @property
    def coef(self) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
        """The fitted (d0, d1, d2) and (a, b, g, f[, e]), in seconds per unit (tokens and K/V
        rows in thousands, pairs in millions); None where nothing determined them yet."""
        self._refit()
        return self._decode, self._chunk

    def describe(self) -> str:
        """One line for the start-up log: the fitted terms."""
        dec, chunk = self.coef
        if dec is None:
            return "step time: not measured"
        text = (
            f"step time {dec[0] * 1e3:.2f} ms + {dec[1] * 1e3:.3g} ms/decode + "
            f"{dec[2] * 1e3:.3g} us/decode K/V row"
        )
        if chunk is not None:
            text += (
                f" + {chunk[0] * 1e3:.3g} us/prompt token + {chunk[1] * 1e3:.3g} ns/pair + "
                f"{chunk[2] * 1e3:.3g} us/chunk K/V row + {chunk[3] * 1e3:.3g} ms/chunk"
            )
            if len(chunk) > 4:
                text += f" + {chunk[4] * 1e3:.2f} ms x experts touched"
        return text + f"; {self.overhead_s * 1e3:.2f} ms around each batch"


def _dot(coef: tuple[float, ...], x: tuple[float, ...]) -> float:
    return sum(c * v for c, v in zip(coef, x, strict=True))
