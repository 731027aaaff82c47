"""KeyTable: 64-bit keys to columns, an open-addressing hash table in numpy, so a whole prompt's
blocks are looked up in a handful of vectorized probes instead of one dict lookup each.

Who calls it: `index.KVIndex`, which keeps it beside its dict of block hashes (a key is 64 bits
folded from a block's sha256 digest). `put` and `remove` run per event, in Python;
`lookup` per request, vectorized. Keys are 64 bits folded from a digest: the index keeps out
of the table any key two of its digests share, so lookups stay exact. Pure: no I/O, no clock.
"""

from __future__ import annotations

import numpy as np

EMPTY, GONE = 0, 1  # reserved key values: a never-used slot, a removed one
# Odd multipliers (splitmix64's): words that repeat inside a digest do not cancel out.
_MIX = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB], np.uint64)


def keys_of(digests: bytes) -> np.ndarray:
    """The keys of concatenated 32-byte digests (one key each): the XOR of each digest's four
        8-byte words, so keys differ wherever digests do (sha256's are random anyway; made-up ones,
        in tests, may share all but a few bytes). A key two digests share is the caller's to handle
    (`index.KVIndex` keeps such digests out of the table)."""
    words = np.frombuffer(digests, dtype="<u8").reshape(-1, 4)
    keys = words[:, 0] * _MIX[0] ^ words[:, 1] * _MIX[1] ^ words[:, 2] * _MIX[2] ^ words[:, 3]
    keys[keys <= GONE] += 2  # the two reserved values cannot be keys
    return keys


class KeyTable:
    def __init__(self, capacity: int = 1 << 12) -> None:
        size = 1
        while size < 2 * capacity:
            size *= 2
        self._keys = np.zeros(size, np.uint64)
        self._cols = np.zeros(size, np.int64)
        self._used = 0  # live keys
        self._gone = 0  # removed ones still occupying a slot

    def _slot(self, key: int) -> int:
        mask = len(self._keys) - 1
        i = key & mask
        first_gone = -1
        while True:
            k = int(self._keys[i])
            if k == key:
                return i
            if k == EMPTY:
                return first_gone if first_gone >= 0 else i
            if k == GONE and first_gone < 0:
                first_gone = i
            i = (i + 1) & mask

    def put(self, key: int, col: int) -> None:
        i = self._slot(key)
        k = int(self._keys[i])
        if k != key:
            if k == GONE:
                self._gone -= 1
            self._used += 1
            self._keys[i] = key
        self._cols[i] = col
        if 2 * (self._used + self._gone) > len(self._keys):  # keep probes short
            self._rebuild(2 * len(self._keys) if self._used > len(self._keys) // 4 else None)

    def remove(self, key: int) -> None:
        i = self._slot(key)
        if int(self._keys[i]) == key:
            self._keys[i], self._cols[i] = GONE, 0
            self._used -= 1
            self._gone += 1

    def _rebuild(self, size: int | None) -> None:
        live = (self._keys > GONE).nonzero()[0]
        keys, cols = self._keys[live].copy(), self._cols[live].copy()
        n = size or len(self._keys)
        self._keys = np.zeros(n, np.uint64)
        self._cols = np.zeros(n, np.int64)
        self._used = self._gone = 0
        for k, c in zip(keys.tolist(), cols.tolist(), strict=True):
            self.put(k, c)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The column of each key (0 where absent): one native call where the kernels build
        (a probe loop in C), else vectorized probes in numpy."""
        out = np.zeros(len(keys), np.int64)
        fn = _native_lookup()
        if fn is not None and len(keys):
            keys = np.ascontiguousarray(keys, np.uint64)
            fn(self._keys.ctypes.data, self._cols.ctypes.data, len(self._keys) - 1,
               keys.ctypes.data, len(keys), out.ctypes.data)  # fmt: skip
            return out
        mask = np.uint64(len(self._keys) - 1)
        pending = np.arange(len(keys))
        slots = (keys & mask).astype(np.intp)
        while pending.size:
            found = self._keys[slots]
            hit = found == keys[pending]
            out[pending[hit]] = self._cols[slots[hit]]
            more = ~hit & (found != EMPTY)
            pending, slots = pending[more], (slots[more] + 1) & int(mask)
        return out

    def lookup_digests(self, digests: bytes, stored: np.ndarray) -> np.ndarray | None:
        """The column of each 32-byte digest in `digests` where `stored[col]` (uint64 [cols, 4])
        is that digest, else 0: keys folded, probed and hits checked in one native call. None
        where the kernels do not build here (the caller folds, probes and checks in numpy)."""
        fn = _native_digest_lookup()
        if fn is None:
            return None
        n = len(digests) // 32
        out = np.zeros(n, np.int64)
        if n:
            words = np.frombuffer(digests, dtype="<u8")
            stored = np.ascontiguousarray(stored, np.uint64)
            fn(self._keys.ctypes.data, self._cols.ctypes.data, len(self._keys) - 1,
               stored.ctypes.data, words.ctypes.data, n, out.ctypes.data)  # fmt: skip
        return out

    def __len__(self) -> int:
        return self._used


def _native_lookup():  # type: ignore[no-untyped-def]
    try:
        from hetserve.native import optional_kernel
    except ImportError:  # a build without torch: numpy's probes
        return None
    return optional_kernel("hetserve_key_lookup")


def _native_digest_lookup():  # type: ignore[no-untyped-def]
    try:
        from hetserve.native import optional_kernel
    except ImportError:
        return None
    return optional_kernel("hetserve_digest_lookup")
