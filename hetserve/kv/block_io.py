"""The bytes of KV blocks as multi-part buffers: what the KV tiers need of the engine's KV
tensors (implemented by `engine/kv_store.py`'s `BlockIO`: views of the tensors on CPU, pinned
host buffers on CUDA). A block is `num_parts` byte ranges, one per layer and entry, in the order
a stored object keeps them. Loads and saves run on worker threads; staging runs on the engine
thread, before the next forward overwrites what it copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class BlockIO(Protocol):
    bytes_per_block: int
    num_parts: int
    staging_slots: int  # copies of evicted blocks the staging area holds

    def load_parts(self, block_ids: Sequence[int]) -> list[list[Any]]:
        """Buffers a store read fills, one list per block (on the loader thread)."""
        ...

    def commit_load(self, block_ids: Sequence[int], ok: int) -> None:
        """The first `ok` blocks were read: make them visible in the KV cache."""
        ...

    def save_parts(self, block_ids: Sequence[int], buffers: str = "save") -> list[list[Any]]:
        """Buffers holding the blocks' bytes for a store write (on the saver thread, or the
        hand-off sender's with `buffers="handoff"`: each thread its own staging buffers)."""
        ...

    def write_blocks(self, block_ids: Sequence[int], data: memoryview) -> None:
        """Fill blocks from `len(block_ids)` blocks' bytes back to back, each page-first as
        `save_parts` gives them (a hand-off landing; engine thread)."""
        ...

    def stage(self, block_ids: list[int], slots: list[int]) -> None:
        """Copy blocks into staging slots (engine thread, before they are overwritten)."""
        ...

    def staged_parts(self, slots: list[int]) -> list[list[Any]]:
        """Buffers of staged copies for a store write (on the saver thread)."""
        ...

    def unstage(self, slots: list[int], block_ids: list[int]) -> None:
        """Copy staged blocks back into the KV cache (engine thread)."""
        ...
