"""KVIndex: which instance holds which KV block in which tier, built from their KV events.

Who calls it: the KV event subscriber (`kv_subscriber.py`) applies each instance's events
(`apply`), snapshots (`reset`) and departures (`drop`); the Conductor asks
`holdings(block_hashes)` for each request and hands the answer to the routing policy as
`ClusterView.holdings` (`policy.PrefixHolding`: per holder, the prefix each tier covers together
with the faster ones). Pure: no I/O, no clock, no lock (the service serializes its calls).

Media map to the policy's tiers: GPU -> "device" (a CPU-only engine's pool too), CPU -> "dram",
DISK -> "ssd"; POOL blocks belong to the holder "pool", whichever instance announced them (the
instances share that store). Shared stores cannot tell anyone of their evictions
(`kv/events.py`), so at most `max_pool_blocks` POOL blocks are kept, the least recently
announced dropped first; a stale one costs a Conductor a failed pull, never wrong KV.

Lookup, O(prompt blocks) in C-level loops: each block hash maps to a fixed-width bit string of
four lanes of holder bits (`width` bits each): device; device|dram; device|dram|ssd (what each
tier covers cumulatively); pool (bit 0). The prompt's strings are joined into one array and
AND-accumulated down the blocks (numpy), which keeps, at block i, the holders whose tier covers
blocks 0..i; a holder's prefix ends where its bit goes, and only the few blocks where the
running value changes (at most one per holder and lane) are looked at in Python. Chunks grow
from `FIRST_CHUNK`, so a prompt whose first blocks nobody holds stops early.

Failure contract: an event for a medium we do not know is ignored (counted in `ignored`);
nothing an instance sends makes this raise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat

import numpy as np

from hetserve.core.kv_events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockStored,
    KVEvent,
)
from hetserve.disagg.policy import POOL

LOCAL_MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)  # an instance's own, fastest first
LANE_TIERS = ("device", "dram", "ssd", POOL)  # the policy's tier names, lane by lane
DEFAULT_MAX_POOL_BLOCKS = 1 << 22
FIRST_CHUNK = 256  # blocks looked up before the first check for a prefix nobody holds


class KVIndex:
    def __init__(self, max_pool_blocks: int = DEFAULT_MAX_POOL_BLOCKS, width: int = 64) -> None:
        self.max_pool_blocks = max_pool_blocks
        if width < 64 or width & (width - 1):
            raise ValueError(f"width must be a power of two >= 64, got {width}")
        self._width = width  # holder slots per lane; doubled (and repacked) when full
        self._zero = bytes(width // 2)  # a block nobody holds
        self._slots: dict[str, int] = {}
        self._names: list[str | None] = [None] * width
        self._raw: dict[bytes, list[int]] = {}  # hash -> [gpu, cpu, disk, pool] slot bits
        self._packed: dict[bytes, bytes] = {}  # hash -> the four lanes, little-endian
        self._held: dict[str, tuple[set[bytes], ...]] = {}  # instance -> hashes per local medium
        self._pool: OrderedDict[bytes, None] = OrderedDict()  # least recently announced first
        self.ignored = 0

    # ---- instances ---------------------------------------------------------------------------
    @property
    def instances(self) -> list[str]:
        return list(self._slots)

    def add(self, instance: str) -> None:
        if instance in self._slots:
            return
        if instance == POOL:
            raise ValueError(f"{POOL!r} names the shared pool; an instance needs another name")
        free = [i for i, n in enumerate(self._names) if n is None]
        if not free:
            self._grow()
            free = [i for i, n in enumerate(self._names) if n is None]
        self._slots[instance] = free[0]
        self._names[free[0]] = instance
        self._held[instance] = (set(), set(), set())

    def drop(self, instance: str) -> None:
        """Forget an instance (gone for good); the pool keeps what it announced there."""
        if instance in self._slots:
            self.clear(instance)
            self._names[self._slots.pop(instance)] = None
            del self._held[instance]

    # ---- changes -----------------------------------------------------------------------------
    def apply(self, instance: str, events: Iterable[KVEvent]) -> None:
        """One batch of `instance`'s events, in order."""
        self.add(instance)
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.clear(instance)
            elif isinstance(ev, BlockStored):
                self.mark(instance, ev.medium or MEDIUM_GPU, ev.block_hashes, True)
            else:
                self.mark(instance, ev.medium or MEDIUM_GPU, ev.block_hashes, False)

    def mark(self, instance: str, medium: str, hashes: Iterable[bytes], held: bool) -> None:
        """`instance` now holds (or no longer holds) these blocks in `medium`."""
        if medium == MEDIUM_POOL:
            self._set_pool(hashes, held)
            return
        if medium not in LOCAL_MEDIA:
            self.ignored += 1
            return
        self.add(instance)
        m, bit = LOCAL_MEDIA.index(medium), 1 << self._slots[instance]
        mine = self._held[instance][m]
        for h in hashes:
            if held != (h in mine):
                (mine.add if held else mine.discard)(h)
                self._flip(h, m, bit, held)

    def clear(self, instance: str) -> None:
        """`instance` holds nothing of its own any more (the pool keeps its blocks)."""
        for m, medium in enumerate(LOCAL_MEDIA):
            self.mark(instance, medium, list(self._held[instance][m]), False)

    def reset(self, instance: str, blocks: Mapping[str, Iterable[bytes]]) -> None:
        """Replace what is known of `instance` by a snapshot of it (medium -> hashes); POOL
        blocks in it are added to the pool's (other instances announced the rest)."""
        self.add(instance)
        for m, medium in enumerate(LOCAL_MEDIA):
            new = set(blocks.get(medium, ()))
            old = self._held[instance][m]
            self.mark(instance, medium, list(old - new), False)
            self.mark(instance, medium, new - old, True)
        self._set_pool(blocks.get(MEDIUM_POOL, ()), True)

    def _set_pool(self, hashes: Iterable[bytes], held: bool) -> None:
        for h in hashes:
            if held:
                if h not in self._pool:
                    self._flip(h, 3, 1, True)
                self._pool[h] = None
                self._pool.move_to_end(h)
            elif h in self._pool:
                del self._pool[h]
                self._flip(h, 3, 1, False)
        while len(self._pool) > self.max_pool_blocks:
            old, _ = self._pool.popitem(last=False)
            self._flip(old, 3, 1, False)

    def _flip(self, h: bytes, m: int, bit: int, on: bool) -> None:
        raw = self._raw.get(h)
        if raw is None:
            raw = self._raw[h] = [0, 0, 0, 0]
        raw[m] = raw[m] | bit if on else raw[m] & ~bit
        self._pack(h, raw)

    def _pack(self, h: bytes, raw: list[int]) -> None:
        g, c, d, p = raw
        w = self._width
        v = g | (g | c) << w | (g | c | d) << 2 * w | p << 3 * w
        if v:
            self._packed[h] = v.to_bytes(w // 2, "little")  # four lanes of w bits
        else:
            del self._packed[h], self._raw[h]

    def _grow(self) -> None:
        self._names += [None] * self._width
        self._width *= 2
        self._zero = bytes(self._width // 2)
        for h, raw in list(self._raw.items()):
            self._pack(h, raw)

    # ---- lookups -----------------------------------------------------------------------------
    def holdings(self, block_hashes: Sequence[bytes]) -> dict[str, dict[str, int]]:
        """Per holder (an instance, or "pool"), per tier: how many leading blocks of
        `block_hashes` (a prompt's chained hashes, in order) that tier covers together with
        the faster ones. Holders and tiers that cover none are left out."""
        n = len(block_hashes)
        out: dict[str, dict[str, int]] = {}
        prev: np.ndarray | None = None  # the running AND after the blocks scanned so far
        lo = 0
        for hi in (min(FIRST_CHUNK, n), n):  # a cold prompt stops after the first chunk
            if hi > lo:
                prev = self._scan(block_hashes, lo, hi, prev, out)
                lo = hi
                if not prev.any():
                    return out
        if prev is not None:  # what is left covers the whole prompt
            for word, value in enumerate(prev.tolist()):
                self._ended(out, word, value, n)
        return out

    def _scan(
        self,
        block_hashes: Sequence[bytes],
        lo: int,
        hi: int,
        prev: np.ndarray | None,
        out: dict[str, dict[str, int]],
    ) -> np.ndarray:
        """Blocks lo..hi: record where holder bits go; return the running AND."""
        words, m = self._width // 16, hi - lo
        buf = b"".join(map(self._packed.get, block_hashes[lo:hi], repeat(self._zero)))
        # Lanes as rows and blocks as columns, so the accumulate runs along contiguous memory;
        # column 0 is the running AND so far (or the first block), column i + 1 block lo + i.
        acc = np.empty((words, m + 1), np.uint64)
        acc[:, 1:] = np.frombuffer(buf, "<u8").reshape(m, words).T
        acc[:, 0] = acc[:, 1] if prev is None else prev
        np.bitwise_and.accumulate(acc, axis=1, out=acc)
        at = np.flatnonzero((acc[:, 1:] != acc[:, :-1]).any(axis=0))  # block lo + at lost bits
        if at.size:
            lost = acc[:, at] & ~acc[:, at + 1]  # words x changes: the bits each change lost
            word, change = np.nonzero(lost)
            for w, c, value in zip(
                word.tolist(), change.tolist(), lost[word, change].tolist(), strict=True
            ):
                self._ended(out, w, value, lo + int(at[c]))
        result: np.ndarray = acc[:, -1].copy()
        return result

    def _ended(self, out: dict[str, dict[str, int]], word: int, value: int, end: int) -> None:
        """The holder bits set in 64-bit `word` of the lanes cover blocks 0..end-1."""
        w = self._width
        while value:
            low = value & -value
            lane, slot = divmod(word * 64 + low.bit_length() - 1, w)
            name = POOL if lane == 3 else self._names[slot]
            assert name is not None, slot  # a freed slot's bits are cleared first
            out.setdefault(name, {})[LANE_TIERS[lane]] = end
            value ^= low

    def blocks(self, instance: str) -> dict[str, set[bytes]]:
        """What `instance` holds, per local medium (a copy)."""
        held = self._held.get(instance, (set(), set(), set()))
        return {medium: set(hs) for medium, hs in zip(LOCAL_MEDIA, held, strict=True)}

    def pool_blocks(self) -> set[bytes]:
        return set(self._pool)

    def check_integrity(self) -> None:
        for name, slot in self._slots.items():
            assert self._names[slot] == name
        assert sum(n is not None for n in self._names) == len(self._slots)
        for h, raw in self._raw.items():
            for m in range(3):
                holders = {n for n, s in self._slots.items() if raw[m] >> s & 1}
                assert holders == {n for n in self._slots if h in self._held[n][m]}, h
            assert bool(raw[3]) == (h in self._pool)
            assert any(raw), h
        for name, held in self._held.items():
            for m, hs in enumerate(held):
                assert all(self._raw[h][m] >> self._slots[name] & 1 for h in hs)
        assert all(h in self._raw for h in self._pool)
