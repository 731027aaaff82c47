"""The load side of the KV tiers: find a waiting request's next blocks in the victim cache and
the store, decide what is worth loading (`tier_policy.plan_load`), and load it.

Who calls it: `TierManager` (kv/tiers.py), for the scheduler's `KVLoader.prepare` and `landed`,
on the engine thread. Lookups and loads of a store in another process run on one loader thread
(jobs in, results out, drained on the engine thread), so no step waits on I/O; the victim
cache and a DRAM tier in this process are copied at admission.

Failure contract: a lookup or read that raises, a block that vanished or failed its checksum, a
load that outlives `load_timeout_s`: each is a miss (counted), never wrong KV and never a failed
request; the missed block and the ones after it are recomputed, and the request is not asked
about again.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from hetserve.core.block_hash import BlockHash
from hetserve.core.request import Request
from hetserve.kv.block_io import BlockIO
from hetserve.kv.block_pool import KVBlock
from hetserve.kv.loader import LoadState
from hetserve.kv.manager import KVCacheManager
from hetserve.kv.state_tiers import StateTiers
from hetserve.kv.tier_blocks import TierBlocks
from hetserve.kv.tier_ledger import LoadCounters
from hetserve.kv.tier_policy import CostModel, LoadPlan, plan_load, predict_load
from hetserve.kv.tier_saves import Saver
from hetserve.store.api import KVStore

log = logging.getLogger(__name__)

MAX_FOUND = 1 << 14  # lookup results kept for requests not admitted yet
MAX_LOADS = 2  # loads per request (a second when its first one's blocks were taken back)
STAGED = "staged"  # the victim cache: blocks evicted lately, still in the staging area


@dataclass(eq=False)
class _Load:
    req: Request
    first_block: int
    blocks: list[KVBlock]
    keys: list[bytes]
    tiers: list[str]
    started: float
    done: int = 0  # blocks copied from the victim cache before the store's part
    ok: int | None = None  # blocks read, once the worker is done
    seconds: float = 0.0
    abandoned: bool = False  # timed out: the request went on, the blocks wait for the worker
    predicted: tuple[float, float] | None = None  # the store part's (read, wait) at planning
    state_slot: int | None = None  # a linear-attention checkpoint read with the blocks
    state_ok: bool = False
    waited: float = 0.0  # from planning until the engine saw it land


@dataclass(frozen=True)
class _Found:
    """A lookup's result: the tiers of the run of blocks found from block `first` on (cut
    where a linear-attention model's state checkpoint allows)."""

    request_id: str
    first: int
    tiers: list[str]


@dataclass(frozen=True)
class _Read:
    """A load's result: `ok` leading blocks read (and its state checkpoint), in `seconds`."""

    job: _Load
    ok: int
    seconds: float
    state_ok: bool = False


Job = Callable[[], "_Found | _Read"]  # runs on the loader thread; never raises


