"""KV tiers: the engine's paged KV cache backed by a KV store (host DRAM, SSD, a shared pool).

Who calls it: the scheduler, as its `KVLoader` (`prepare`, `landed`, `release`, `release_all`);
the engine before scheduling (`expect`: what a load started now would wait through), after
scheduling (`capture_evicted`: write-back of the cached blocks just handed out, before the
forward overwrites them), once per step (`after_step`: write-through, saves handed to the
saver) and at shutdown (`close`: saves what is not saved yet). It composes small parts that own
their state: `TierBlocks` (the device blocks the tiers hold), `Loads` (lookups and loads,
`tier_loads.py`), `Saver` (saves and the victim cache, `tier_saves.py`) and `LoadCounters`
(`tier_ledger.py`). It talks to the store through `store/api.py` only; a block's bytes are
handed over by the engine's `BlockIO` (`block_io.py`). Store calls run on worker threads, so no
step waits on I/O.

One identity: a block is stored under its chained `BlockHash`, whose root seed carries the model,
dtype, KV layout and block size, so incompatible KV can never hit.

Failure contract: a lookup, load or save that raises, a block that vanished or failed its
checksum, a load that outlives `load_timeout_s`: each is a miss or a dropped save, never wrong
KV and never a failed request. A missed block and the ones after it are recomputed. Saves never
stall a step: under pressure the oldest unsaved block is shed (counted).
"""

from __future__ import annotations

from collections.abc import Sequence

from hetserve.core.request import Request
from hetserve.core.stats import TierStats
from hetserve.kv.block_io import BlockIO
from hetserve.kv.block_pool import KVBlock
from hetserve.kv.loader import LoadState
from hetserve.kv.manager import CachedBlock, KVCacheManager
from hetserve.kv.state_tiers import StateIO, StateTiers, state_key
from hetserve.kv.tier_blocks import TierBlocks
from hetserve.kv.tier_ledger import LoadCounters
from hetserve.kv.tier_loads import STAGED, Loads
from hetserve.kv.tier_policy import CostModel, TierCost
from hetserve.kv.tier_saves import Saver
from hetserve.store.api import KVStore

# A copy from host memory: a latency of a few microseconds at memcpy speed (this default where
# the probe measured none).
STAGED_COST = TierCost(latency_s=5e-6, bandwidth=8e9)
LOAD_POLL_S = 0.0005  # how often an engine with only loads out looks for them


class TierManager:
    def __init__(
        self,
        store: KVStore,
        cost: CostModel,
        kv: KVCacheManager,
        io: BlockIO,
        *,
        write_through: bool,
        always_load: bool = False,
        sync_lookup: bool = False,
        max_pending_saves: int = 256,
        load_timeout_s: float = 10.0,
        poll_s: float = LOAD_POLL_S,
        state_io: StateIO | None = None,
    ) -> None:
        self.store, self.cost = store, cost
        self.write_through = write_through
        self.poll_s = poll_s
        copy = cost.copy_bandwidth
        cost.tiers.setdefault(STAGED, TierCost(5e-6, copy) if copy else STAGED_COST)
        self.blocks = TierBlocks(kv)
        self.saver = Saver(store, self.blocks, io, max_pending_saves)
        self.counts = LoadCounters()
        # A linear-attention model's state checkpoints travel beside its blocks.
        self.states: StateTiers | None = None
        if kv.states is not None and state_io is not None:
            self.states = StateTiers(store, kv.states, state_io, write_through=write_through)
        self.loads = Loads(
            store, cost, kv, self.blocks, io, self.saver, self.counts,
            always_load=always_load, sync_lookup=sync_lookup, load_timeout_s=load_timeout_s,
            period_s=poll_s, states=self.states,
        )  # fmt: skip
        self._fresh: list[tuple[KVBlock, bool]] = []  # blocks cached since the last step
        kv.on_cached.append(self._on_cached)

    def _on_cached(self, cached: CachedBlock) -> None:
        if not cached.loaded:  # a loaded block is in the store already
            self._fresh.append((cached.block, cached.is_prompt))

    def expect(self, running: Sequence[Request], budget: int) -> None:
        """Before scheduling (the engine calls it): a load started now waits through the steps
        of the requests running now (`budget`: a step's token budget)."""
        todo = [r.num_tokens - r.num_computed_tokens for r in running]
        self.loads.period_s = self.cost.step_period(todo, budget, self.poll_s)

    # ---- the scheduler's KVLoader ---------------------------------------------------------
    def prepare(self, req: Request, computed: list[KVBlock]) -> LoadState:
        return self.loads.prepare(req, computed)

    def landed(self) -> list[Request]:
        return self.loads.landed()

    def release(self, req: Request) -> None:
        self.blocks.release(req)
        if self.states is not None:
            self.states.slots.release_load(req.request_id)

    def release_all(self) -> int:
        n = self.blocks.release_all()
        return n + (self.states.slots.release_all_loads() if self.states is not None else 0)

    def ready_prefix(self, req: Request) -> tuple[list[KVBlock], int] | None:
        return None  # loaded blocks are device prefix hits: the scheduler looks them up

    # ---- saves ----------------------------------------------------------------------------
    def capture_evicted(self) -> None:
        """Write-back on eviction: stage the cached blocks (and state checkpoints) scheduling
        just handed out."""
        self.saver.capture()
        if self.states is not None:
            self.states.capture()

    def after_step(self) -> None:
        """Write-through of a shared store's new prompt blocks; give the saver its next batch."""
        self.loads.drain()
        fresh, self._fresh = self._fresh, []
        if self.write_through:
            self.saver.enqueue([b for b, is_prompt in fresh if is_prompt])
        self.saver.pump()
        if self.states is not None:
            self.states.after_step()

    # ---- the rest of its life ---------------------------------------------------------------
    def forget(self, req: Request) -> None:
        """A request ended: drop what its lookup found (its load, if any, lands anyway)."""
        self.loads.forget(req)

    def stats(self) -> TierStats:
        return self.counts.stats(self.saver)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Save every free cached device block the store may lack; wait (at most `timeout_s`)
        until no save is left (state checkpoints too). Returns whether everything was saved in
        time."""
        ok = self.saver.flush(timeout_s)
        return (self.states.flush(timeout_s) if self.states is not None else True) and ok

    def make_cold(self) -> None:
        """Make the next reads of what was saved come from the medium (the SSD tier drops its
        page cache), so a benchmark sees what a load after a restart would."""
        for h in self.saver.saved_hashes():
            self.store.make_cold(h.digest)
        if self.states is not None:
            for h in self.states.saved_hashes():
                self.store.make_cold(state_key(h))

    def close(self, flush_s: float = 10.0) -> None:
        """Save what the store lacks (bounded by `flush_s`), stop the workers, close it."""
        self.flush(flush_s)
        self.saver.close()
        if self.states is not None:
            self.states.close()
        self.loads.close()
        self.store.close()

    def check_integrity(self, waiting: set[str], loading: set[str]) -> None:
        """`waiting` and `loading`: the scheduler's request ids in those states."""
        self.saver.check_integrity()
        self.loads.check_integrity()
        self.blocks.check_integrity(waiting, loading)
        if self.states is not None:
            held = set(self.states.slots.loads)
            assert held <= waiting | loading, (held, waiting, loading)
