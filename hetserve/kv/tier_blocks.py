"""TierBlocks: the device blocks the KV tiers hold references on, and why.

Who calls it: the tiers' load side (`tier_loads.py`) reserves blocks to load a request's
prefix into, registers what landed and holds it until the request is admitted; the save side
(`tier_saves.py`) pins blocks it saves in place; the scheduler lets go of a request's hold
through the tiers' `KVLoader.release`. It registers itself with the `KVCacheManager` as a holder
of references, so the pool's reference counts stay checkable as the sum of the manager's tables
and what is held here.

Three kinds of reference, each released by exactly one event:
- a load table (`loading`): blocks a load in flight writes into; released when it lands
  (`finish`), or handed to the pins if it timed out (`abandon`: the reader may still write);
- a hold (`holds`): blocks a landed load registered in the prefix cache, kept for the request
  until its admission finds them (`release`), so other allocations cannot evict them first;
- a pin (`pinned`, counted): a save reads the block in place; a session's protected block
  gets its protection back when its last pin goes.

Failure contract: asking for more blocks than are free returns None and changes nothing.
Everything else here runs on the engine thread and cannot fail on user input.
"""

from __future__ import annotations

from collections.abc import Iterator

from hetserve.core.request import Request
from hetserve.kv.block_pool import KVBlock
from hetserve.kv.manager import KVCacheManager


class TierBlocks:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.pool = kv.pool
        self.loading: dict[str, list[KVBlock]] = {}  # request -> the blocks its load fills
        self.holds: dict[str, list[KVBlock]] = {}  # request -> loaded blocks kept for it
        self.pinned: dict[int, int] = {}  # block id -> pins
        self._protection: dict[int, float] = {}  # pinned protected block -> its protection
        kv.add_holder(self)

    # ---- loads ---------------------------------------------------------------------------
    def reserve(self, req: Request, computed: list[KVBlock], n: int) -> list[KVBlock] | None:
        """Reserve `n` blocks to load `req`'s blocks after its device hit `computed` into, and
        hold the hit blocks meanwhile (they must still be there when it is admitted); None if
        there is no room. `req.block_hashes` must cover them (the lookup made them)."""
        rid = req.request_id
        reviving = sum(1 for b in computed if b.ref_cnt == 0)
        if n > self.pool.num_free - reviving or rid in self.loading or rid in self.kv.tables:
            return None
        assert len(req.block_hashes) >= len(computed) + n, "the lookup hashes the blocks first"
        self.pool.touch(computed)
        self.holds[rid] = list(computed)
        blocks = self.pool.allocate(n)
        self.loading[rid] = blocks
        return blocks

    def finish(self, req: Request, first_block: int, ok: int) -> None:
        """The first `ok` blocks of `req`'s load landed: register them in the prefix cache,
        where its admission finds them, and hold them for it until then; free the rest."""
        table = self.loading.pop(req.request_id)
        held = self.holds.setdefault(req.request_id, [])
        kept = []
        prompt_blocks = req.num_prompt_tokens // self.kv.block_size
        for i, block in enumerate(table[:ok]):
            # False: a copy of a block cached meanwhile
            if self.kv.cache_block(req, first_block + i, block, prompt_blocks, loaded=True):
                kept.append(block)
        held += kept
        self.pool.free([b for b in reversed(table) if b not in kept])

    def abandon(self, req: Request) -> list[KVBlock]:
        """Take `req`'s load table away from it, pinned (a load that timed out may yet write
        into it): the reader's `unpin` releases it later."""
        table = self.loading.pop(req.request_id)
        for b in table:
            self.pinned[b.block_id] = self.pinned.get(b.block_id, 0) + 1
        return table

    def is_held(self, request_id: str) -> bool:
        return request_id in self.holds

    def release(self, req: Request) -> None:
        """Let go of the loaded blocks held for `req` (admitted: its table holds them now;
        or gone). A no-op where nothing is held."""
        held = self.holds.pop(req.request_id, None)
        if held:
            self.pool.free(list(reversed(held)))

    def release_all(self) -> int:
        n = sum(len(h) for h in self.holds.values())
        for held in self.holds.values():
            self.pool.free(list(reversed(held)))
        self.holds.clear()
        return n

    # ---- saves ---------------------------------------------------------------------------
    def pin(self, blocks: list[KVBlock]) -> None:
        """Hold blocks (a save reads them) so they are not handed out meanwhile; a session's
        protected block gets its protection back when unpinned."""
        for b in blocks:
            until = self.pool.protected_until(b)
            if until is not None:
                self._protection[b.block_id] = until
        self.pool.touch(blocks)
        for b in blocks:
            self.pinned[b.block_id] = self.pinned.get(b.block_id, 0) + 1

    def protection(self, block: KVBlock) -> float | None:
        """Until when a pinned block of a session is protected (None: not a session's)."""
        return self._protection.get(block.block_id)

    def unpin(self, blocks: list[KVBlock]) -> None:
        for b in blocks:
            left = self.pinned[b.block_id] - 1
            if left:
                self.pinned[b.block_id] = left
                continue
            del self.pinned[b.block_id]
            until = self._protection.pop(b.block_id, None)
            self.pool.free([b], evict_first=True, protect_until=until)

    # ---- invariants ----------------------------------------------------------------------
    def held_blocks(self) -> Iterator[KVBlock]:
        """Every reference held here, a block once per reference (the manager's check)."""
        for bid, n in self.pinned.items():
            for _ in range(n):
                yield self.pool.blocks[bid]
        for table in (*self.loading.values(), *self.holds.values()):
            yield from table

    def check_integrity(self, waiting: set[str], loading: set[str]) -> None:
        """Against the scheduler's view: holds only for waiting requests, load tables only for
        requests waiting for their KV."""
        assert set(self.holds) <= waiting | loading, (set(self.holds), waiting, loading)
        assert set(self.loading) <= loading, (set(self.loading), loading)
        assert not set(self.loading) & set(self.kv.tables)
