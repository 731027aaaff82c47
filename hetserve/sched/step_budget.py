"""Step budget: how many tokens each request gets in one step, the prompt chunks sized by time.

Who calls it: the scheduler, through one `StepBudget` per step (`grant` then `take` for each
request it schedules, decodes first). Pure policy: no clock, no I/O. Time comes from a
`StepTime` (the engine's fitted model, `kv/step_time.py`; a fake in tests); without one,
or while it cannot predict yet, chunks are sized by tokens alone, as they were before.

Why by time: one CPU prefills a 2,048-token chunk in seconds and a GPU in tens of
milliseconds, and every decode in that step waits for it; a token count cannot bound that on
both (Sarathi-Serve sizes the chunk to the latency budget; we size it in seconds). The rule:

- A step without decodes takes whole chunks: `min(tokens needed, token budget left)`.
- A step with decodes may last `limit_s`: `--max-step-ms`, or 0.8 x `--slo-tbt-ms` (the rest
  is left for the model's error and the stream's delivery); prompt chunks get what the decodes
  leave of it. Floor: they get at least `FLOOR_SHARE` of the step's time however many
  decodes run (a crowd of streams never starves a long prompt).
- Without either flag the step is as short as it can be while the prompt keeps `EFFICIENCY`
  of its speed alone: its chunk is the smallest whose step (decodes included) takes at most
  1 / EFFICIENCY of what its tokens cost in the prompt's run alone (`_alone`: their share of
  the fixed costs of the whole chunk that would hold them, and their own attention pairs,
  never above their cost as layer slices where slices were measured: the fit's error on long
  chunks is the rule's). Those shares add up to the prompt's time alone, so its time to
  first token grows by at most 1 / EFFICIENCY - 1 = 18% for the streams it runs beside, on
  any machine: a chunk's fixed costs (the decodes, the experts a few tokens read, its gather
  of the context) decide how large it must be. Each step is judged with what the prompt's
  earlier steps overspent (`debt_s`, the scheduler's ledger from measured step times): steps
  the fit under-predicted, and the first small chunks while `max_chunk` still bounds them,
  are made up by larger chunks later (a prompt in debt is not held to `max_chunk`; a decode
  step's worth at most a step), so the rule holds for the prompt's whole run and not only
  step by step. EFFICIENCY keeps a margin below the goal's 0.8 for what the rule does not
  see: the step in flight when the prompt arrives, its last chunk (what is left), the fit's
  error on the prompt's cost alone.
- Beside decodes, a step's chunks carry at most the model's `max_chunk()` tokens: a chunk
  longer than those it has seen is extrapolated (the engine's model: twice the longest of the
  latest mixed steps), so chunks grow step by step as the fit learns each size.
- The step's first chunk gets at least `MIN_CHUNK` tokens: a model that over-predicts small
  chunks never stops a prefill, and the mixed steps it then sees correct it (a prompt fed one
  token a step runs decode-shaped steps, which teach the chunk part nothing: seen serving, a
  3,000-token prompt beside three streams got 684 tokens in 1.8 s). Few, because on a CPU
  each token of a small chunk reads experts of its own: serving the 1.7 B MoE with the limit
  at twice its 18 ms decode step, a chunk of 8 beside three decodes took 44-50 ms, one of 3
  took 34 ms;
  `--max-num-batched-tokens` stays the upper bound on every step's tokens.
- Layer slices (`slice`, beside decodes): a chunk may instead run a few decoder layers a
  step, its hidden states kept between steps (`PrefillSlice`), its tokens computed once the
  last layer ran. On a CPU MoE a chunk's cost is mostly the experts its tokens read, about the
  same for 5 tokens as for 100, so within twice a decode step a chunk through every layer
  carries a handful of tokens where one layer of a chunk carries tens (serving the 1.7 B MoE
  beside three decodes: 4-5 prompt tokens through every layer in a 33 ms step, one layer of
  40-90 in 11-12 ms of a 31 ms one). A layer's cost is `layer_time` (the step-time model's
  chunk part over the layers, scaled by what slices measured). Under a limit the slice is the
  longest chunk one layer of which fits what the decodes leave, as many layers a step as fit,
  at least one, taken where it advances the prompt further than the chunk `grant` would give
  (tokens x layers run against tokens x all layers). Without one it is the shortest step that
  keeps the prompt's efficiency (k = 1, 2, 4, ... layers of the shortest chunk whose share of
  the prompt's time alone is EFFICIENCY of the step), taken where that step is shorter than
  the chunk `grant` would give; a debt is made up a decode step's worth at most a step (all
  at once, serving the 1.7 B MoE, made one layer of a 1,110-token chunk: 220 ms steps). One
  slice a step and no other chunk beside it; without decodes a slice runs all its remaining
  layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from hetserve.kv.step_time import StepShape, chunk_pairs

# Without a step limit, a prompt beside decodes keeps this share of its speed alone (issue 43:
# its time to first token at most 1.25x; 0.8 per step came to 1.4-1.8x serving the demo).
EFFICIENCY = 0.85
# With --slo-tbt-ms the step limit is this share of it: the remainder covers the model's
# error and what happens around a step (detokenizing, sending the token).
SLO_SHARE = 0.8
# With a step limit, prompt chunks get at least this share of a mixed step's time.
FLOOR_SHARE = 0.25
# The first prompt chunk of a step gets at least this many tokens, whatever is predicted.
MIN_CHUNK = 3


class StepTime(Protocol):
    def predict(self, shape: StepShape) -> float | None:
        """Seconds a step of `shape` takes; None while unknown."""
        ...

    def layer_time(self, tokens: int, computed: int) -> float | None:
        """Seconds one decoder layer of a lone prompt chunk of `tokens` after `computed`
        takes (a layer slice's cost); None while unknown."""
        ...

    def max_chunk(self) -> int | None:
        """The most prompt tokens a step beside decodes may carry for its prediction to be
        trusted (longer ones are beyond what the model has seen); None: no bound."""
        ...


def step_limit_s(max_step_ms: float | None, slo_tbt_ms: float | None) -> float | None:
    """The configured limit of a step with decodes (None: the default, by efficiency)."""
    if max_step_ms is not None:
        return max_step_ms / 1e3
    if slo_tbt_ms is not None:
        return SLO_SHARE * slo_tbt_ms / 1e3
    return None


class StepBudget:
    def __init__(
        self,
        model: StepTime | None,
        limit_s: float | None,
        tokens: int,
        layers: int | None = None,
    ) -> None:
        self.model = model
        self.limit_s = limit_s  # None: by the prompt's efficiency
        self.tokens = tokens  # the step's token budget left
        self.whole = tokens  # a prompt's chunk when it runs alone
        self.shape = StepShape()  # what is scheduled so far
        self.until_s: float | None = None  # the step's time limit, fixed at its first chunk
        self.layers = layers  # decoder layers a chunk may be sliced into (None: no slices)
        self.sliced = False  # a layer slice is in this step: no other prompt chunk joins it
        # The model is fixed for the step: its answers for a chunk are asked again and again by
        # the searches (each number of layers, each chunk a grant tries), kept here.
        self._layers_memo: dict[tuple[int, int], float] = {}
        self._alone_memo: dict[tuple[int, int, int], float | None] = {}

    def grant(self, needed: int, computed: int, debt_s: float = 0.0) -> int:
        """Tokens the next request gets: `needed` still to compute after `computed`. 0: none
        fit this step. Call `take` with what is really scheduled. `debt_s`: what its prompt's
        earlier steps took beyond 1 / EFFICIENCY of their tokens' cost alone (without a step
        limit, this step's chunk must make it up)."""
        cap = min(needed, self.tokens)
        if self.sliced:
            # the slice has the step's time for prompts, sized beside the decodes scheduled
            # before it (all of them: decodes run first); only admissions come after it, and a
            # one-token prompt admitted then would take time the slice was given (it waits)
            return 0
        if cap == 0 or self.model is None:
            return cap
        if self.until_s is None:
            if cap == 1 or not self.shape.decodes:
                return cap  # a decode before any chunk; or no decodes: whole chunks
            # The limit by efficiency compares with the whole cap (the prompt's speed alone),
            # never the bounded one: a small bound would make small chunks look efficient and
            # ratchet them down to the floor (seen serving).
            until = self._until(cap, computed, computed + needed, debt_s)
            if until is None:
                return self._bounded(cap)
            self.until_s = until
            # A prompt behind its share (no step limit) is not held to the sizes seen: its
            # chunk makes up the debt, and its measured step corrects the fit.
            behind = self.limit_s is None and debt_s > 0
            bounded = cap if behind else self._bounded(cap)
            return max(self._fit(bounded, computed), min(cap, MIN_CHUNK))
        # After the first chunk everything must fit, a one-token prompt too (it is a prefill).
        return self._fit(self._bounded(cap), computed)

    def _bounded(self, cap: int) -> int:
        """`cap` within what the model has seen beside decodes (`max_chunk`)."""
        assert self.model is not None
        bound = self.model.max_chunk()
        if cap == 1 or bound is None or self.until_s == float("inf"):
            return cap  # no time limit (--max-step-ms inf): chunks by tokens alone
        floor = 0 if self.shape.chunks else MIN_CHUNK  # the first chunk's floor holds
        return min(cap, max(bound - self.shape.chunk_tokens, floor))

    def take(self, n: int, computed: int) -> None:
        """`n` tokens after `computed` were scheduled."""
        self.shape = self.shape.plus(n, computed)
        self.tokens -= n

    def drafts_fit(self, computed: int, drafts: int) -> int:
        """How many `drafts` of a scheduled decode (after `computed` tokens) the step's
        configured time limit leaves room for beside what is scheduled: all of them where no
        limit is set (the default limit sizes prompt chunks; a draft length is chosen by its
        own cost, engine/speculative.py) or nothing is predicted yet."""
        if self.model is None or self.limit_s is None or self.limit_s == float("inf"):
            return drafts
        while drafts > 0:
            predicted = self.model.predict(self.shape.plus_drafts(drafts, computed + 1))
            if predicted is None or predicted <= self.limit_s:
                break
            drafts -= 1
        return drafts

    def take_drafts(self, computed: int, drafts: int) -> None:
        """A scheduled decode after `computed` tokens checks `drafts` drafts too."""
        self.shape = self.shape.plus_drafts(drafts, computed + 1)
        self.tokens -= drafts

    # ---- layer slices -----------------------------------------------------------------------
    def slice(self, needed: int, computed: int, debt_s: float = 0.0) -> tuple[int, int] | None:
        """A new layer slice for a prompt with `needed` tokens to compute after `computed`
        (`debt_s` behind its share, without a step limit): (its chunk's tokens, the layers it
        runs in this step); None where a chunk through every layer (`grant`) does as well.
        Call `take_slice` if scheduled."""
        if self.sliced or self.shape.chunks or needed < 2:
            return None  # one slice a step, never beside an ordinary chunk
        decodes = self._decodes()
        if decodes is None:
            return None
        assert self.model is not None and self.layers is not None
        cap = min(needed, self.tokens)
        total = computed + needed

        def whole() -> int:
            """What a chunk through every layer beside the same decodes would get (`grant`,
            the step's limit not fixed by it here); asked only once a slice is possible."""
            until = self.until_s
            n = self.grant(needed, computed, debt_s)
            self.until_s = until
            return n

        if self.limit_s is not None:
            slack = self._limit(decodes) - decodes
            # The longest chunk one layer of which fits what the decodes leave (a layer's
            # time grows with the chunk: a binary search), as many layers as fit.
            n = self._search(cap, lambda c: self._layer(c, computed) <= slack, longest=True)
            one = self._layer(n, computed)
            if n < 2 or not one > 0:
                return None  # (a layer predicted free: no slice is needed)
            layers = min(self.layers, int(slack // one))
            # It must advance the prompt further: tokens times the share of the layers.
            if layers >= self.layers or n * layers <= whole() * self.layers:
                return None
            return n, layers
        # Without a limit: the shortest step that keeps the prompt's efficiency and makes up
        # part of its debt (at most a decode step's worth a step: all of it at once made one
        # layer of a 1,110-token chunk beside three decodes, 220 ms steps, serving the 1.7 B
        # MoE): for k = 1, 2, 4, ... layers the shortest chunk whose share of the prompt's
        # time alone is EFFICIENCY of the step (a prompt's last tokens may need several).
        debt_s = min(debt_s, decodes)
        best: tuple[float, int, int] | None = None
        k = 1
        while k < self.layers:

            def efficient(c: int, k: int = k) -> bool:
                return self._efficient(c, computed, total, k, decodes, debt_s)

            n = self._search(cap, efficient)
            if n >= 2 and efficient(n):
                step = decodes + k * self._layer(n, computed)
                if best is None or step < best[0]:
                    best = (step, n, k)
            k *= 2
        if best is None:
            return None
        chunk = whole()
        chunk_step = self.model.predict(self.shape.plus(chunk, computed)) if chunk else None
        if chunk_step is not None and best[0] >= chunk_step:
            return None
        return best[1], best[2]

    def slice_layers(
        self, tokens: int, computed: int, done: int, total: int, debt_s: float = 0.0
    ) -> int:
        """Layers a slice of `tokens` after `computed` (of a prompt of `total`), `done` layers
        through, runs in this step: under a limit as many as fit what the decodes leave,
        without one the fewest that keep the prompt's efficiency and make up part of its debt
        (as `slice`), where none does those whose time is EFFICIENCY of the step; at least one
        (it holds its blocks and must progress); without decodes or a prediction, all that
        are left."""
        assert self.layers is not None
        left = self.layers - done
        decodes = self._decodes()
        if decodes is None or not self._layer(tokens, computed) > 0:
            return left
        if self.limit_s is not None:
            slack = self._limit(decodes) - decodes
            return max(1, min(left, int(slack // self._layer(tokens, computed))))
        debt_s = min(debt_s, decodes)
        for k in range(1, left):
            if self._efficient(tokens, computed, total, k, decodes, debt_s):
                return k
        # None keeps it (its layers dearer than their share alone by more than the margin):
        # those that give it EFFICIENCY of the step, not all that are left at once (a 2 s step)
        share = EFFICIENCY / (1 - EFFICIENCY) * (decodes + debt_s)
        return max(1, min(left, math.ceil(share / self._layer(tokens, computed))))

    def slice_allowance(self, tokens: int, computed: int, total: int, k: int) -> float | None:
        """What `k` layers of a slice of `tokens` after `computed` (of a prompt of `total`)
        may take without a step limit, as `allowance` for a chunk: 1 / EFFICIENCY of their
        share of the prompt's time alone; None under a limit or without a prediction."""
        if self.model is None or self.limit_s is not None or self.layers is None:
            return None
        alone = self._alone(tokens, computed, total)
        return None if alone is None else alone * k / self.layers / EFFICIENCY

    def take_slice(self, tokens: int) -> None:
        """A slice of `tokens` was scheduled: no other prompt chunk joins this step."""
        self.tokens -= min(tokens, self.tokens)
        self.sliced = True

    def _decodes(self) -> float | None:
        """The predicted time of the step's decodes where a slice may join them; None: no
        slices here (none configured, --max-step-ms inf, no decodes, no prediction)."""
        if self.layers is None or self.model is None or self.limit_s == float("inf"):
            return None
        if not self.shape.decodes:
            return None
        return self.model.predict(self.shape)

    def _limit(self, decodes: float) -> float:
        assert self.limit_s is not None
        return max(self.limit_s, decodes / (1 - FLOOR_SHARE))

    def _layer(self, tokens: int, computed: int) -> float:
        """One layer of a chunk (inf while unknown: nothing fits)."""
        assert self.model is not None
        key = (tokens, computed)
        if key not in self._layers_memo:
            t = self.model.layer_time(tokens, computed)
            self._layers_memo[key] = float("inf") if t is None else t
        return self._layers_memo[key]

    def _efficient(
        self, tokens: int, computed: int, total: int, k: int, decodes: float, debt_s: float
    ) -> bool:
        """Whether `k` layers of a slice beside the decodes keep the prompt's efficiency: their
        share of its time alone is EFFICIENCY of the step's, its debt made up."""
        assert self.layers is not None
        alone = self._alone(tokens, computed, total)
        if alone is None:
            return False
        step = decodes + k * self._layer(tokens, computed)
        return alone * k / self.layers >= EFFICIENCY * (step + debt_s)

    @staticmethod
    def _search(cap: int, fits: Callable[[int], bool], longest: bool = False) -> int:
        """The longest chunk <= cap that `fits` (`longest`; 0: none), else the shortest (cap:
        none); `fits` holds for the short ones (longest) or the long ones."""
        lo, hi = (0, cap) if longest else (1, cap)
        while lo < hi:
            if longest:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
            else:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
        return lo

    def _until(self, cap: int, computed: int, total: int, debt_s: float) -> float | None:
        """The step's time limit, fixed by its first chunk (of at most `cap` tokens after
        `computed`, of a prompt of `total`, `debt_s` behind); None where the model cannot
        predict."""
        assert self.model is not None
        decodes = self.model.predict(self.shape)
        if decodes is None:
            return None
        if self.limit_s is not None:
            return max(self.limit_s, decodes / (1 - FLOOR_SHARE))
        # The smallest chunk that keeps the efficiency, the debt made up (it grows with the
        # chunk, as the decodes' and the chunk's fixed costs spread over more tokens); none:
        # the whole cap. A debt is made up a decode step's worth at most a step, as a
        # slice's is (all at once, serving the 1.7 B MoE, a 207 ms debt after slow slices made
        # a 768-token chunk beside three decodes: a 2.2 s step).
        debt_s = min(debt_s, decodes)
        lo, hi = 1, cap
        while lo < hi:
            mid = (lo + hi) // 2
            t = self.model.predict(self.shape.plus(mid, computed))
            alone = self._alone(mid, computed, total)
            if t is not None and alone is not None and alone >= EFFICIENCY * (t + debt_s):
                hi = mid
            else:
                lo = mid + 1
        return self.model.predict(self.shape.plus(lo, computed))

    def allowance(self, n: int, computed: int, total: int) -> float | None:
        """What a chunk of `n` tokens after `computed` (of a prompt of `total`) may take
        without a step limit: 1 / EFFICIENCY of their cost alone (the scheduler's ledger sets
        the measured step against it); None: a step limit rules, or no prediction."""
        if self.model is None or self.limit_s is not None or n <= 0:
            return None
        alone = self._alone(n, computed, total)
        return None if alone is None else alone / EFFICIENCY

    def _alone(self, n: int, computed: int, total: int) -> float | None:
        """`_alone_of`, asked once a step for each chunk."""
        key = (n, computed, total)
        if key not in self._alone_memo:
            self._alone_memo[key] = self._alone_of(n, computed, total)
        return self._alone_memo[key]

    def _alone_of(self, n: int, computed: int, total: int) -> float | None:
        """What `n` prompt tokens after `computed` cost in the prompt's run alone, in chunks
        of the whole token budget: their share of the fixed costs of the chunk that holds
        them there (its step, its gather of the context, the experts it reads) and their own
        attention pairs, at most their cost through every layer as slices. Over a prompt the
        shares add up to its time alone."""
        assert self.model is not None
        start = computed - computed % self.whole  # the chunk that holds them alone
        size = min(self.whole, max(total - start, computed + n - start))
        own_pairs = chunk_pairs(n, computed)
        # The model is linear in a shape's features: the whole chunk with its pairs scaled
        # from these tokens' own, times their share, is their fixed costs' share plus their
        # per-token and pair costs.
        shape = StepShape(
            chunk_tokens=size,
            chunk_pairs=round(own_pairs * size / n),
            chunk_context=start + size,
            chunks=1,
        )
        t = self.model.predict(shape)
        if t is None:
            return None
        share = t * n / size
        # Never above what the same tokens cost run as layer slices (`layer_time`, scaled by
        # the slices measured): a slice's tokens share a layer's weights with fewer tokens
        # than a whole chunk's do, so it costs about their share alone or more. The fit's
        # whole chunks, extrapolated from short ones, ran 14-49% above the prompt's measured
        # time alone serving the 1.7 B MoE (its slices 3-6% above it) and ~3x on the demo
        # model, and every allowance is a share of it: the prompt came to 1.3-1.6x its time
        # alone on the 1.7 B MoE, 3.5-5.6x on the demo, where the rule promises 1 / EFFICIENCY.
        if self.layers is not None:
            layer = self._layer(n, computed)
            if 0 < layer < float("inf"):
                share = min(share, layer * self.layers)
        return share

    def _fit(self, cap: int, computed: int) -> int:
        """The most tokens (<= cap) whose chunk keeps the step's prediction within its limit:
        a binary search, the prediction grows with the chunk."""
        assert self.model is not None and self.until_s is not None
        lo, hi = 0, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            t = self.model.predict(self.shape.plus(mid, computed))
            if t is not None and t <= self.until_s:
                lo = mid
            else:
                hi = mid - 1
        return lo
