"""`local://?dram=1G&ssd_dir=/path&ssd=4G&max_value=1G&prefault=1`: an in-process store.

DRAM is one arena mapped and populated at open (`prefault=1`, the default): on these machines a
first touch of fresh memory runs at ~1 GB/s, twenty times slower than a copy into touched memory,
so a put must never land on untouched pages. Objects take extents of the arena in LRU order; the
least recently used spill to the SSD tier (when `ssd_dir` is given) and are otherwise dropped. A
hit on SSD reads straight into the caller's buffers (one preadv) and promotes the object back to
DRAM. A put with `ReplicateConfig(preferred_segment="ssd")` goes straight to the SSD tier. Not
shared between processes.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from hetserve.errors import InvalidInputError
from hetserve.store import checksum
from hetserve.store.allocator import ExtentAllocator, aligned
from hetserve.store.api import (
    DEFAULT_MAX_VALUE,
    TIER_DRAM,
    TIER_SSD,
    BufferTooSmallError,
    Key,
    KVStore,
    Parts,
    PlacementListener,
    ReplicateConfig,
    StoreCapacityError,
    TierInfo,
    ValueTooLargeError,
    fit_parts,
    normalize_key,
    prefix_tiers,
)
from hetserve.store.backends.ssd import SsdTier
from hetserve.store.host_memory import check_reservation
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
            check_reservation(self.dram_capacity, "the local KV store's DRAM",
                              "dram= in the store spec (--kv-store local://?dram=SIZE)")
        try:
            self._map = mmap.mmap(-1, max(self.dram_capacity, 1), flags=flags)
        except OSError as exc:  # the kernel refused the reservation outright
            raise InvalidInputError(
                f"the local KV store's dram={self.dram_capacity} bytes cannot be reserved "
                f"({exc.strerror}); give a smaller dram="
            ) from None
        self._arena = memoryview(self._map)
        self._alloc = ExtentAllocator(0, self.dram_capacity)
        self._dram: OrderedDict[str, Entry] = OrderedDict()  # LRU first
        self._pins: dict[str, float] = {}  # soft-pinned DRAM objects -> until (monotonic)
        # One lock over index and copies: a reader never races the reuse of an extent.
        self._lock = threading.Lock()
        self._watchers: list[PlacementListener] = []

    @property
    def dram_used(self) -> int:
        return self._alloc.used

    # -- writes ---------------------------------------------------------------------------
    def _put(self, names: list[str], values: list[Parts], config: ReplicateConfig) -> None:
        tier = self._tier_of(config)
        until = None
        if config.soft_pin:
            ttl = config.soft_pin_ttl_s
            until = float("inf") if ttl is None else time.monotonic() + ttl
        for key, parts in zip(names, values, strict=True):
            self._put_one(key, parts, tier)
            if until is not None and key in self._dram:
                with self._lock:
                    self._pins[key] = until

    def _tier_of(self, config: ReplicateConfig) -> str | None:
        """`preferred_segment` names a tier here: "ssd" writes straight to the SSD tier."""
        tier = config.preferred_segment
        if tier is None or tier == TIER_DRAM or (tier == TIER_SSD and self.ssd is not None):
            return tier
        have = "dram, ssd" if self.ssd is not None else "dram (no ssd_dir configured)"
        raise InvalidInputError(f"local store has no tier {tier!r}; it has {have}")

    def _put_one(self, key: str, parts: Parts, tier: str | None) -> None:
        n = sum(p.nbytes for p in parts)
        if n > self.max_value:
            raise ValueTooLargeError(f"value of {n} bytes exceeds max_value={self.max_value}")
        room = max(self.dram_capacity, self.ssd.capacity if self.ssd else 0)
        if n > room:
            raise StoreCapacityError(f"value of {n} bytes exceeds the store's capacity {room}")
        with self._lock:
            was = self._tier_locked(key)
            self._remove_locked(key)
            if tier == TIER_SSD or n > self.dram_capacity:  # the SSD tier may be all that fits
                if self.ssd is None or n > self.ssd.capacity:
                    self._moved(key, was, None)
                    raise StoreCapacityError(f"value of {n} bytes exceeds the SSD tier")
                self._ssd_write_locked(key, parts, checksum.digest_parts(parts))
                self._moved(key, was, TIER_SSD)
                return
            off = self._make_room_locked(n)
            dst = self._arena[off : off + n]
            self._dram[key] = Entry(off, n, checksum.copy_and_digest_parts([dst], parts))
            self._moved(key, was, TIER_DRAM)

    def _moved(self, key: str, old: str | None, new: str | None) -> None:
        if old != new:
            for fn in self._watchers:
                fn(key, old, new)

    def _ssd_write_locked(self, key: str, parts: Parts, digest: int) -> None:
        assert self.ssd is not None
        for gone in self.ssd.write(key, parts, digest):
            self._moved(gone, TIER_SSD, None)

    def _make_room_locked(self, n: int) -> int:
        """An extent of n bytes, spilling LRU objects to SSD (or dropping them) until one fits."""
        while (off := self._alloc.alloc(n)) is None:
            old = self._victim_locked()
            e = self._dram.pop(old)  # the arena holds n, so this cannot run dry
            self._pins.pop(old, None)
            if self.ssd is not None and e.size <= self.ssd.capacity:
                self._ssd_write_locked(old, [self._arena[e.offset : e.offset + e.size]], e.digest)
                self._moved(old, TIER_DRAM, TIER_SSD)
            else:
                self._moved(old, TIER_DRAM, None)
            self._alloc.free(e.offset, e.size)
        return off

    # -- reads ----------------------------------------------------------------------------
    def _get_into(self, names: list[str], dests: list[Parts], exact: bool) -> list[int | None]:
        return [self._get_one(k, d, exact) for k, d in zip(names, dests, strict=True)]

    def _get_one(self, key: str, dest: Parts, exact: bool) -> int | None:
        with self._lock:
            e = self._dram.get(key)
            if e is None:
                size = self.ssd.size(key) if self.ssd is not None else None
                if size is None:
                    return None
                return self._get_from_ssd_locked(key, fit_parts(dest, size, exact, key))
            parts = fit_parts(dest, e.size, exact, key)
            self._dram.move_to_end(key)
            src = self._arena[e.offset : e.offset + e.size]
            if checksum.copy_and_digest_parts(parts, [src]) != e.digest:
                self._remove_locked(key)  # damaged: a miss now and later
                self._moved(key, TIER_DRAM, None)
                return None
            return e.size

    def _get_from_ssd_locked(self, key: str, parts: Parts) -> int | None:
        assert self.ssd is not None
        got = self.ssd.read_into(key, parts)
        if got is None or checksum.digest_parts(parts) != got[1]:
            self.ssd.remove(key)  # damaged: report a miss, and never again serve it
            self._moved(key, TIER_SSD, None)
            return None
        n, value_digest = got
        if n <= self.dram_capacity:  # promote: the next hit is a DRAM hit
            self.ssd.remove(key)
            off = self._make_room_locked(n)
            checksum.copy_and_digest_parts([self._arena[off : off + n]], parts)
            self._dram[key] = Entry(off, n, value_digest)
            self._moved(key, TIER_SSD, TIER_DRAM)
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

    def batch_locate(self, keys: Sequence[Key]) -> list[str | None]:
        names = [normalize_key(k) for k in keys]
        with self._lock:
            return prefix_tiers([self._tier_locked(k) for k in names])

    def _tier_locked(self, key: str) -> str | None:
        if key in self._dram:
            return TIER_DRAM
        return TIER_SSD if self.ssd is not None and key in self.ssd else None

    def tiers(self) -> list[TierInfo]:
        with self._lock:
            out = [TierInfo(TIER_DRAM, self.dram_capacity, self._alloc.used, False, placeable=True)]
            if self.ssd is not None:
                out.append(
                    TierInfo(TIER_SSD, self.ssd.capacity, self.ssd.used, False, placeable=True)
                )
            return out

    def make_cold(self, key: Key) -> None:
        key = normalize_key(key)
        with self._lock:
            if self.ssd is not None and key in self.ssd:
                self.ssd.drop_cache(key)

    # -- removal and invariants -----------------------------------------------------------
    def remove(self, key: Key) -> bool:
        key = normalize_key(key)
        with self._lock:
            was = self._tier_locked(key)
            self._moved(key, was, None)
            return self._remove_locked(key)

    def watch(self, listener: PlacementListener) -> bool:
        with self._lock:
            self._watchers.append(listener)
        return True

    def _victim_locked(self) -> str:
        """The LRU object that is not soft-pinned (pins that have run out count as none); when
        everything is pinned, the LRU one (the pins are soft)."""
        now = time.monotonic()
        for _ in range(len(self._pins) + 1):
            key = next(iter(self._dram))
            until = self._pins.get(key)
            if until is None or until <= now:
                return key
            self._dram.move_to_end(key)  # skipped once per round: evictions stay O(1) amortized
        return next(iter(self._dram))

    def _remove_locked(self, key: str) -> bool:
        self._pins.pop(key, None)
        e = self._dram.pop(key, None)
        if e is not None:
            self._alloc.free(e.offset, e.size)
        on_ssd = self.ssd.remove(key) if self.ssd is not None else False
        return e is not None or on_ssd

    def close(self) -> None:
        with self._lock:
            self._dram.clear()
            self._pins.clear()
            self._alloc = ExtentAllocator(0, self.dram_capacity)
            if self.ssd is not None:
                for key in self.ssd.keys():
                    self.ssd.remove(key)
            self._arena.release()
            self._map.close()

    def check_integrity(self) -> None:
        with self._lock:
            self._alloc.check_integrity()
            assert set(self._pins) <= set(self._dram), "a pin on an object not in DRAM"
            spans = sorted((e.offset, e.size) for e in self._dram.values())
            assert sum(aligned(n) for _, n in spans) == self._alloc.used
            for (a, n), (b, _) in zip(spans, spans[1:], strict=False):
                assert a + n <= b, "two objects overlap in the arena"
            if self.ssd is not None:
                self.ssd.check_integrity()
                assert not (set(self._dram) & set(self.ssd.keys())), "object in both tiers"
