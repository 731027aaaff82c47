"""`local://?dram=1G&ssd_dir=/path&ssd=4G&max_value=1G`: an in-process store.

DRAM holds the hot objects in LRU order under a byte capacity; the least recently used spill to
the SSD tier (when `ssd_dir` is given) and are otherwise dropped. A hit on SSD reads straight into
the caller's buffer and promotes the object back to DRAM. Not shared between processes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from hetserve.store import checksum
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


@register_backend("local")
class LocalStore(KVStore):
    def __init__(self, spec: StoreSpec) -> None:
        self.dram_capacity = spec.size("dram", 1 << 30)
        ssd_dir = spec.params.get("ssd_dir")
        self.ssd = SsdTier(ssd_dir, spec.size("ssd", 4 << 30)) if ssd_dir else None
        self.max_value = spec.size("max_value", DEFAULT_MAX_VALUE)
        self.dram_used = 0
        # key -> (payload, digest); payloads are never mutated after insertion, so readers may
        # copy from a reference taken under the lock after releasing it.
        self._dram: OrderedDict[str, tuple[np.ndarray, int]] = OrderedDict()
        self._lock = threading.Lock()

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
        payload = np.empty(n, dtype=np.uint8)
        value_digest = checksum.copy_and_digest(memoryview(payload), src)
        with self._lock:
            self._remove_locked(key)
            if n > self.dram_capacity:  # only the SSD tier can hold it
                self.ssd.write(key, memoryview(payload), value_digest)
                return
            self._insert_dram_locked(key, payload, value_digest)

    def _insert_dram_locked(self, key: str, payload: np.ndarray, value_digest: int) -> None:
        self._dram[key] = (payload, value_digest)
        self.dram_used += len(payload)
        while self.dram_used > self.dram_capacity:
            old, (old_payload, old_digest) = self._dram.popitem(last=False)
            self.dram_used -= len(old_payload)
            if self.ssd is not None and len(old_payload) <= self.ssd.capacity:
                self.ssd.write(old, memoryview(old_payload), old_digest)

    # -- reads ----------------------------------------------------------------------------
    def get_into(self, key: Key, buffer: Buffer) -> int | None:
        key = normalize_key(key)
        dst = as_memoryview(buffer, writable=True)
        with self._lock:
            entry = self._dram.get(key)
            if entry is not None:
                self._dram.move_to_end(key)
            elif self.ssd is not None and key in self.ssd:
                return self._get_from_ssd_locked(key, dst)
            else:
                return None
        payload, value_digest = entry
        if len(dst) < len(payload):
            raise BufferTooSmallError(f"buffer of {len(dst)} bytes < value of {len(payload)}")
        if checksum.copy_and_digest(dst, memoryview(payload)) != value_digest:
            self._drop_if_same(key, entry)
            return None
        return len(payload)

    def _get_from_ssd_locked(self, key: str, dst: memoryview) -> int | None:
        got = self.ssd.read_into(key, dst)
        if got is None or checksum.digest(dst[: got[0]]) != got[1]:
            self.ssd.remove(key)  # damaged: report a miss, and never again serve it
            return None
        n, value_digest = got
        if n <= self.dram_capacity:  # promote: the next hit is a DRAM hit
            self.ssd.remove(key)
            payload = np.empty(n, dtype=np.uint8)
            payload[:] = np.frombuffer(dst[:n], dtype=np.uint8)
            self._insert_dram_locked(key, payload, value_digest)
        return n

    def get(self, key: Key) -> bytes | None:
        key = normalize_key(key)
        with self._lock:
            size = self._size_locked(key)
        if size is None:
            return None
        out = bytearray(size)
        n = self.get_into(key, out)
        if n is None:
            return None
        if n != size:  # replaced between the size lookup and the read
            return self.get(key)
        return bytes(out)

    def _size_locked(self, key: str) -> int | None:
        entry = self._dram.get(key)
        if entry is not None:
            return len(entry[0])
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
        entry = self._dram.pop(key, None)
        if entry is not None:
            self.dram_used -= len(entry[0])
        on_ssd = self.ssd.remove(key) if self.ssd is not None else False
        return entry is not None or on_ssd

    def _drop_if_same(self, key: str, entry: tuple[np.ndarray, int]) -> None:
        with self._lock:
            if self._dram.get(key) is entry:
                self._remove_locked(key)

    def close(self) -> None:
        with self._lock:
            for key in list(self._dram):
                self._remove_locked(key)
            if self.ssd is not None:
                for key in self.ssd.keys():
                    self.ssd.remove(key)

    def check_integrity(self) -> None:
        with self._lock:
            assert self.dram_used == sum(len(p) for p, _ in self._dram.values())
            assert self.dram_used <= self.dram_capacity, (self.dram_used, self.dram_capacity)
            if self.ssd is not None:
                self.ssd.check_integrity()
                assert not (set(self._dram) & set(self.ssd.keys())), "object in both tiers"
