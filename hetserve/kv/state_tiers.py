"""StateTiers: a linear-attention model's prefix checkpoints through the KV store, beside its
KV blocks.

Who calls it: the KV tiers (`kv/tiers.py` and `kv/tier_loads.py`) on the engine thread, and the
loader thread for `locate` and `read`. A checkpoint (the state of every linear-attention layer
after the first k blocks of a sequence, `kv/state_slots.py`) is stored as one object under a
key derived from the chained hash of the block it ends (`state_key`), so it has the blocks'
identity in every tier: a prefix found again in DRAM, on SSD or in the shared pool resumes from
the deepest checkpoint stored with it. The bytes are the slot's tensors, layer by layer, as
`StateIO` gives them.

Saves mirror the blocks': write-back when the state pool hands a checkpoint's slot out again
(`capture`, after scheduling and before the forward writes over it), write-through of new
checkpoints where the store is shared (`after_step`), everything at `flush`. The bytes are
copied on the engine thread (a slot is reused by the next forward) and put on one saver thread.

Failure contract: a put that raises leaves that checkpoint unsaved (counted); a lookup or read
that raises or misses is no checkpoint, so the request resumes from an earlier one or
recomputes, never from a wrong state. Under pressure the oldest queued save is shed (counted).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any, Protocol

from hetserve.core.block_hash import BlockHash
from hetserve.kv.block_pool import Eviction, KVBlock
from hetserve.kv.state_slots import StateSlots
from hetserve.store.api import KVStore

log = logging.getLogger(__name__)

KNOWN_SAVED = 1 << 16  # checkpoints remembered as already in the store


class StateIO(Protocol):
    """The bytes of one state slot (implemented by `engine/state_io.py`): for the KV tiers and
    the P/D hand-off."""

    slot_bytes: int

    def snapshot(self, slot: int) -> bytes:
        """A copy of the slot's bytes, layer by layer (engine thread)."""
        ...

    def read_parts(self, slot: int) -> list[Any]:
        """Writable host buffers a store read fills for this slot (loader thread)."""
        ...

    def commit_read(self, slot: int) -> None:
        """The read into `read_parts(slot)` finished: make it the slot's state."""
        ...

    def write(self, slot: int, data: memoryview) -> None:
        """Fill a slot from bytes as `snapshot` gives them (a P/D hand-off landing)."""
        ...


def state_key(h: BlockHash) -> bytes:
    """The store key of the checkpoint at the end of the block whose chained hash is `h`."""
    return hashlib.sha256(b"hetserve-state/v1" + h.digest).digest()


