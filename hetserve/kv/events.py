"""KVEventRecorder: what the engine's KV cache and its tiers hold, recorded as KV events.

Who calls it: the engine attaches one to its KV cache manager (`attach_cache`) and, with a KV
store, to its tiers (`attach_tiers`) when KV events are on; from then on the pool, the manager,
the saver and the store call its listeners (the store from its own threads), and the publisher
(`disagg/kv_publisher.py`) takes what was recorded (`take`) to number and send it. Pure: no I/O,
no clock; one lock, because the store's listeners run on the tiers' worker threads.

What is recorded, per medium (`core/kv_events.py`):
- GPU, the device pool: a block registered in the prefix cache, computed or loaded from a tier,
  is stored with its parent's hash, its tokens and its LoRA; a cached block handed out again
  (evicted) or forgotten (`drop_cached`) is removed. Consecutive blocks of one request go out
  as one `BlockStored`.
- CPU and DISK, a local store's DRAM and SSD tiers, which say where each object goes
  (`KVStore.watch`): saved, spilled from DRAM to SSD, promoted back, evicted, removed.
- POOL, a shared store (pool, Mooncake, Redis): a block this engine saved there is stored.
  Such a store places and evicts objects in other processes and cannot tell us, so its
  removals are not recorded: a subscriber's view of it only grows (the index bounds it).
A tier's event carries hashes and medium only, one block each (no tokens and no parent: the
tiers never see them), as vLLM's own CPU-offloading events do.

Failure contract: listeners never raise into the pool, the manager or the store; a store object
whose name is not a block digest (a probe) is ignored.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hetserve.core.block_hash import BlockHash
from hetserve.core.kv_events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from hetserve.kv.block_pool import Eviction
from hetserve.kv.manager import CachedBlock, KVCacheManager
from hetserve.store.api import TIER_DRAM, TIER_SSD, KVStore

# A local store's own tiers; every other tier name is a store the instances share.
_LOCAL_MEDIA = {TIER_DRAM: MEDIUM_CPU, TIER_SSD: MEDIUM_DISK}
_DIGEST_HEX = 64  # a sha256 digest's name in a store (keys are stored under their hex form)


def medium_of_tier(tier: str) -> str:
    """The medium of a store tier (`store/api.py`'s TIER_* names)."""
    return _LOCAL_MEDIA.get(tier, MEDIUM_POOL)


class KVEventRecorder:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._lock = threading.Lock()
        self._events: list[KVEvent] = []

    # ---- wiring ----------------------------------------------------------------------------
    def attach_cache(self, kv: KVCacheManager) -> None:
        kv.on_cached.append(self._on_cached)
        kv.pool.on_evict.append(self._on_evict)
        kv.pool.on_drop.append(self._on_removed)

    def attach_tiers(
        self, store: KVStore, on_saved: list[Callable[[list[BlockHash]], None]]
    ) -> str:
        """Listen to the store where it says where objects go, else to the saves (`on_saved`:
        the saver's listeners). Returns how the tiers are followed, for a start-up line."""
        if store.watch(self._on_placed):
            return "placements"
        tiers = store.tiers()
        medium = medium_of_tier(tiers[0].name) if tiers else MEDIUM_POOL
        on_saved.append(lambda hashes: self._on_saved(hashes, medium))
        return f"saves to {medium} (its removals are not visible here)"

    def cleared(self) -> None:
        """Record that the instance holds nothing (at start and at shutdown)."""
        with self._lock:
            self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        with self._lock:
            out, self._events = self._events, []
        return out

    # ---- the device pool -------------------------------------------------------------------
    def _on_cached(self, cached: CachedBlock) -> None:
        req, i, bs = cached.request, cached.position, self.block_size
        h = cached.block.block_hash
        assert h is not None  # told only once registered
        parent = req.block_hashes[i - 1].digest if i else None
        start, end, prompt = i * bs, (i + 1) * bs, req.prompt_token_ids
        if end <= len(prompt):
            tokens = prompt[start:end]
        else:  # a block that holds generated tokens (no copy of the whole sequence)
            n = len(prompt)
            tokens = prompt[start:n] + req.output_token_ids[max(start - n, 0) : end - n]
        with self._lock:
            last = self._events[-1] if self._events else None
            if (
                isinstance(last, BlockStored)
                and last.medium == MEDIUM_GPU
                and last.lora_name == req.lora_id
                and last.block_hashes[-1] == parent
            ):  # the next block of the same run
                last.block_hashes.append(h.digest)
                last.token_ids += tokens
                return
            event = BlockStored([h.digest], parent, tokens, bs, None, MEDIUM_GPU, req.lora_id)
            self._events.append(event)

    def _on_evict(self, eviction: Eviction) -> None:
        self._on_removed(eviction.block_hash)

    def _on_removed(self, h: BlockHash, medium: str = MEDIUM_GPU) -> None:
        with self._lock:
            self._remove_locked(h.digest, medium)

    def _remove_locked(self, digest: bytes, medium: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(digest)
        else:
            self._events.append(BlockRemoved([digest], medium))

    # ---- the tiers -------------------------------------------------------------------------
    def _stored_locked(self, digest: bytes, medium: str) -> None:
        self._events.append(BlockStored([digest], None, [], self.block_size, None, medium, None))

    def _on_saved(self, hashes: list[BlockHash], medium: str) -> None:
        with self._lock:
            for h in hashes:
                self._stored_locked(h.digest, medium)

    def _on_placed(self, name: str, old: str | None, new: str | None) -> None:
        if len(name) != _DIGEST_HEX:
            return
        try:
            digest = bytes.fromhex(name)
        except ValueError:
            return
        with self._lock:
            if old is not None:
                self._remove_locked(digest, medium_of_tier(old))
            if new is not None:
                self._stored_locked(digest, medium_of_tier(new))
