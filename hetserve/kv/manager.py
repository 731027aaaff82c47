"""KVCacheManager: block tables per request on top of the BlockPool, with prefix caching.

Called by the scheduler. `allocate_slots` either reserves everything a step needs or changes
nothing and returns None (the scheduler then preempts or waits). The KV tiers hold references of
their own (`kv/tier_blocks.py`: blocks being loaded into, loaded blocks kept for admission,
blocks pinned for a save) and register as a holder, so `check_integrity` still accounts for
every reference; blocks they load land in the prefix cache, where an admitted request finds
them as ordinary prefix hits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

from hetserve.core.block_hash import hash_block_tokens
from hetserve.core.request import HandoffRole, Request
from hetserve.kv.block_pool import BlockPool, KVBlock
from hetserve.kv.state_slots import StateInput, StateSlots


class BlockHolder(Protocol):
    def held_blocks(self) -> Iterable[KVBlock]:
        """Every reference it holds, a block once per reference."""
        ...


class CachedBlock(NamedTuple):
    """A full block newly registered in the prefix cache, as its listeners are told of it."""

    request: Request
    position: int  # its index in the request's sequence of blocks
    block: KVBlock
    is_prompt: bool  # holds only prompt tokens
    loaded: bool  # its KV came from a KV tier (not computed here)


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
        states: StateSlots | None = None,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        # Models with linear-attention layers: a state slot per running request and the
        # prefix checkpoints (kv/state_slots.py). Admission needs both a slot and the blocks; a
        # prefix hit must end at a checkpoint.
        self.states = states
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.session_ttl_s = session_ttl_s  # how long a session's freed blocks are kept
        self.tables: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of a table already registered
        # Told of each full block the moment it is first registered: what a write-through
        # store saves (the KV tiers) and what KV events announce.
        self.on_cached: list[Callable[[CachedBlock], None]] = []
        self._holders: list[BlockHolder] = []  # others holding references (the KV tiers)
        self.queries = 0  # full prompt blocks looked up at admission (once per request)
        self.hits = 0  # of those, found in the device pool (loaded ones included)
        self.hits_by_tier: dict[str, int] = {}  # the same, by where they came from

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def state_input(self, request_id: str, start: int) -> StateInput:
        """Models with linear-attention layers: the request's state slot, the checkpoint it
        resumes from, the checkpoints its step starting at token `start` takes."""
        assert self.states is not None
        return self.states.inputs(request_id, start, self.block_size)

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
        if self.states is not None:  # the linear layers' state must be found there too
            hits = hits[: self.states.resumable(req.block_hashes, len(hits))]
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
        self,
        req: Request,
        num_new_tokens: int,
        computed: list[KVBlock] | None = None,
        computed_tokens: int | None = None,
    ) -> list[KVBlock] | None:
        """Blocks for `num_new_tokens` more tokens of `req`, after `computed` blocks found for
        it at admission (holding `computed_tokens` tokens: all of their slots unless told, a
        hand-off's last block may be partial)."""
        computed = computed or []
        table = self.tables.get(req.request_id, [])
        if computed_tokens is None:
            computed_tokens = len(computed) * self.block_size
        num_computed = req.num_computed_tokens + computed_tokens
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(table) - len(computed)
        reviving = sum(1 for b in computed if b.ref_cnt == 0)
        if need > self.pool.num_free - reviving:
            return None
        if self.states is not None:
            # (a hand-off's partial last block has no hash: its state comes with it, admit
            # finds it held for the request)
            n = len(computed)
            resume = req.block_hashes[n - 1] if 0 < n <= len(req.block_hashes) else None
            if not self.states.admit(req.request_id, resume):
                return None
        self.pool.touch(computed)
        new = self.pool.allocate(max(need, 0))
        table = self.tables.setdefault(req.request_id, [])
        table.extend(computed)
        table.extend(new)
        # Registered blocks lead the table; a partial block stays to be registered once full.
        registered = sum(1 for b in computed if b.block_hash is not None)
        self._num_cached[req.request_id] = self._num_cached.get(req.request_id, 0) + registered
        if self.states is not None and self.enable_prefix_caching:
            self._update_hashes(req, num_computed + num_new_tokens)
            self.states.plan_saves(
                req.request_id, num_computed, num_new_tokens, req.block_hashes, self.block_size
            )
        h = req.kv_handoff
        if self.states is not None and h is not None and h.role is HandoffRole.SEND:
            # the decode instance continues from the state before the prompt's last token
            at = req.num_prompt_tokens - 1
            self.states.plan_handoff(req.request_id, num_computed, num_new_tokens, at)
        return new

    def cache_computed(self, req: Request) -> None:
        """Register the request's full, computed blocks so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        if self.states is not None:
            self.states.commit(
                req.request_id, req.num_computed_tokens, req.block_hashes, self.block_size
            )
        full = req.num_computed_tokens // self.block_size
        done = self._num_cached.get(req.request_id, 0)
        if full <= done:
            return
        self._update_hashes(req, full * self.block_size)
        table = self.tables[req.request_id]
        prompt_blocks = req.num_prompt_tokens // self.block_size
        for i in range(done, full):
            self.cache_block(req, i, table[i], prompt_blocks)
        self._num_cached[req.request_id] = full

    def cache_block(
        self, req: Request, index: int, block: KVBlock, prompt_blocks: int, loaded: bool = False
    ) -> bool:
        """Register `block` as `req`'s block `index` (full; computed here, or `loaded` from a
        KV tier) and tell the listeners. False where it has an identity already, or another
        block holds this one (first writer wins)."""
        if block.block_hash is not None:
            return False
        self.pool.cache(block, req.block_hashes[index])
        if block.block_hash is None:
            return False
        if self.on_cached:
            cached = CachedBlock(req, index, block, index < prompt_blocks, loaded)
            for fn in self.on_cached:
                fn(cached)
        return True

    def free(self, req: Request) -> None:
        table = self.tables.pop(req.request_id, [])
        self._num_cached.pop(req.request_id, None)
        if self.states is not None:
            self.states.release(req.request_id)
        until = None
        if req.session_id is not None and self.session_ttl_s > 0:
            until = self.pool.now + self.session_ttl_s  # the session's next turn reuses them
        self.pool.free(list(reversed(table)), protect_until=until)  # tail first: evicted first

    def add_holder(self, holder: BlockHolder) -> None:
        """Register another holder of block references, so `check_integrity` counts them."""
        self._holders.append(holder)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        held = [b for h in self._holders for b in h.held_blocks()]
        for b in [*(b for t in self.tables.values() for b in t), *held]:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks[1:]:
            assert b.ref_cnt == refs.get(b.block_id, 0), (b, refs.get(b.block_id))
        for rid, n in self._num_cached.items():
            assert n <= len(self.tables[rid])
        if self.states is not None:
            self.states.check_integrity(self.tables)
