"""The SSD tier of the local store: one file per object under a directory, LRU by bytes.

Files hold a checksum envelope (see `checksum.py`) so a torn or tampered file reads as a miss.
The index lives in memory: files left by an earlier process are removed at start, because an
object is only trusted when this process wrote it.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from pathlib import Path

from hetserve.store import checksum
from hetserve.store.api import BufferTooSmallError

SUFFIX = ".hskv"


class SsdTier:
    """Not thread-safe: the owning LocalStore serializes calls under its lock."""

    def __init__(self, directory: str, capacity: int) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(f"*{SUFFIX}"):
            stale.unlink(missing_ok=True)
        self.capacity = capacity
        self.used = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> payload bytes, LRU first

    def _path(self, key: str) -> Path:
        # Hashed names: keys may hold characters that are not safe in file names.
        return self.dir / (hashlib.sha1(key.encode()).hexdigest() + SUFFIX)

    def keys(self) -> list[str]:
        return list(self._sizes)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def write(self, key: str, payload: memoryview, value_digest: int) -> list[str]:
        """Store one object, evicting LRU files to fit; returns the keys evicted."""
        self.remove(key)
        evicted = []
        while self._sizes and self.used + len(payload) > self.capacity:
            old, _ = next(iter(self._sizes.items()))
            self.remove(old)
            evicted.append(old)
        tmp = self._path(key).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(checksum.pack_header(len(payload), value_digest))
            f.write(payload)
        os.replace(tmp, self._path(key))  # a reader never sees half a file under the final name
        self._sizes[key] = len(payload)
        self.used += len(payload)
        return evicted

    def size(self, key: str) -> int | None:
        return self._sizes.get(key)

    def read_into(self, key: str, dst: memoryview) -> tuple[int, int] | None:
        """Read the payload into `dst`; (length, digest as stored) or None if the file is bad.
        The caller verifies the digest of what landed in `dst`."""
        n = self._sizes[key]
        if len(dst) < n:
            raise BufferTooSmallError(f"buffer of {len(dst)} bytes < value of {n} bytes")
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                head = checksum.unpack_header(f.read(checksum.HEADER.size))
                if head is None or head[0] != n or f.readinto(dst[:n]) != n:
                    return None
        except OSError:
            return None
        return n, head[1]

    def remove(self, key: str) -> bool:
        n = self._sizes.pop(key, None)
        if n is None:
            return False
        self.used -= n
        self._path(key).unlink(missing_ok=True)
        return True

    def check_integrity(self) -> None:
        assert self.used == sum(self._sizes.values()), self.used
        assert self.used <= self.capacity, (self.used, self.capacity)
        for key in self._sizes:
            assert self._path(key).exists(), key
