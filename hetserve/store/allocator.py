"""First-fit extent allocator over one arena: a pool node's segment (the master does the
bookkeeping, the bytes live on the node) or the local store's DRAM arena. Free extents are kept
sorted and coalesced, so fragmentation stays bounded by the mix of live sizes."""

from __future__ import annotations

import bisect

ALIGN = 64  # cache-line aligned starts: copies into and out of segments stay fast


def aligned(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


class ExtentAllocator:
    def __init__(self, start: int, capacity: int) -> None:
        self.start, self.capacity = start, capacity
        self._free_starts = [start]  # sorted; parallel to _free_lens
        self._free_lens = [capacity]
        self.used = 0

    def alloc(self, n: int) -> int | None:
        """Offset of a fresh extent of aligned(n) bytes, or None when no free extent fits."""
        n = aligned(n)
        for i, length in enumerate(self._free_lens):
            if length >= n:
                off = self._free_starts[i]
                if length == n:
                    del self._free_starts[i], self._free_lens[i]
                else:
                    self._free_starts[i] += n
                    self._free_lens[i] -= n
                self.used += n
                return off
        return None

    def free(self, off: int, n: int) -> None:
        n = aligned(n)
        i = bisect.bisect_left(self._free_starts, off)
        assert i == len(self._free_starts) or self._free_starts[i] >= off + n, "double free"
        assert i == 0 or self._free_starts[i - 1] + self._free_lens[i - 1] <= off, "double free"
        self._free_starts.insert(i, off)
        self._free_lens.insert(i, n)
        self.used -= n
        # Coalesce with the right, then the left neighbour.
        if i + 1 < len(self._free_starts) and off + n == self._free_starts[i + 1]:
            self._free_lens[i] += self._free_lens.pop(i + 1)
            self._free_starts.pop(i + 1)
        if i > 0 and self._free_starts[i - 1] + self._free_lens[i - 1] == off:
            self._free_lens[i - 1] += self._free_lens.pop(i)
            self._free_starts.pop(i)

    def largest_free(self) -> int:
        return max(self._free_lens, default=0)

    def check_integrity(self) -> None:
        assert self.used + sum(self._free_lens) == self.capacity, (self.used, self.capacity)
        end = self.start
        for s, n in zip(self._free_starts, self._free_lens, strict=True):
            assert s >= end and n > 0, "free extents overlap or are not sorted"
            end = s + n
        assert end <= self.start + self.capacity
