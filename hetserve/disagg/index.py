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

Lookup, O(prompt blocks) in C-level loops: each block hash maps to a column of a numpy array
holding four lanes of holder bits (`width` bits each): device; device|dram; device|dram|ssd
(what each tier covers cumulatively); pool (bit 0). The prompt's columns are gathered (one dict
lookup per block: the cost that remains) and AND-accumulated down the blocks, which keeps, at
block i, the holders whose tier covers blocks 0..i; a holder's prefix ends where its bit goes,
and only the few blocks where the running value changes (at most one per holder and lane) are
looked at in Python. A prompt whose first `FIRST_CHUNK` blocks nobody holds stops there.

Failure contract: an event for a medium we do not know is ignored (counted in `ignored`);
nothing an instance sends makes this raise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

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
from hetserve.disagg.key_table import KeyTable, keys_of
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
        self._slots: dict[str, int] = {}
        self._names: list[str | None] = [None] * width
        self._raw: dict[bytes, list[int]] = {}  # hash -> [gpu, cpu, disk, pool] slot bits
        # The four lanes of each block as a column of 64-bit words (a gather by column is
        # contiguous per word); column 0 stays zero: a block nobody holds.
        self._rows: dict[bytes, int] = {}  # hash -> its column
        # The same by a 64-bit key of the hash, for vectorized lookups; keys two hashes share
        # are left out of it and looked up by hash (`_shared`: key -> hashes that have it).
        self._table = KeyTable()
        self._by_key: dict[int, bytes] = {}
        self._shared: dict[int, set[bytes]] = {}
        self._lanes = np.zeros((width // 16, 1024), np.uint64)
        self._digests = np.zeros((1024, 4), np.uint64)  # each column's hash: hits are checked
        self._free_rows = list(range(1023, 0, -1))
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
        row = self._rows.get(h)
        if v:
            if row is None:
                if not self._free_rows:
                    self._more_rows()
                row = self._rows[h] = self._free_rows.pop()
                self._digests[row] = np.frombuffer(h, "<u8")
                self._keyed(h, row)
            self._lanes[:, row] = np.frombuffer(v.to_bytes(w // 2, "little"), "<u8")
        else:
            del self._raw[h]
            if row is not None:
                del self._rows[h]
                self._unkeyed(h)
                self._lanes[:, row] = 0
                self._free_rows.append(row)

    def _keyed(self, h: bytes, row: int) -> None:
        k = int(keys_of(h)[0])
        if k in self._shared:
            self._shared[k].add(h)
            return
        other = self._by_key.setdefault(k, h)
        if other == h:
            self._table.put(k, row)
            return
        self._shared[k] = {other, h}  # two hashes, one key: both by hash from now on
        del self._by_key[k]
        self._table.remove(k)

    def _unkeyed(self, h: bytes) -> None:
        k = int(keys_of(h)[0])
        shared = self._shared.get(k)
        if shared is not None:
            shared.discard(h)
            if len(shared) == 1:  # alone again: back into the table
                (last,) = shared
                del self._shared[k]
                self._by_key[k] = last
                self._table.put(k, self._rows[last])
            return
        if self._by_key.get(k) == h:
            del self._by_key[k]
            self._table.remove(k)

    def _more_rows(self) -> None:
        have = self._lanes.shape[1]
        self._lanes = np.concatenate((self._lanes, np.zeros_like(self._lanes)), axis=1)
        self._digests = np.concatenate((self._digests, np.zeros_like(self._digests)))
        self._free_rows = list(range(2 * have - 1, have - 1, -1))

    def _grow(self) -> None:
        self._names += [None] * self._width
        self._width *= 2
        self._lanes = np.zeros((self._width // 16, self._lanes.shape[1]), np.uint64)
        for h, raw in list(self._raw.items()):
            self._pack(h, raw)

    # ---- lookups -----------------------------------------------------------------------------
    def holdings(self, block_hashes: Sequence[bytes]) -> dict[str, dict[str, int]]:
        """Per holder (an instance, or "pool"), per tier: how many leading blocks of
        `block_hashes` (a prompt's chained hashes, in order) that tier covers together with
        the faster ones. Holders and tiers that cover none are left out."""
        n = len(block_hashes)
        ended: list[tuple[np.ndarray, np.ndarray]] = []  # (lane bits lost, at which block)
        prev: np.ndarray | None = None  # the running AND after the blocks scanned so far
        lo = 0
        for hi in (min(FIRST_CHUNK, n), n):  # a cold prompt stops after the first chunk
            if hi > lo:
                prev = self._scan(block_hashes, lo, hi, prev, ended)
                lo = hi
                if not prev.any():
                    break
        if prev is not None and prev.any():  # what is left covers the whole prompt
            ended.append((prev[:, None], np.array([n])))
        out: dict[str, dict[str, int]] = {}
        w = self._width
        for lost, at in ended:
            # Each lost bit: its lane word (row) and the change (column) it went at.
            word, change = np.nonzero(lost)
            bits = np.unpackbits(lost[word, change].view(np.uint8).reshape(-1, 8), axis=1,
                                 bitorder="little")  # fmt: skip
            k, b = np.nonzero(bits)
            lane, slot = np.divmod(word[k] * 64 + b, w)
            for ln, sl, end in zip(
                lane.tolist(), slot.tolist(), at[change[k]].tolist(), strict=True
            ):
                name = POOL if ln == 3 else self._names[sl]
                assert name is not None, sl  # a freed slot's bits are cleared first
                out.setdefault(name, {})[LANE_TIERS[ln]] = end
        return out

    def _scan(
        self,
        block_hashes: Sequence[bytes],
        lo: int,
        hi: int,
        prev: np.ndarray | None,
        ended: list[tuple[np.ndarray, np.ndarray]],
    ) -> np.ndarray:
        """Blocks lo..hi: append the bits lost and where; return the running AND."""
        chunk = block_hashes[lo:hi]
        joined = b"".join(chunk)
        # A key names its column's hash or, rarely, another one that folds the same: checked
        # (natively in one pass where the kernels build).
        found = self._table.lookup_digests(joined, self._digests)
        if found is None:
            keys = keys_of(joined)
            cols = self._table.lookup(keys)
            same = (self._digests[cols] == np.frombuffer(joined, "<u8").reshape(-1, 4)).all(axis=1)
            cols[~same] = 0
        else:
            cols = found
        if self._shared:  # keys two stored hashes share: those few by their hash
            keys = keys_of(joined)
            for i in np.flatnonzero(np.isin(keys, list(self._shared))).tolist():
                cols[i] = self._rows.get(chunk[i], 0)
        # Lane words as rows and blocks as columns: the gather and the accumulate run along
        # contiguous memory. Column j is block lo + j.
        acc = self._lanes.take(cols, axis=1)
        if prev is not None:
            acc[:, 0] &= prev
        np.bitwise_and.accumulate(acc, axis=1, out=acc)
        at = np.flatnonzero((acc[:, 1:] != acc[:, :-1]).any(axis=0)) + 1  # blocks that lost bits
        ended.append((acc[:, at - 1] & ~acc[:, at], at + lo))
        if prev is not None:  # and the chunk's first block, against the chunk before
            ended.append(((prev & ~acc[:, 0])[:, None], np.array([lo])))
        result: np.ndarray = acc[:, -1].copy()
        return result

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
        assert set(self._rows) == set(self._raw)
        assert not self._lanes[:, 0].any() and 0 not in self._free_rows
        assert len(set(self._free_rows) | set(self._rows.values())) == self._lanes.shape[1] - 1
