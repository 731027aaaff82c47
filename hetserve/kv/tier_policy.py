"""Load-or-recompute: the pure policy of the KV tiers (no I/O, no clock).

Who calls it: the engine's tier component (`kv/tiers.py`) when a request is admitted with blocks
found in a KV store beyond its device prefix hit, and later the Conductor and the cluster
simulator, which route on the same prediction. Inputs are measured by the callers (the store's
startup probe and real loads, the engine's steps, what is running now) and handed in; nothing
here reads a clock or touches a store, so the same function gives the same answer in the
simulator.

A run of blocks found in the store is worth loading only where loading it is predicted faster
than recomputing it: SSD-backed tiers can be slower than a fast prefill ("more hits, slower
TTFT"), and then the tokens are recomputed.

What a load costs the request. A load read at admission (an `inline` tier) holds the step for
its read time, and the request joins that step. A load off the engine thread is noticed at the
first step boundary after its read ends, and the request joins the step after that: it waits a
whole number of the steps that run meanwhile (`period_s`: the other requests' step, or the
engine's poll interval when nothing else runs). Recomputing instead joins the current step with
the extra tokens. The other requests' work in the current and the joining step is paid either
way, so the comparison is that wait against the tokens' prefill time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hetserve.kv.step_time import StepShape, StepTimeModel

# Weight of a new observation in the moving averages: the model follows a changing machine
# within a few dozen loads, and one outlier moves it by a fifth.
EMA = 0.2
# Steps with at least this many prompt tokens refine the prefill rate (smaller ones are mostly
# fixed per-step cost).
PREFILL_SAMPLE_TOKENS = 64


@dataclass
class TierCost:
    """What one read of n bytes from a tier costs: latency_s + n / bandwidth."""

    latency_s: float
    bandwidth: float  # bytes per second

    def load_time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass
class CostModel:
    """Per-tier read costs, the engine's prefill rate and its decode step, refined from what
    really happens; and the step-time fit (`steps`) the scheduler sizes prompt chunks with.
    The engine owns one, measured at start-up, and hands it to the tiers and the scheduler."""

    tiers: dict[str, TierCost] = field(default_factory=dict)
    prefill_tokens_per_s: float | None = None  # None until the engine has prefilled once
    decode_step_s: float | None = None  # a step without prompt tokens; None until one ran
    # This machine's memory copy rate: a read ends in a copy into the caller's buffers, so no
    # tier is believed faster (a real load of a few blocks can look arbitrarily fast).
    copy_bandwidth: float | None = None
    steps: StepTimeModel = field(default_factory=StepTimeModel)

    def observe_load(self, tier: str, nbytes: int, seconds: float, calls: int = 1) -> None:
        """A real read of `nbytes` in `calls` batched calls took `seconds`: update the tier's
        bandwidth (its latency stays the probe's, a per-call fixed cost)."""
        cost = self.tiers.get(tier)
        if cost is None or nbytes <= 0 or seconds <= 0:
            return
        transfer = seconds - calls * cost.latency_s
        if transfer <= 0:
            return  # all latency: nothing to learn about the bandwidth
        seen = nbytes / transfer
        if self.copy_bandwidth is not None:
            seen = min(seen, self.copy_bandwidth)
        cost.bandwidth = (1 - EMA) * cost.bandwidth + EMA * seen

    def observe_step(
        self,
        seconds: float,
        prompt_tokens: int,
        shape: StepShape | None = None,
        overhead_s: float | None = None,
    ) -> None:
        """An engine step computed its batch of `prompt_tokens` prompt tokens in `seconds`: a
        step without any refines the decode step, a long one the prefill rate; its `shape`
        and the `overhead_s` it spent around the batch, the step-time fit."""
        if seconds <= 0:
            return
        if shape is not None:
            self.steps.observe(shape, seconds)
        if overhead_s is not None:
            self.steps.observe_overhead(overhead_s)
        if prompt_tokens == 0:
            old = self.decode_step_s
            self.decode_step_s = seconds if old is None else (1 - EMA) * old + EMA * seconds
        elif prompt_tokens >= PREFILL_SAMPLE_TOKENS:
            self.observe_prefill(prompt_tokens, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else (1 - EMA) * old + EMA * rate

    def step_period(self, to_compute: Sequence[int], budget: int, poll_s: float) -> float:
        """How long each engine step lasts while a load is out, from what is running now:
        `to_compute` holds each running request's tokens still to compute (1: it decodes),
        `budget` the step's token budget. With nothing running the engine only polls."""
        if not to_compute:
            return poll_s
        rate = self.prefill_tokens_per_s
        decodes = sum(1 for n in to_compute if n <= 1)
        prefill = min(sum(n for n in to_compute if n > 1), budget)
        period = 0.0
        if decodes:
            if self.decode_step_s is not None:
                period += self.decode_step_s
            elif rate:  # no decode step seen yet: at least its tokens' share of a prefill
                period += decodes / rate
        if prefill and rate:
            period += prefill / rate
        return max(period, poll_s)


def load_wait(read_s: float, period_s: float) -> float:
    """What a load off the engine thread costs its request: its read, rounded up to the step
    boundary where the engine notices it (steps of `period_s`; at least one)."""
    if period_s <= 0:
        return read_s
    # The small slack keeps a read of exactly n periods at n (float division may give n + eps).
    return max(1, math.ceil(read_s / period_s - 1e-9)) * period_s


def predict_load(
    tiers: Sequence[str],
    bytes_per_block: int,
    model: CostModel,
    inline: frozenset[str] | set[str] = frozenset(),
    period_s: float = 0.0,
) -> tuple[float, float] | None:
    """(reads, cost to the request) of loading one block from each of `tiers` (see
    `plan_load`); None when a tier has no cost yet."""
    read = read_time(Counter(tiers), bytes_per_block, model)
    if read is None:
        return None
    return read, read if set(tiers) <= inline else load_wait(read, period_s)


def read_time(tiers: Mapping[str, int], bytes_per_block: int, model: CostModel) -> float | None:
    """Predicted seconds to read `tiers[t]` blocks from each tier t, one batched read per
    tier, one after the other; None when a tier has no cost yet."""
    if any(t not in model.tiers for t in tiers):
        return None
    return sum(model.tiers[t].load_time(n * bytes_per_block) for t, n in tiers.items())


@dataclass(frozen=True)
class LoadPlan:
    """How many of the found blocks to load (a prefix of the run), and why."""

    num_blocks: int  # 0: recompute everything
    found_blocks: int
    load_s: float  # predicted cost of loading num_blocks: read, plus the wait when off-thread
    recompute_s: float  # predicted time to recompute those blocks' tokens
    reason: str  # "load", "recompute cheaper", "unknown tier", "no prefill rate yet"
    read_s: float = 0.0  # of load_s, the reads alone

    @property
    def skipped(self) -> bool:
        """Blocks were found but recomputing them was predicted faster."""
        return self.found_blocks > 0 and self.num_blocks == 0


def plan_load(
    found: Sequence[str],
    bytes_per_block: int,
    block_size: int,
    model: CostModel,
    always: bool = False,
    inline: frozenset[str] | set[str] = frozenset(),
    period_s: float = 0.0,
) -> LoadPlan:
    """`found[i]` names the tier holding the i-th block after the device hit (a run: prefix
    semantics). Returns the prefix worth loading: the k that saves the most predicted time
    (ties: the fewest blocks; no gain: recompute). Loading k blocks costs one batched read per
    tier among them, the tiers read one after the other; when any of them is not an `inline`
    tier the reads land off the engine thread and cost `load_wait(reads, period_s)` (see the
    module's docstring). Recomputing them costs k * block_size tokens at the prefill rate."""
    n = len(found)
    if n == 0:
        return LoadPlan(0, 0, 0.0, 0.0, "nothing found")
    rate = model.prefill_tokens_per_s
    costs = _load_costs(found, bytes_per_block, model, inline, period_s)
    if always:  # the operator asked to load whatever is found; predict it where we can
        read, load = costs[n - 1] if len(costs) == n else (0.0, 0.0)
        recompute = n * block_size / rate if rate else 0.0
        return LoadPlan(n, n, load, recompute, "load (always)", read)
    if rate is None:
        # Nothing to compare with yet (the engine measures a prefill at start-up): recomputing
        # can never be slower than recomputing.
        return LoadPlan(0, n, 0.0, 0.0, "no prefill rate yet")
    best_k, best_gain = 0, 0.0
    for k, (_, load) in enumerate(costs, start=1):
        gain = k * block_size / rate - load
        if gain > best_gain:
            best_k, best_gain = k, gain
    if best_k:
        read, load = costs[best_k - 1]
        return LoadPlan(best_k, n, load, best_k * block_size / rate, "load", read)
    if not costs:
        return LoadPlan(0, n, 0.0, 0.0, "unknown tier")
    read, load = costs[0]
    return LoadPlan(0, n, load, block_size / rate, "recompute cheaper", read)


def _load_costs(
    found: Sequence[str],
    bytes_per_block: int,
    model: CostModel,
    inline: frozenset[str] | set[str],
    period_s: float,
) -> list[tuple[float, float]]:
    """(reads, cost) of loading the first k blocks, for each k up to the first tier we cannot
    predict (only what comes before it can be loaded)."""
    out = []
    per_tier: dict[str, int] = {}
    for tier in found:
        if tier not in model.tiers:
            break
        per_tier[tier] = per_tier.get(tier, 0) + 1
        read = read_time(per_tier, bytes_per_block, model)
        assert read is not None  # every tier in per_tier has a cost
        off_thread = any(t not in inline for t in per_tier)
        out.append((read, load_wait(read, period_s) if off_thread else read))
    return out
