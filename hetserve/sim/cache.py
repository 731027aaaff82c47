"""The prefill side's KV caches: one LRU of blocks per holder, and the index the Conductor keeps
of who holds what.

Holders are numbered: the prefill instances (each node's DRAM), and in the global mode one
more for the CPU nodes that only lend DRAM to the pool. `--cache local`: an instance reuses only
what its own LRU holds. `--cache global` (Mooncake Store): the same LRUs, and any block held
anywhere can also be pulled over the network; a pulled block is kept by the puller
(replication), so the replica count of a block is the number of instances holding it.

Within a prompt, blocks are touched deepest first, so its first block is the most recently
used: LRU evicts the tails of prefix chains before their roots (a root evicted first would
strand every block after it).

Who calls it: the simulator's event loop. Pure; `check_integrity` asserts our own invariants.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class ReplicaLog:
    """How many instances hold each block over time, for the hot-block plot: the integral of
    each block's replica count (to rank blocks, as the paper ranks by summed samples) and its
    history of changes."""

    integral: dict[int, float] = field(default_factory=dict)
    history: dict[int, list[tuple[float, int]]] = field(default_factory=dict)

    def changed(self, block: int, count: int, now: float) -> None:
        hist = self.history.setdefault(block, [])
        if hist:
            t, old = hist[-1]
            self.integral[block] = self.integral.get(block, 0.0) + old * (now - t)
        hist.append((now, count))

    def ranked(self, ranks: Sequence[int], end: float, every: float) -> dict[int, list[int]]:
        """Replica counts sampled every `every` seconds up to `end` of the blocks at the given
        1-based ranks (by time-integrated count; ties by id)."""
        total = {
            b: self.integral.get(b, 0.0) + h[-1][1] * (end - h[-1][0])
            for b, h in self.history.items()
        }
        order = sorted(total, key=lambda b: (-total[b], b))
        out = {}
        for rank in ranks:
            if rank <= len(order):
                hist = self.history[order[rank - 1]]
                out[rank] = _sample(hist, end, every)
        return out


def _sample(hist: list[tuple[float, int]], end: float, every: float) -> list[int]:
    samples, i, count = [], 0, 0
    steps = int(end // every) + 1
    for k in range(steps):
        t = k * every
        while i < len(hist) and hist[i][0] <= t:
            count = hist[i][1]
            i += 1
        samples.append(count)
    return samples


class Caches:
    """LRUs of block ids per holder, and block -> holders."""

    def __init__(
        self, capacities: Sequence[int], instances: int, replicas: ReplicaLog | None = None
    ) -> None:
        """`capacities[h]` blocks for each holder; the first `instances` holders are prefill
        instances (the rest lend DRAM to the pool and count for no replica)."""
        self.capacity = list(capacities)
        self.instances = instances
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in capacities]
        self.holders: dict[int, set[int]] = {}
        self.replicas = replicas
        self.evictions = 0

    def lookup(self, blocks: Sequence[int]) -> tuple[dict[int, int], int]:
        """How many leading blocks of `blocks` each instance holds (instances holding none are
        left out), and how many the pool as a whole holds (any holder, any mix)."""
        found: dict[int, int] = {}
        alive: set[int] = set()
        for i, b in enumerate(blocks):
            hs = self.holders.get(b)
            if not hs:
                for h in alive:
                    found[h] = i
                return found, i
            if i == 0:
                alive = {h for h in hs if h < self.instances}
            elif alive:
                for h in alive - hs:
                    found[h] = i
                alive &= hs
        for h in alive:
            found[h] = len(blocks)
        return found, len(blocks)

    def touch(self, holder: int, blocks: Sequence[int]) -> None:
        """Mark blocks `holder` has as just used (deepest first: the root ends most recent)."""
        lru = self.lru[holder]
        for b in reversed(blocks):
            if b in lru:
                lru.move_to_end(b)

    def insert(self, holder: int, blocks: Sequence[int], now: float) -> None:
        """`holder` now has `blocks` (computed or pulled): add them as most recent, evicting the
        least recently used past its capacity."""
        lru, cap = self.lru[holder], self.capacity[holder]
        if cap <= 0:
            return
        for b in reversed(blocks[:cap]):  # a prompt longer than the cache keeps its head
            if b in lru:
                lru.move_to_end(b)
                continue
            lru[b] = None
            self._add(b, holder, now)
            if len(lru) > cap:
                old, _ = lru.popitem(last=False)
                self._drop(old, holder, now)

    def _add(self, block: int, holder: int, now: float) -> None:
        hs = self.holders.setdefault(block, set())
        hs.add(holder)
        if self.replicas is not None and holder < self.instances:
            self.replicas.changed(block, self._instances_holding(hs), now)

    def _drop(self, block: int, holder: int, now: float) -> None:
        self.evictions += 1
        hs = self.holders[block]
        hs.discard(holder)
        if self.replicas is not None and holder < self.instances:
            self.replicas.changed(block, self._instances_holding(hs), now)
        if not hs:
            del self.holders[block]

    def _instances_holding(self, hs: set[int]) -> int:
        return sum(1 for h in hs if h < self.instances)

    def used(self, holder: int) -> int:
        return len(self.lru[holder])

    def check_integrity(self) -> None:
        for h, lru in enumerate(self.lru):
            assert len(lru) <= max(self.capacity[h], 0), (h, len(lru), self.capacity[h])
            for b in lru:
                assert h in self.holders[b], (h, b)
        for b, hs in self.holders.items():
            assert hs and all(b in self.lru[h] for h in hs), b
