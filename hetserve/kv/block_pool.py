"""BlockPool: fixed KV blocks with reference counts and a prefix cache.

A block is free when its ref count is 0. Free blocks wait in LRU order (least recently freed
first); a free block that still holds a cached hash can be revived by a prefix hit until it is
handed out again, at which point its hash is dropped. Block 0 is never handed out: it is the
null block that padding slots may point at.

Protected blocks (a live agent session's, freed with `protect_until`) wait apart and are
handed out only when no other free block is left, until their time passes (the engine's clock,
given with `set_time`; nothing here reads a clock).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from hetserve.core.block_hash import BlockHash


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class Eviction(NamedTuple):
    block_id: int
    block_hash: BlockHash
    protected_until: float | None  # a session's block, evicted before its time ran out


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` when asked for more blocks than are free (callers check first)."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        # Free blocks by id, oldest-freed first: allocation pops from the front.
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._cached: dict[BlockHash, KVBlock] = {}
        # Free protected blocks -> expiry, in expiry order (one TTL, a clock that only grows).
        self._protected: OrderedDict[int, tuple[KVBlock, float]] = OrderedDict()
        self.now = 0.0
        # Told of each cached block the moment it is handed out again: its bytes are still in
        # place until the next forward writes over them (the KV tiers' write-back, KV events).
        self.on_evict: list[Callable[[Eviction], None]] = []
        # Told of each identity `drop_cached` forgets (KV events; no bytes to save: the tiers
        # keep what they saved, and a reset is not an eviction).
        self.on_drop: list[Callable[[BlockHash], None]] = []

    def set_time(self, now: float) -> None:
        """Advance the clock; protected blocks whose time has passed become plain free blocks
        (next in line for eviction: their session has gone quiet)."""
        self.now = now
        self._release(now)

    def _release(self, before: float) -> None:
        while self._protected:
            bid, (b, until) = next(iter(self._protected.items()))
            if until > before:
                break
            del self._protected[bid]
            self._free[bid] = b
            self._free.move_to_end(bid, last=False)

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._protected)

    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks found by a prefix hit (reviving free ones)."""
        for b in blocks:
            if b.ref_cnt == 0:
                if self._free.pop(b.block_id, None) is None:
                    del self._protected[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            until = None
            if self._free:
                _, b = self._free.popitem(last=False)
            else:  # only protected blocks are left: the one whose time ends first goes
                _, (b, until) = self._protected.popitem(last=False)
            if b.block_hash is not None:  # evict its cached identity
                for fn in self.on_evict:
                    fn(Eviction(b.block_id, b.block_hash, until))
                del self._cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def free(
        self, blocks: list[KVBlock], evict_first: bool = False, protect_until: float | None = None
    ) -> None:
        """Drop one reference each. Pass blocks tail-first so the tail of a sequence (least
        likely to be shared) is evicted before its head. `evict_first` puts blocks that become
        free at the evicting end instead (a block pinned only to be saved goes back where it
        was: next in line). `protect_until`: cached blocks that become free are kept from
        eviction until then (while other free blocks exist)."""
        for b in blocks:
            assert b.ref_cnt > 0 and b is not self.null_block, b
            b.ref_cnt -= 1
            if b.ref_cnt != 0:
                continue
            if protect_until is not None and protect_until > self.now and b.block_hash:
                self._protected[b.block_id] = (b, protect_until)
            else:
                self._free[b.block_id] = b
                if evict_first:
                    self._free.move_to_end(b.block_id, last=False)

    def protected_until(self, block: KVBlock) -> float | None:
        """When a free protected block's protection ends (None: not protected)."""
        entry = self._protected.get(block.block_id)
        return entry[1] if entry is not None else None

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def drop_cached(self) -> int:
        """Forget the cached identity of every free block (blocks in use keep theirs). Returns
        how many were dropped."""
        self._release(float("inf"))  # nothing left to protect
        dropped = 0
        for b in self._free.values():
            if b.block_hash is not None:
                del self._cached[b.block_hash]
                for fn in self.on_drop:
                    fn(b.block_hash)
                b.block_hash = None
                dropped += 1
        return dropped

    def check_integrity(self) -> None:
        assert self.null_block.ref_cnt == 1
        assert not set(self._free) & set(self._protected)
        for b in self.blocks[1:]:
            assert b.ref_cnt >= 0, b
            free = b.block_id in self._free or b.block_id in self._protected
            assert (b.ref_cnt == 0) == free, b
        for bid, (b, _) in self._protected.items():
            assert b.block_id == bid and b.block_hash is not None
        for h, b in self._cached.items():
            assert b.block_hash == h, (h, b)
        n_hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert n_hashed == len(self._cached)
