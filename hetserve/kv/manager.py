"""KVCacheManager: block tables per request on top of the BlockPool, with prefix caching.

Called by the scheduler only. `allocate_slots` either reserves everything a step needs or
changes nothing and returns None (the scheduler then preempts or waits).
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
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.tables: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of a table already registered

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
        self.pool.queries += max_tokens // self.block_size
        self.pool.hits += len(hits)
        return hits, len(hits) * self.block_size

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
        for i in range(done, full):
            self.pool.cache(table[i], req.block_hashes[i])
        self._num_cached[req.request_id] = full

    def free(self, req: Request) -> None:
        table = self.tables.pop(req.request_id, [])
        self._num_cached.pop(req.request_id, None)
        self.pool.free(list(reversed(table)))  # tail first: evicted first

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for table in self.tables.values():
            for b in table:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks[1:]:
            assert b.ref_cnt == refs.get(b.block_id, 0), (b, refs.get(b.block_id))
        for rid, n in self._num_cached.items():
            assert n <= len(self.tables[rid])