class StateTiers:
    def __init__(
        self,
        store: KVStore,
        slots: StateSlots,
        io: StateIO,
        *,
        write_through: bool,
        max_pending: int = 64,
    ) -> None:
        self.store, self.slots, self.io = store, slots, io
        self.every = slots.every
        self.write_through = write_through
        self.max_pending = max_pending
        self._evicted: list[Eviction] = []
        slots.pool.on_evict.append(self._evicted.append)
        self._fresh: list[KVBlock] = []  # checkpoints registered since the last step
        slots.on_cached.append(self._fresh.append)
        self._queue: deque[tuple[BlockHash, bytes]] = deque()  # engine thread only
        self._lock = threading.Lock()  # guards what both threads read
        self._in_flight: dict[BlockHash, bytes] = {}  # queued or being put: a victim cache
        self._known: OrderedDict[BlockHash, None] = OrderedDict()  # saved by this engine
        self._seen: OrderedDict[BlockHash, None] = OrderedDict()  # found in the store
        self.saved = self.failed = self.shed = self.loaded = 0
        self._jobs: queue.SimpleQueue[tuple[BlockHash, bytes] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, daemon=True, name="hetserve-state-save")
        self._thread.start()

    # ---- saves (engine thread) -------------------------------------------------------------
    def _known_or_pending(self, h: BlockHash) -> bool:
        with self._lock:
            return h in self._known or h in self._in_flight

    def _remember(self, d: OrderedDict[BlockHash, None], h: BlockHash) -> None:
        with self._lock:
            d[h] = None
            d.move_to_end(h)
            if len(d) > KNOWN_SAVED:
                d.popitem(last=False)

    def _save(self, h: BlockHash, slot: int) -> None:
        if self._known_or_pending(h):
            return
        data = self.io.snapshot(slot)
        with self._lock:
            self._in_flight[h] = data
        self._queue.append((h, data))
        while len(self._queue) > self.max_pending:  # shed the oldest rather than stall a step
            old, _ = self._queue.popleft()
            with self._lock:
                self._in_flight.pop(old, None)
            self.shed += 1

    def capture(self) -> None:
        """Write-back: copy the checkpoints whose slots were just handed out (their bytes are
        still in place until the next forward)."""
        evicted, self._evicted[:] = list(self._evicted), []
        for e in evicted:
            self._save(e.block_hash, e.block_id)

    def after_step(self) -> None:
        """Write-through of new checkpoints (shared stores); hand queued saves to the saver."""
        fresh, self._fresh[:] = list(self._fresh), []
        if self.write_through:
            for b in fresh:
                if b.block_hash is not None:
                    self._save(b.block_hash, b.block_id)
        while self._queue:
            self._jobs.put(self._queue.popleft())

    def saved_hashes(self) -> list[BlockHash]:
        with self._lock:
            return list(self._known)

    def pending(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def flush(self, timeout_s: float) -> bool:
        """Save every checkpoint the state pool holds that the store may lack; wait (at most
        `timeout_s`) for the saves. Returns whether all were saved in time."""
        self.capture()
        for b in self.slots.pool.blocks[1:]:
            if b.block_hash is not None:
                self._save(b.block_hash, b.block_id)
        while self._queue:
            self._jobs.put(self._queue.popleft())
        deadline = time.monotonic() + timeout_s
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.001)
        return not self.pending()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            h, data = job
            try:
                self.store.put(state_key(h), data)
                ok = True
            except Exception as exc:  # a full or unreachable store: this one stays unsaved
                log.warning("KV store save of a state checkpoint failed: %s", exc)
                ok = False
            if ok:
                self._remember(self._known, h)
            with self._lock:
                self._in_flight.pop(h, None)
                self.saved += ok
                self.failed += not ok

    # ---- loads ----------------------------------------------------------------------------
    def locate(
        self, hashes: Sequence[BlockHash], first: int, found: int, ask_store: bool = True
    ) -> int:
        """Of the `found` blocks after block `first` (`hashes` from block 0), how many a load
        can bring back: up to the deepest block that ends at a checkpoint kept in the state pool,
        waiting to be saved, or (`ask_store`) in the store (0: none). May run on the loader
        thread: the state pool is read only through its dict lookup."""
        end = first + found
        j = end - end % self.every
        while j > first:
            h = hashes[j - 1]
            with self._lock:
                seen = h in self._seen
            if seen or self.slots.pool.lookup(h) is not None or self._known_or_pending(h):
                return j - first
            try:
                if ask_store and self.store.batch_locate([state_key(h)])[0] is not None:
                    self._remember(self._seen, h)
                    return j - first
            except Exception as exc:  # an unreachable store is a miss
                log.warning("KV store lookup of a state checkpoint failed (%s)", exc)
                return 0
            j -= self.every
        return 0

    def reserve(self, request_id: str, h: BlockHash) -> tuple[bool, int | None]:
        """Hold the checkpoint under `h` for a waiting request until its admission: the one
        in the state pool (True, None), or a slot to read it into (True, slot). (False, None):
        no slot is free (slots for every working request stay free); nothing is held."""
        if self.slots.hold(request_id, h):
            return True, None
        slot = self.slots.reserve_load(request_id)
        if slot is None:
            return False, None
        self.capture()  # the slot handed out may be a checkpoint the store lacks
        return True, slot

    def read(self, h: BlockHash, slot: int) -> bool:
        """Fill `slot` with the checkpoint under `h` (a pending save's bytes, or the store's).
        Any thread; never raises."""
        with self._lock:
            data = self._in_flight.get(h)
        try:
            parts = self.io.read_parts(slot)
            if data is not None:
                _scatter(data, parts)
            elif self.store.get_into_parts(state_key(h), parts) != self.io.slot_bytes:
                return False
            self.io.commit_read(slot)
            return True
        except Exception as exc:  # a failed or mismatched read: no checkpoint
            log.warning("KV store load of a state checkpoint failed (%s)", exc)
            return False

    def land(self, request_id: str, h: BlockHash, ok: bool) -> None:
        """The read into the request's reserved slot finished (`ok`) or failed."""
        if ok:
            self.loaded += 1
        self.slots.land_load(request_id, h if ok else None)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)


def _scatter(data: bytes, parts: list[Any]) -> None:
    view, off = memoryview(data), 0
    for p in parts:
        n = memoryview(p).nbytes
        memoryview(p).cast("B")[:] = view[off : off + n]
        off += n
    if off != len(data):
        raise ValueError(f"a state checkpoint of {len(data)} bytes into {off} bytes of slot")
