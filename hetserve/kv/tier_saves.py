"""Saves of KV blocks to a store, in the background: the write side of the KV tiers.

Who calls it: `TierManager` (kv/tiers.py) on the engine thread. Two paths feed it:
- write-back on eviction (`capture`): a cached block the pool hands out is copied, before the
  next forward writes over it, into a bounded staging area, and saved from there;
- write-through (`enqueue`): blocks pinned in the device pool and saved in place (a shared
  store's prompt blocks, so other instances find them at once; everything at shutdown).
Store calls run on one saver thread, a batch at a time, so no step waits on I/O.

The staging area doubles as a victim cache: a slot keeps its block's bytes (and the block's
identity) until the slot is reused, oldest-freed first, so a request coming back for a block
evicted a moment ago copies it from there (`staged_run`, `unstage`) instead of waiting for the
store. Slots being read are held (`hold`), so no capture reuses them meanwhile.

Failure contract: a save that raises (a full or unreachable store) leaves those blocks unsaved
(counted); nothing is retried. Under pressure the oldest queued save is shed rather than
stalling a step (counted): a full staging area drops the oldest staged block, a long pin queue
releases the oldest pinned block.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from hetserve.core.block_hash import BlockHash
from hetserve.kv.block_io import BlockIO
from hetserve.kv.block_pool import Eviction, KVBlock
from hetserve.kv.tier_blocks import TierBlocks
from hetserve.store.api import KVStore, ReplicateConfig

log = logging.getLogger(__name__)

SAVE_BATCH = 32  # blocks per batched put
KNOWN_SAVED = 1 << 18  # hashes remembered as already in the store


@dataclass(eq=False)
class _Job:
    hashes: list[BlockHash]
    pins: list[float | None]  # per block: a session's remaining protection, in seconds
    blocks: list[KVBlock] | None = None  # pinned blocks saved in place
    slots: list[int] | None = None  # or staged copies
    ok: bool | None = None


class Saver:
    def __init__(self, store: KVStore, blocks: TierBlocks, io: BlockIO, max_pending: int) -> None:
        self.store, self.blocks, self.pool, self.io = store, blocks, blocks.pool, io
        self.max_pending = max_pending
        self._pinned: deque[KVBlock] = deque()
        self._staged: deque[tuple[BlockHash, int, float | None]] = deque()  # hash, slot, pin
        self._free_slots: deque[int] = deque(range(io.staging_slots))  # oldest freed first
        self._slot_of: dict[BlockHash, int] = {}  # victim cache: block -> slot holding it
        self._hash_in: dict[int, BlockHash] = {}
        self._held: set[int] = set()  # slots being read: not reused meanwhile
        self._out: list[_Job] = []  # handed to the saver thread, not finished
        self._in_flight_blocks = 0
        self._known: OrderedDict[BlockHash, None] = OrderedDict()
        self._in_flight: dict[BlockHash, int] = {}  # staged or being saved, not yet in the store
        self.saved = self.save_bytes = self.failed = self.shed = 0
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, daemon=True, name="hetserve-kv-save")
        self._thread.start()
        self._evicted: list[Eviction] = []  # handed out since the last capture
        self.pool.on_evict.append(self._evicted.append)
        # Told of the blocks each successful save put in the store (KV events).
        self.on_saved: list[Callable[[list[BlockHash]], None]] = []

    def known(self, h: BlockHash | None) -> bool:
        return h is None or h in self._known

    def _track(self, h: BlockHash, delta: int) -> None:
        n = self._in_flight.get(h, 0) + delta
        if n > 0:
            self._in_flight[h] = n
        else:
            self._in_flight.pop(h, None)

    def saved_hashes(self) -> list[BlockHash]:
        """The blocks this engine saved (as far as it remembers), oldest first."""
        return list(self._known)

    # ---- engine thread ---------------------------------------------------------------------
    def capture(self) -> None:
        """Stage the cached blocks just handed out (their bytes are still in place): call
        after scheduling, before the forward writes into them."""
        if not self._evicted:
            return
        evicted = self._evicted.copy()
        self._evicted.clear()  # in place: the pool appends to this very list
        # A block evicted again while its earlier copy is still staged or being saved (recomputed
        # meanwhile: the same identity, the same bytes) is saved once: that copy's save stands
        # (`again` keeps the new one in case shedding below drops the staged one).
        todo, again, seen = [], {}, set()
        for e in evicted:
            h = e.block_hash
            if self.known(h) or h in seen:
                continue
            seen.add(h)
            if h in self._in_flight:
                again[h] = e
            else:
                todo.append(e)
        if not todo:
            return
        usable = len(self._free_slots) - len(self._held & set(self._free_slots))
        need = len(todo) - usable
        while need > 0 and self._staged:  # shed the oldest staged saves, not the new ones
            h, slot, _ = self._staged.popleft()
            self._free_slots.append(slot)
            self._track(h, -1)
            self.shed += 1
            if slot not in self._held:
                need -= 1
            if h in again and h not in self._in_flight:  # its block's bytes are still in place
                todo.append(again.pop(h))
                need += 1
        if need > 0:  # more evictions than the staging area holds: keep the newest
            self.shed += need
            todo = todo[need:]
        slots = [self._take_slot() for _ in todo]
        self.io.stage([e.block_id for e in todo], slots)
        now = self.pool.now
        for e, slot in zip(todo, slots, strict=True):
            self._staged.append((e.block_hash, slot, _ttl(e, now)))
            self._track(e.block_hash, 1)
            stale = self._slot_of.get(e.block_hash)  # a shed or failed copy: this one replaces it
            if stale is not None:
                del self._hash_in[stale]
            self._slot_of[e.block_hash] = slot
            self._hash_in[slot] = e.block_hash

    def _take_slot(self) -> int:
        """The oldest-freed slot not being read; it forgets the block it held."""
        for _ in range(len(self._free_slots)):
            slot = self._free_slots.popleft()
            if slot not in self._held:
                old = self._hash_in.pop(slot, None)
                if old is not None:
                    self._slot_of.pop(old, None)
                return slot
            self._free_slots.append(slot)
        raise AssertionError("no free staging slot (capture counts them first)")

    # ---- the victim cache ---------------------------------------------------------------
    def staged_run(self, hashes: list[BlockHash]) -> list[int]:
        """Slots holding the leading run of these blocks (copies of blocks evicted lately)."""
        if self._evicted and any(e.block_hash in set(hashes) for e in self._evicted):
            self.capture()  # their bytes are still in place: stage them now
        run = []
        for h in hashes:
            slot = self._slot_of.get(h)
            if slot is None:
                break
            run.append(slot)
        return run

    def hold(self, slots: list[int]) -> None:
        self._held.update(slots)

    def release(self, slots: list[int]) -> None:
        self._held.difference_update(slots)

    def enqueue(self, blocks: list[KVBlock]) -> None:
        """Pin blocks and save them in place (write-through, flush)."""
        new = [
            b
            for b in blocks
            if not self.known(b.block_hash) and b.block_id not in self.blocks.pinned
        ]
        if not new:
            return
        self.blocks.pin(new)
        self._pinned.extend(new)
        while len(self._pinned) > self.max_pending:  # shed the oldest rather than stall
            self.blocks.unpin([self._pinned.popleft()])
            self.shed += 1

    def pump(self) -> None:
        """Take finished saves in, and hand the saver all that waits, in batches, up to
        `max_pending` blocks in flight (the rest waits here, where it may be shed)."""
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                break
            self._finish(job)
        now = self.pool.now
        while self._staged or self._pinned:
            if self._in_flight_blocks >= self.max_pending:
                return
            if self._staged:  # evicted blocks first: their copies exist nowhere else
                n = min(SAVE_BATCH, len(self._staged))
                batch = [self._staged.popleft() for _ in range(n)]
                job = _Job(
                    [h for h, _, _ in batch],
                    [p for _, _, p in batch],
                    slots=[s for _, s, _ in batch],
                )
            else:
                n = min(SAVE_BATCH, len(self._pinned))
                blocks = [self._pinned.popleft() for _ in range(n)]
                pins = [
                    None if (u := self.blocks.protection(b)) is None else u - now for b in blocks
                ]
                hashes = [b.block_hash for b in blocks]
                assert all(h is not None for h in hashes), "a pinned cached block lost its hash"
                job = _Job(hashes, pins, blocks=blocks)  # type: ignore[arg-type]
            self._out.append(job)
            self._in_flight_blocks += len(job.hashes)
            self._jobs.put(job)

    def _finish(self, job: _Job) -> None:
        self._out.remove(job)
        self._in_flight_blocks -= len(job.hashes)
        if job.slots is not None:
            for h in job.hashes:
                self._track(h, -1)
        if job.ok:
            self.saved += len(job.hashes)
            self.save_bytes += len(job.hashes) * self.io.bytes_per_block
            for h in job.hashes:
                self._remember(h)
            for fn in self.on_saved:
                fn(job.hashes)
        else:
            self.failed += len(job.hashes)
        if job.blocks is not None:
            self.blocks.unpin(job.blocks)
        if job.slots is not None:
            self._free_slots.extend(job.slots)

    def _remember(self, h: BlockHash) -> None:
        self._known[h] = None
        self._known.move_to_end(h)
        if len(self._known) > KNOWN_SAVED:
            self._known.popitem(last=False)

    def pending(self) -> int:
        return len(self._pinned) + len(self._staged) + self._in_flight_blocks

    def flush(self, timeout_s: float) -> bool:
        """Save every free cached device block the store may lack, and wait (at most
        `timeout_s`) until no save is left. Returns whether everything was saved in time."""
        deadline = time.monotonic() + timeout_s
        limit, self.max_pending = self.max_pending, 1 << 30
        try:
            self.capture()
            cached = [b for b in self.pool.blocks[1:] if b.block_hash is not None]
            self.enqueue([b for b in cached if b.ref_cnt == 0])
            while self.pending() and time.monotonic() < deadline:
                self.pump()
                time.sleep(0.001)
        finally:
            self.max_pending = limit
        return not self.pending()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def check_integrity(self) -> None:
        pinned = [b.block_id for b in self._pinned]
        for job in self._out:
            pinned += [b.block_id for b in job.blocks or []]
        assert len(set(pinned)) == len(pinned), pinned
        for bid in pinned:
            assert self.blocks.pinned.get(bid, 0) >= 1, bid
        assert all(self._slot_of[h] == s for s, h in self._hash_in.items())
        assert len(self._slot_of) == len(self._hash_in)
        slots = [s for _, s, _ in self._staged] + list(self._free_slots)
        for job in self._out:
            slots += job.slots or []
        assert sorted(slots) == list(range(self.io.staging_slots)), "staging slots leaked"
        staged = [h for h, _, _ in self._staged]
        for job in self._out:
            if job.slots is not None:
                staged += job.hashes
        assert self._in_flight_blocks == sum(len(j.hashes) for j in self._out)
        counts: dict[BlockHash, int] = {}
        for h in staged:
            counts[h] = counts.get(h, 0) + 1
        assert counts == self._in_flight, "in-flight saves out of step with the staged ones"

    # ---- saver thread ----------------------------------------------------------------------
    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.ok = self._write(job)
            self._done.put(job)

    def _write(self, job: _Job) -> bool:
        keys = [h.digest for h in job.hashes]
        try:
            if job.blocks is not None:
                parts = self.io.save_parts([b.block_id for b in job.blocks])
            else:
                parts = self.io.staged_parts(job.slots or [])
            plain = [i for i, p in enumerate(job.pins) if p is None or p <= 0]
            pinned = [i for i, p in enumerate(job.pins) if p is not None and p > 0]
            if pinned:  # a live session's blocks stay pinned in the store for the rest of it
                ttl = max(job.pins[i] or 0.0 for i in pinned)
                cfg = ReplicateConfig(soft_pin=True, soft_pin_ttl_s=ttl)
                self.store.batch_put_parts(
                    [keys[i] for i in pinned], [parts[i] for i in pinned], cfg
                )
            if plain:
                self.store.batch_put_parts([keys[i] for i in plain], [parts[i] for i in plain])
            return True
        except Exception as exc:  # a full or unreachable store: these blocks stay unsaved
            log.warning("KV store save of %d blocks failed: %s", len(keys), exc)
            return False


def _ttl(e: Eviction, now: float) -> float | None:
    return None if e.protected_until is None else e.protected_until - now
