"""KVCacheManager: block tables per request on top of the BlockPool, with prefix caching.

Called by the scheduler (and by the KV tiers for the blocks they pin and load). `allocate_slots`
either reserves everything a step needs or changes nothing and returns None (the scheduler then
preempts or waits). Blocks a tier loads from a store are held in the request's table while the
load runs, then registered in the prefix cache (`finish_load`), so an admitted request finds
them as ordinary prefix hits.
"""

from __future__ import annotations

from hetserve.core.block_hash import hash_block_tokens
from hetserve.core.request import Request
from hetserve.kv.block_pool import BlockPool, KVBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_seed: bytes = b"",
        session_ttl_s: float = 0.0,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.session_ttl_s = session_ttl_s  # how long a session's freed blocks are kept
        self.tables: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of a table already registered
        # Full blocks registered since the tiers last looked (block, whether it holds only
        # prompt tokens): what a write-through store saves. Kept only when report_cached.
        self.report_cached = False
        self.newly_cached: list[tuple[KVBlock, bool]] = []
        self.pinned: dict[int, int] = {}  # block id -> references held by the KV tiers
        self._protection: dict[int, float] = {}  # pinned protected block -> its protection
        self.load_holds: dict[str, list[KVBlock]] = {}  # loaded blocks kept for admission
        self.queries = 0  # full prompt blocks looked up at admission (once per request)
        self.hits = 0  # of those, found in the device pool (loaded ones included)
        self.hits_by_tier: dict[str, int] = {}  # the same, by where they came from

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        tokens = req.all_token_ids
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= num_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(
                hash_block_tokens(
                    parent, tokens[i * bs : (i + 1) * bs], req.cache_extra, self.hash_seed
                )
            )

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of `req` in full blocks. The last token is always recomputed
        (its logits are needed), and prompt logprobs need every position, so no hit then."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return [], 0
        max_tokens = req.num_tokens - 1
        self._update_hashes(req, max_tokens)
        hits: list[KVBlock] = []
        for h in req.block_hashes[: max_tokens // self.block_size]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def lookup_blocks(self, req: Request) -> int:
        """How many full blocks a prefix lookup of `req` covers (its hashes are made)."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return 0
        self._update_hashes(req, req.num_tokens - 1)
        return (req.num_tokens - 1) // self.block_size

    def record_admission(self, req: Request, hit_blocks: int) -> None:
        """Count one admitted request's lookup (once per request, whatever it waited for),
        and where its hit blocks came from: the device pool, or a KV tier that loaded them."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return
        self.queries += (req.num_tokens - 1) // self.block_size
        self.hits += hit_blocks
        left = hit_blocks
        for tier, tokens in req.loaded_tokens.items():  # loaded blocks come after device hits
            n = min(tokens // self.block_size, left)
            self.hits_by_tier[tier] = self.hits_by_tier.get(tier, 0) + n
            left -= n
        self.hits_by_tier["device"] = self.hits_by_tier.get("device", 0) + left

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        computed = computed or []
        table = self.tables.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(table) - len(computed)
        reviving = sum(1 for b in computed if b.ref_cnt == 0)
        if need > self.pool.num_free - reviving:
            return None
        self.pool.touch(computed)
        new = self.pool.allocate(max(need, 0))
        table = self.tables.setdefault(req.request_id, [])
        table.extend(computed)
        table.extend(new)
        self._num_cached.setdefault(req.request_id, 0)
        self._num_cached[req.request_id] += len(computed)
        return new

    def cache_computed(self, req: Request) -> None:
        """Register the request's full, computed blocks so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        done = self._num_cached.get(req.request_id, 0)
        if full <= done:
            return
        self._update_hashes(req, full * self.block_size)
        table = self.tables[req.request_id]
        prompt_blocks = req.num_prompt_tokens // self.block_size
        for i in range(done, full):
            if table[i].block_hash is None:
                self.pool.cache(table[i], req.block_hashes[i])
                if self.report_cached and table[i].block_hash is not None:  # the first writer
                    self.newly_cached.append((table[i], i < prompt_blocks))
        self._num_cached[req.request_id] = full

    # ---- blocks the KV tiers hold --------------------------------------------------------------
    def allocate_for_load(
        self, req: Request, computed: list[KVBlock], n: int
    ) -> list[KVBlock] | None:
        """Reserve `n` blocks to load `req`'s blocks after its device hit `computed` into, and
        hold the hit blocks meanwhile (they must still be there when it is admitted); None if
        there is no room."""
        reviving = sum(1 for b in computed if b.ref_cnt == 0)
        if n > self.pool.num_free - reviving or req.request_id in self.tables:
            return None
        self._update_hashes(req, (len(computed) + n) * self.block_size)
        self.pool.touch(computed)
        self.load_holds[req.request_id] = list(computed)
        blocks = self.pool.allocate(n)
        self.tables[req.request_id] = blocks
        return blocks

    def finish_load(self, req: Request, first_block: int, ok: int) -> None:
        """The first `ok` blocks of the load landed: register them in the prefix cache, where
        the request's admission finds them, and keep holding them for it until then (other
        requests' allocations would evict them first); release the rest of the load table."""
        table = self.tables.pop(req.request_id)
        held = self.load_holds.setdefault(req.request_id, [])
        kept = []
        for i, block in enumerate(table[:ok]):
            self.pool.cache(block, req.block_hashes[first_block + i])
            if block.block_hash is not None:  # not a copy of a block cached meanwhile
                kept.append(block)
        held += kept
        self.pool.free([b for b in reversed(table) if b not in kept])

    def release_hold(self, req: Request) -> None:
        """Let go of the loaded blocks held for `req` (admitted: its table holds them now)."""
        held = self.load_holds.pop(req.request_id, None)
        if held:
            self.pool.free(list(reversed(held)))

    def release_holds(self) -> int:
        """Let go of every hold (nothing runs and the head of the queue cannot start: holds
        must not deadlock the pool). Returns the blocks released."""
        n = sum(len(h) for h in self.load_holds.values())
        for rid in list(self.load_holds):
            held = self.load_holds.pop(rid)
            self.pool.free(list(reversed(held)))
        return n

    def quarantine(self, req: Request) -> list[KVBlock]:
        """Take `req`'s load table away from it, still held (a load that timed out may yet
        write into it): released later with `unpin`."""
        table = self.tables.pop(req.request_id)
        for b in table:
            self.pinned[b.block_id] = self.pinned.get(b.block_id, 0) + 1
        return table

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

    def free(self, req: Request) -> None:
        self.release_hold(req)
        table = self.tables.pop(req.request_id, [])
        self._num_cached.pop(req.request_id, None)
        until = None
        if req.session_id is not None and self.session_ttl_s > 0:
            until = self.pool.now + self.session_ttl_s  # the session's next turn reuses them
        self.pool.free(list(reversed(table)), protect_until=until)  # tail first: evicted first

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = dict(self.pinned)
        for table in [*self.tables.values(), *self.load_holds.values()]:
            for b in table:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks[1:]:
            assert b.ref_cnt == refs.get(b.block_id, 0), (b, refs.get(b.block_id))
        for rid, n in self._num_cached.items():
            assert n <= len(self.tables[rid])
