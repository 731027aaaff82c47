"""StateIO: the bytes of one linear-attention state slot, for the KV tiers and the hand-off.

Who calls it: `kv/state_tiers.py` (saves on the engine thread, reads on the loader thread) and
the P/D hand-off. A slot's bytes are its tensors layer by layer, entry by entry
(`StateCache.slot_parts`), fp32, contiguous per tensor. On CPU a read writes straight into the
state cache; on an accelerator it lands in a host buffer per slot, copied in by `commit_read`.
"""

from __future__ import annotations

from typing import Any

import torch

from hetserve.kv.state import StateCache
from hetserve.store.api import as_memoryview


class StateIO:
    def __init__(self, cache: StateCache) -> None:
        self.cache = cache
        self.slot_bytes = sum(t.nbytes for t in cache.slot_parts(0))
        self.on_device = any(t.device.type != "cpu" for t in cache.slot_parts(0))
        self._host: dict[int, list[torch.Tensor]] = {}  # accelerator: a read's landing buffers

    def snapshot(self, slot: int) -> bytes:
        return b"".join(
            bytes(as_memoryview(t.contiguous().cpu())) for t in self.cache.slot_parts(slot)
        )

    def read_parts(self, slot: int) -> list[Any]:
        parts = self.cache.slot_parts(slot)
        if not self.on_device:
            return [as_memoryview(t, writable=True) for t in parts]
        host = [torch.empty(t.shape, dtype=t.dtype) for t in parts]
        self._host[slot] = host
        return [as_memoryview(t, writable=True) for t in host]

    def commit_read(self, slot: int) -> None:
        host = self._host.pop(slot, None)
        if host is not None:
            for dst, src in zip(self.cache.slot_parts(slot), host, strict=True):
                dst.copy_(src)

    def write(self, slot: int, data: memoryview) -> None:
        """Fill a slot from its bytes as `snapshot` gives them (a hand-off landing)."""
        off = 0
        for t in self.cache.slot_parts(slot):
            n = t.nbytes
            src = torch.frombuffer(data[off : off + n], dtype=torch.uint8)
            t.view(-1).view(torch.uint8).copy_(src)
            off += n