class Loads:
    def __init__(
        self,
        store: KVStore,
        cost: CostModel,
        kv: KVCacheManager,
        blocks: TierBlocks,
        io: BlockIO,
        saver: Saver,
        counts: LoadCounters,
        *,
        always_load: bool,
        sync_lookup: bool,
        load_timeout_s: float,
        period_s: float,
        states: StateTiers | None = None,
    ) -> None:
        self.states = states  # a linear-attention model's checkpoints, loaded with its blocks
        self.store, self.cost, self.kv, self.blocks, self.io = store, cost, kv, blocks, io
        self.saver, self.counts = saver, counts
        self.block_size = kv.block_size
        self.always_load = always_load
        self.sync_lookup = sync_lookup
        self.load_timeout_s = load_timeout_s
        self.period_s = period_s  # the steps a load started now would wait through
        # Tiers loaded right at admission (no engine step in between): the victim cache and a
        # DRAM tier in this process.
        self.inline = {STAGED} | ({"dram"} if sync_lookup else set())
        # request -> (first block looked up, tiers of the run found); bounded, oldest dropped
        self._found: OrderedDict[str, tuple[int, list[str]]] = OrderedDict()
        self._lookups_out: set[str] = set()
        self._loads: dict[str, _Load] = {}  # by request id, in flight
        self._abandoned: list[_Load] = []
        self._results: queue.SimpleQueue[_Found | _Read] = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, daemon=True, name="hetserve-kv-load")
        self._thread.start()

    def prepare(self, req: Request, computed: list[KVBlock]) -> LoadState:
        """At admission, after a device hit of `computed` blocks: find the following blocks in
        the victim cache (blocks evicted a moment ago, still staged) and then in the store (at
        once for a store in this process, else on the loader thread), and load what is worth
        it. Blocks from the victim cache and an in-process DRAM tier are copied right here
        (READY: admit it now, they are prefix hits); others load on the loader thread
        (LOADING). WAIT: a lookup is out; NONE: nothing to load. Asked again at every
        admission attempt, so blocks evicted from the device since the last one are found too."""
        rid = req.request_id
        device_blocks = len(computed)
        if self.blocks.is_held(rid) or req.num_loads >= MAX_LOADS:
            return LoadState.NONE  # its load landed: admit it with what it brought
        n = self.kv.lookup_blocks(req)
        hashes = req.block_hashes[device_blocks:n]
        staged = self.saver.staged_run(hashes)
        rest = device_blocks + len(staged)
        found = self._found.get(rid)
        if rest < n and (found is None or found[0] != rest):  # ask the store beyond them
            if rid in self._lookups_out:
                self.drain()
                found = self._found.get(rid)
            elif not self.sync_lookup:
                self._lookup(req, rest, device_blocks)
                return LoadState.WAIT
            else:
                self._lookup(req, rest, device_blocks)
                found = self._found.get(rid)
            if found is None or found[0] != rest:
                if not staged:
                    return LoadState.WAIT
                found = (rest, [])  # load the staged run now; the rest may come next time
        run = [STAGED] * len(staged) + (found[1] if found else [])
        if self.states is not None:  # usable up to a checkpoint (the lookup asked the store)
            usable = self.states.locate(req.block_hashes, device_blocks, len(run), self.sync_lookup)
            run = run[:usable]
        if not run:
            return LoadState.NONE
        state = self._start_load(req, computed, run, staged)
        if state is not LoadState.NONE:
            self._found.pop(rid, None)
        return state

    def _lookup(self, req: Request, first: int, base: int) -> None:
        """Look blocks from `first` up in the store (after `base` device blocks and the staged
        ones between)."""
        n = self.kv.lookup_blocks(req)
        hashes = list(req.block_hashes[:n])
        if first >= n:
            self._found[req.request_id] = (first, [])
            return
        self.counts.lookups += 1
        if self.sync_lookup:
            self._found[req.request_id] = (first, self._locate(hashes, first, base))
            return
        self._lookups_out.add(req.request_id)
        rid = req.request_id
        self._jobs.put(lambda: _Found(rid, first, self._locate(hashes, first, base)))

    def _locate(self, hashes: list[BlockHash], first: int, base: int) -> list[str]:
        try:
            tiers = self.store.batch_locate([h.digest for h in hashes[first:]])
        except Exception as exc:  # an unreachable store is a miss
            log.warning("KV store lookup failed (%s); recomputing", exc)
            return []
        run = []
        for t in tiers:
            if t is None:
                break
            run.append(t)
        if self.states is not None:  # a prefix is usable up to a checkpoint kept with it
            usable = self.states.locate(hashes, base, first - base + len(run))
            run = run[: max(0, usable - (first - base))]
        return run

    def _start_load(
        self, req: Request, computed: list[KVBlock], run: list[str], staged: list[int]
    ) -> LoadState:
        first = len(computed)
        bpb = self.io.bytes_per_block
        plan = plan_load(
            run, bpb, self.block_size, self.cost, self.always_load, self.inline, self.period_s
        )
        self._log_plan(req, first, plan)
        if plan.skipped:
            self.counts.skipped += plan.found_blocks
        if plan.num_blocks == 0:
            return LoadState.NONE
        k = plan.num_blocks
        state: tuple[bool, int | None] | None = None
        if self.states is not None:  # cut where a checkpoint is, and hold or reserve it
            k, state = self._hold_state(req, first, k)
            if state is None:
                return LoadState.NONE
        from_cache = staged[:k]
        self.saver.hold(from_cache)  # no capture may reuse them while they are read
        try:
            blocks = self.blocks.reserve(req, computed, k)
            if blocks is None:
                self.counts.no_room += 1
                if self.states is not None:
                    self.states.slots.release_load(req.request_id)
                return LoadState.NONE
            # The blocks just reserved may be evicted cached blocks: stage their old bytes
            # before anything is written into them.
            self.saver.capture()
            ids = [b.block_id for b in blocks]
            self.io.unstage(from_cache, ids[: len(from_cache)])
        finally:
            self.saver.release(from_cache)
        req.num_loads += 1
        hashes = req.block_hashes[first + len(from_cache) : first + k]
        job = _Load(req, first, blocks, [h.digest for h in hashes], run[:k], time.monotonic())
        job.done = len(from_cache)
        if state is not None:
            job.state_slot = state[1]
            job.state_ok = job.state_slot is None  # held in the state pool: nothing to read
        if not hashes:  # everything came from the victim cache
            job.ok = len(from_cache)
            self._read_state(job, job.ok)
            self._land(job)
            return LoadState.READY
        store_part = job.tiers[job.done :]
        job.predicted = predict_load(store_part, bpb, self.cost, self.inline, self.period_s)
        if set(store_part) <= self.inline:  # an in-process DRAM tier: a copy
            ok, job.seconds, job.state_ok = self._read(job)
            job.ok, job.waited = job.done + ok, job.seconds
            self._land(job)
            return LoadState.READY
        self._loads[req.request_id] = job
        self._jobs.put(functools.partial(self._load_job, job))
        return LoadState.LOADING

    def _hold_state(
        self, req: Request, first: int, k: int
    ) -> tuple[int, tuple[bool, int | None] | None]:
        """A hybrid model's load of `k` blocks after `first`: cut to end at a checkpoint and
        hold it (or a slot to read it into); None where no checkpoint or no slot is there."""
        assert self.states is not None
        k = self.states.locate(req.block_hashes, first, k, False)
        if k == 0:
            return 0, None
        state = self.states.reserve(req.request_id, req.block_hashes[first + k - 1])
        if not state[0]:
            self.counts.no_room += 1
            return k, None
        return k, state

    def _read_state(self, job: _Load, ok: int) -> bool:
        """Read the load's state checkpoint where all its blocks came (`ok`); any thread."""
        if job.state_slot is not None and self.states is not None and ok == len(job.blocks):
            h = job.req.block_hashes[job.first_block + ok - 1]
            job.state_ok = self.states.read(h, job.state_slot)
        return job.state_ok

    def _read(self, job: _Load) -> tuple[int, float, bool]:
        """Read the store's part of a load (after the victim cache's `job.done` blocks), then
        its state checkpoint."""
        ids = [b.block_id for b in job.blocks[job.done :]]
        t0 = time.perf_counter()
        try:
            sizes = self.store.batch_get_into_parts(job.keys, self.io.load_parts(ids))
            ok = 0
            for size in sizes:
                if size != self.io.bytes_per_block:
                    break
                ok += 1
            self.io.commit_load(ids, ok)
        except Exception as exc:  # the store failed mid-read: nothing is trusted
            log.warning("KV store load failed (%s); recomputing", exc)
            ok = 0
        state_ok = self._read_state(job, job.done + ok)
        return ok, time.perf_counter() - t0, state_ok

    def landed(self) -> list[Request]:
        self.drain()
        out = []
        now = time.monotonic()
        for rid, job in list(self._loads.items()):
            if job.ok is None and now - job.started > self.load_timeout_s:
                log.warning("KV load of %s timed out; recomputing", rid)
                job.abandoned, job.ok = True, 0
                self._abandoned.append(job)
                self.blocks.abandon(job.req)
                if self.states is not None:  # the reader may yet write its state slot
                    self.states.slots.abandon_load(rid, job.state_slot)
            if job.ok is None:
                continue
            job.waited = now - job.started
            del self._loads[rid]
            if not job.abandoned:
                job.ok += job.done  # the victim cache's blocks came first
            self._land(job)
            out.append(job.req)
        return out

    def _land(self, job: _Load) -> None:
        c = self.counts
        ok = job.ok or 0
        c.loads += 1
        c.missed += len(job.blocks) - ok
        if ok < len(job.blocks):  # the store let it down: recompute, do not ask again
            job.req.num_loads = MAX_LOADS
        if not job.abandoned:
            self.blocks.finish(job.req, job.first_block, ok)
            if self.states is not None and job.state_slot is not None:
                end = job.req.block_hashes[job.first_block + len(job.blocks) - 1]
                self.states.land(job.req.request_id, end, job.state_ok and ok == len(job.blocks))
        for tier in job.tiers[:ok]:
            c.loaded[tier] = c.loaded.get(tier, 0) + 1
            loaded = job.req.loaded_tokens
            loaded[tier] = loaded.get(tier, 0) + self.block_size
        c.load_bytes += ok * self.io.bytes_per_block
        c.load_seconds += job.seconds
        store_part = set(job.tiers[job.done :])
        if ok == len(job.blocks) and len(store_part) == 1 and job.predicted is not None:
            c.record_fit(store_part.pop(), job.predicted, (job.seconds, job.waited))
        if ok and len(set(job.tiers[:ok])) == 1:
            self.cost.observe_load(job.tiers[0], ok * self.io.bytes_per_block, job.seconds)

    def _log_plan(self, req: Request, first_block: int, plan: LoadPlan) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "kv tiers: %s after %d device blocks found %d: %s %d (load %.2f ms vs recompute "
                "%.2f ms at %s tok/s; %s)",
                req.request_id, first_block, plan.found_blocks, plan.reason, plan.num_blocks,
                plan.load_s * 1e3, plan.recompute_s * 1e3, self.cost.prefill_tokens_per_s,
                {t: (c.latency_s, c.bandwidth) for t, c in self.cost.tiers.items()},
            )  # fmt: skip

    def _load_job(self, job: _Load) -> _Read:
        return _Read(job, *self._read(job))

    # ---- the loader thread and what it reports -------------------------------------------
    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._results.put(job())  # jobs catch their own failures: every job reports

    def drain(self) -> None:
        """Take in what the loader thread reported (engine thread)."""
        while True:
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                return
            match result:
                case _Found(rid, first, tiers):
                    self._lookups_out.discard(rid)
                    self._found[rid] = (first, tiers)
                    if len(self._found) > MAX_FOUND:  # lookups of requests that went away
                        self._found.popitem(last=False)
                case _Read(job, ok, seconds, state_ok):
                    if job.abandoned:  # the request went on without it: release the blocks
                        self._abandoned.remove(job)
                        self.blocks.unpin(job.blocks)
                        if self.states is not None:
                            self.states.slots.end_abandoned(job.state_slot)
                    else:
                        job.ok, job.seconds, job.state_ok = ok, seconds, state_ok

    def forget(self, req: Request) -> None:
        """A request ended: drop what its lookup found (its load, if any, lands anyway)."""
        self._found.pop(req.request_id, None)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def check_integrity(self) -> None:
        for job in self._abandoned:
            for b in job.blocks:
                assert self.blocks.pinned.get(b.block_id, 0) >= 1, b
        for rid, job in self._loads.items():
            assert self.blocks.loading.get(rid) is job.blocks or job.abandoned, rid
