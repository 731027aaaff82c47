"""Load-or-recompute: the pure policy of the KV tiers (no I/O, no clock).

Who calls it: the engine's tier component (`kv/tiers.py`) when a request is admitted with blocks
found in a KV store beyond its device prefix hit, and later the Conductor and the cluster
simulator, which route on the same prediction. Inputs are measured by the callers (the store's
startup probe and real loads, the engine's prefill steps) and handed in; nothing here reads a
clock or touches a store, so the same function gives the same answer in the simulator.

A run of blocks found in the store is worth loading only where loading it is predicted faster
than recomputing it: SSD-backed tiers can be slower than a fast prefill ("more hits, slower
TTFT"), and then the tokens are recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Weight of a new observation in the moving averages: the model follows a changing machine
# within a few dozen loads, and one outlier moves it by a fifth.
EMA = 0.2


@dataclass
class TierCost:
    """What one read of n bytes from a tier costs: latency_s + n / bandwidth."""

    latency_s: float
    bandwidth: float  # bytes per second

    def load_time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass
class CostModel:
    """Per-tier read costs and the engine's prefill rate, refined from what really happens."""

    tiers: dict[str, TierCost] = field(default_factory=dict)
    prefill_tokens_per_s: float | None = None  # None until the engine has prefilled once
    step_s: float = 0.0  # an engine step: what a load off the engine thread waits at least

    def observe_load(self, tier: str, nbytes: int, seconds: float, calls: int = 1) -> None:
        """A real read of `nbytes` in `calls` batched calls took `seconds`: update the tier's
        bandwidth (its latency stays the probe's, a per-call fixed cost)."""
        cost = self.tiers.get(tier)
        if cost is None or nbytes <= 0 or seconds <= 0:
            return
        transfer = seconds - calls * cost.latency_s
        if transfer <= 0:
            return  # all latency: nothing to learn about the bandwidth
        cost.bandwidth = (1 - EMA) * cost.bandwidth + EMA * (nbytes / transfer)

    def observe_step(self, seconds: float) -> None:
        self.step_s = (1 - EMA) * self.step_s + EMA * seconds if self.step_s else seconds

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else (1 - EMA) * old + EMA * rate


@dataclass(frozen=True)
class LoadPlan:
    """How many of the found blocks to load (a prefix of the run), and why."""

    num_blocks: int  # 0: recompute everything
    found_blocks: int
    load_s: float  # predicted time to load num_blocks (0 when none)
    recompute_s: float  # predicted time to recompute those blocks' tokens
    reason: str  # "load", "recompute cheaper", "unknown tier", "no prefill rate yet"

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
) -> LoadPlan:
    """`found[i]` names the tier holding the i-th block after the device hit (a run: prefix
    semantics). Returns the prefix worth loading: the k that saves the most predicted time,
    where loading k blocks costs one batched read per tier among them (the tiers are read one
    after the other), plus an engine step when any of them is not an `inline` tier (those are
    read at admission; the others on a thread, landing a step later), and recomputing them
    costs k * block_size tokens at the prefill rate."""
    n = len(found)
    if n == 0:
        return LoadPlan(0, 0, 0.0, 0.0, "nothing found")
    if always:  # the operator asked to load whatever is found
        return LoadPlan(n, n, 0.0, 0.0, "load (always)")
    rate = model.prefill_tokens_per_s
    if rate is None:
        # Nothing to compare with yet (the engine measures a prefill at start-up): recomputing
        # can never be slower than recomputing.
        return LoadPlan(0, n, 0.0, 0.0, "no prefill rate yet")
    best_k, best_gain, best_load = 0, 0.0, 0.0
    per_tier: dict[str, int] = {}
    for k, tier in enumerate(found, start=1):
        if tier not in model.tiers:
            break  # a tier we cannot predict: load only what comes before it
        per_tier[tier] = per_tier.get(tier, 0) + 1
        load = sum(model.tiers[t].load_time(c * bytes_per_block) for t, c in per_tier.items())
        if any(t not in inline for t in per_tier):
            load += model.step_s
        recompute = k * block_size / rate
        if recompute - load > best_gain:
            best_k, best_gain, best_load = k, recompute - load, load
    recompute_best = best_k * block_size / rate if best_k else 0.0
    if best_k:
        return LoadPlan(best_k, n, best_load, recompute_best, "load")
    if found[0] not in model.tiers:
        return LoadPlan(0, n, 0.0, 0.0, "unknown tier")
    first = model.tiers[found[0]].load_time(bytes_per_block)
    return LoadPlan(0, n, first, block_size / rate, "recompute cheaper")
