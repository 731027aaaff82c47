"""`local://?dram=1G&ssd_dir=/path&ssd=4G&max_value=1G&prefault=1`: an in-process store.

DRAM is one arena mapped and populated at open (`prefault=1`, the default): on these machines a
first touch of fresh memory runs at ~1 GB/s, twenty times slower than a copy into touched memory,
so a put must never land on untouched pages. Objects take extents of the arena in LRU order; the
least recently used spill to the SSD tier (when `ssd_dir` is given) and are otherwise dropped. A
hit on SSD reads straight into the caller's buffer and promotes the object back to DRAM. Not
shared between processes.
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict
from typing import NamedTuple

from hetserve.store import checksum
from hetserve.store.allocator import ExtentAllocator, aligned
from hetserve.store.api import (
    DEFAULT_MAX_VALUE,
    Buffer,
    BufferTooSmallError,
    Key,
    KVStore,
    ReplicateConfig,
    StoreCapacityError,
    ValueTooLargeError,
    as_memoryview,
    normalize_key,
)
from hetserve.store.backends.ssd import SsdTier
from hetserve.store.registry import StoreSpec, register_backend


class Entry(NamedTuple):
    offset: int
    size: int
    digest: int


@register_backend("local")
class LocalStore(KVStore):
    def __init__(self, spec: StoreSpec) -> None:
        self.dram_capacity = spec.size("dram", 1 << 30)
        ssd_dir = spec.params.get("ssd_dir")
        self.ssd = SsdTier(ssd_dir, spec.size("ssd", 4 << 30)) if ssd_dir else None
        self.max_value = spec.size("max_value", DEFAULT_MAX_VALUE)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if spec.params.get("prefault", "1") != "0":
            flags |= mmap.MAP_POPULATE
        self._map = mmap.mmap(-1, max(self.dram_capacity, 1), flags=flags)
        self._arena = memoryview(self._map)
        self._alloc = ExtentAllocator(0, self.dram_capacity)
        self._dram: OrderedDict[str, Entry] = OrderedDict()  # LRU first
        # One lock over index and copies: a reader never races the reuse of an extent.
        self._lock = threading.Lock()

    @property
    def dram_used(self) -> int:
        return self._alloc.used

    # -- writes ---------------------------------------------------------------------------
    def put_from(self, key: Key, buffer: Buffer, config: ReplicateConfig | None = None) -> None:
        key = normalize_key(key)
        src = as_memoryview(buffer)
        n = len(src)
        if n > self.max_value:
            raise ValueTooLargeError(f"value of {n} bytes exceeds max_value={self.max_value}")
        room = max(self.dram_capacity, self.ssd.capacity if self.ssd else 0)
        if n > room:
            raise StoreCapacityError(f"value of {n} bytes exceeds the store's capacity {room}")
        with self._lock:
            self._remove_locked(key)
            if n > self.dram_capacity:  # only the SSD tier can hold it
                self.ssd.write(key, src, checksum.digest(src))
                return
            off = self._make_room_locked(n)
            dst = self._arena[off : off + n]
            self._dram[key] = Entry(off, n, checksum.copy_and_digest(dst, src))

    def _make_room_locked(self, n: int) -> int:
        """An extent of n bytes, spilling LRU objects to SSD (or dropping them) until one fits."""
        while (off := self._alloc.alloc(n)) is None:
            old, e = self._dram.popitem(last=False)  # the arena holds n, so this cannot run dry
            if self.ssd is not None and e.size <= self.ssd.capacity:
                self.ssd.write(old, self._arena[e.offset : e.offset + e.size], e.digest)
            self._alloc.free(e.offset, e.size)
        return off

    # -- reads ----------------------------------------------------------------------------
    def get_into(self, key: Key, buffer: Buffer) -> int | None:
        key = normalize_key(key)
        dst = as_memoryview(buffer, writable=True)
        with self._lock:
            e = self._dram.get(key)
            if e is None:
                if self.ssd is not None and key in self.ssd:
                    return self._get_from_ssd_locked(key, dst)
                return None
            if len(dst) < e.size:
                raise BufferTooSmallError(f"buffer of {len(dst)} bytes < value of {e.size}")
            self._dram.move_to_end(key)
            src = self._arena[e.offset : e.offset + e.size]
            if checksum.copy_and_digest(dst, src) != e.digest:
                self._remove_locked(key)  # damaged: a miss now and later
                return None
            return e.size

    def _get_from_ssd_locked(self, key: str, dst: memoryview) -> int | None:
        got = self.ssd.read_into(key, dst)
        if got is None or checksum.digest(dst[: got[0]]) != got[1]:
            self.ssd.remove(key)  # damaged: report a miss, and never again serve it
            return None
        n, value_digest = got
        if n <= self.dram_capacity:  # promote: the next hit is a DRAM hit
            self.ssd.remove(key)
            off = self._make_room_locked(n)
            self._arena[off : off + n] = dst[:n]
            self._dram[key] = Entry(off, n, value_digest)
        return n

    def get(self, key: Key) -> bytes | None:
        key = normalize_key(key)
        while True:
            with self._lock:
                size = self._size_locked(key)
            if size is None:
                return None
            out = bytearray(size)
            try:
                n = self.get_into(key, out)
            except BufferTooSmallError:  # replaced by a larger value meanwhile
                continue
            return None if n is None else bytes(out[:n])

    def _size_locked(self, key: str) -> int | None:
        e = self._dram.get(key)
        if e is not None:
            return e.size
        return self.ssd.size(key) if self.ssd is not None else None

    def exists(self, key: Key) -> bool:
        key = normalize_key(key)
        with self._lock:
            return self._size_locked(key) is not None

    # -- removal and invariants -----------------------------------------------------------
    def remove(self, key: Key) -> bool:
        key = normalize_key(key)
        with self._lock:
            return self._remove_locked(key)

    def _remove_locked(self, key: str) -> bool:
        e = self._dram.pop(key, None)
        if e is not None:
            self._alloc.free(e.offset, e.size)
        on_ssd = self.ssd.remove(key) if self.ssd is not None else False
        return e is not None or on_ssd

    def close(self) -> None:
        with self._lock:
            self._dram.clear()
            self._alloc = ExtentAllocator(0, self.dram_capacity)
            if self.ssd is not None:
                for key in self.ssd.keys():
                    self.ssd.remove(key)
            self._arena.release()
            self._map.close()

    def check_integrity(self) -> None:
        with self._lock:
            self._alloc.check_integrity()
            spans = sorted((e.offset, e.size) for e in self._dram.values())
            assert sum(aligned(n) for _, n in spans) == self._alloc.used
            for (a, n), (b, _) in zip(spans, spans[1:], strict=False):
                assert a + n <= b, "two objects overlap in the arena"
            if self.ssd is not None:
                self.ssd.check_integrity()
                assert not (set(self._dram) & set(self.ssd.keys())), "object in both tiers"
