"""KV tiers: the engine's paged KV cache backed by a KV store (host DRAM, SSD, a shared pool).

Who calls it: the scheduler, as its `KVLoader` (`prepare`, `landed`), and the engine
after scheduling (`capture_evicted`: write-back of the cached blocks just handed out, before the
forward overwrites them), once per step (`after_step`: write-through, saves handed to the saver)
and at shutdown (`close`: saves what is not saved yet). It talks to the store through
`store/api.py` only; a block's bytes are handed over by the engine's `BlockIO` (views of the KV
tensors on CPU, pinned host buffers on CUDA). Store calls run on worker threads (lookups and
loads here; saves in `tier_saves.py`), so no step waits on I/O.

One identity: a block is stored under its chained `BlockHash`, whose root seed carries the model,
dtype, KV layout and block size, so incompatible KV can never hit.

Failure contract: a lookup, load or save that raises, a block that vanished or failed its
checksum, a load that outlives `load_timeout_s`: each is a miss or a dropped save, never wrong
KV and never a failed request. A missed block and the ones after it are recomputed. Saves never
stall a step: under pressure the oldest unsaved block is shed (counted).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hetserve.core.request import Request
from hetserve.core.stats import TierStats
from hetserve.kv.block_pool import KVBlock
from hetserve.kv.manager import KVCacheManager
from hetserve.kv.tier_ledger import LoadCounters
from hetserve.kv.tier_policy import CostModel, LoadPlan, TierCost, plan_load, predict_load
from hetserve.kv.tier_saves import Saver
from hetserve.store.api import KVStore

log = logging.getLogger(__name__)

MAX_FOUND = 1 << 14  # lookup results kept for requests not admitted yet
MAX_LOADS = 2  # loads per request (a second when its first one's blocks were taken back)
WAIT, LOADING, NONE = "wait", "loading", "none"  # what prepare() tells the scheduler
STAGED = "staged"  # the victim cache: blocks evicted lately, still in the staging area
# A copy from host memory: a latency of a few microseconds at memcpy speed (this default where
# the probe measured none).
STAGED_COST = TierCost(latency_s=5e-6, bandwidth=8e9)
LOAD_POLL_S = 0.0005  # how often an engine with only loads out looks for them
Job = Callable[[], tuple[Any, ...]]  # runs on a worker, returns (kind, *result); never raises


class BlockIO(Protocol):
    """The bytes of KV blocks as multi-part buffers (engine/block_io.py)."""

    bytes_per_block: int
    num_parts: int

    def load_parts(self, block_ids: Sequence[int]) -> list[list[Any]]:
        """Buffers a store read fills, one list per block (on the loader thread)."""
        ...

    def commit_load(self, block_ids: Sequence[int], ok: int) -> None:
        """The first `ok` blocks were read: make them visible in the KV cache."""
        ...

    def save_parts(self, block_ids: Sequence[int]) -> list[list[Any]]:
        """Buffers holding the blocks' bytes for a store write (on the saver thread)."""
        ...

    staging_slots: int

    def stage(self, block_ids: list[int], slots: list[int]) -> None:
        """Copy blocks into staging slots (engine thread, before they are overwritten)."""
        ...

    def staged_parts(self, slots: list[int]) -> list[list[Any]]:
        """Buffers of staged copies for a store write (on the saver thread)."""
        ...

    def unstage(self, slots: list[int], block_ids: list[int]) -> None:
        """Copy staged blocks back into the KV cache (engine thread)."""
        ...


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
    waited: float = 0.0  # from planning until the engine saw it land


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
    ) -> None:
        self.store, self.cost, self.kv, self.io = store, cost, kv, io
        self.block_size = kv.block_size
        self.write_through = write_through
        self.always_load = always_load
        self.sync_lookup = sync_lookup
        self.load_timeout_s = load_timeout_s
        self.poll_s = self.period_s = poll_s  # period_s: the steps a load now would wait through
        kv.report_cached = True
        # request -> (first block looked up, tiers of the run found); bounded, oldest dropped
        self._found: OrderedDict[str, tuple[int, list[str]]] = OrderedDict()
        self._lookups_out: set[str] = set()
        self._loads: dict[str, _Load] = {}  # by request id, in flight
        self._abandoned: list[_Load] = []
        self._to_submit: list[_Load] = []  # loads planned this step, started after capture
        self.saver = Saver(store, kv, io, max_pending_saves)
        copy = cost.copy_bandwidth
        cost.tiers.setdefault(STAGED, TierCost(5e-6, copy) if copy else STAGED_COST)
        # Tiers loaded right at admission (no engine step in between): the victim cache and a
        # DRAM tier in this process.
        self.inline = {STAGED} | ({"dram"} if sync_lookup else set())
        self.counts = LoadCounters()
        # Results of the workers' jobs, drained on the engine thread.
        self._results: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._load_jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, daemon=True, name="hetserve-kv-load")
        self._thread.start()

    def expect(self, running: Sequence[Request], budget: int) -> None:
        """Before scheduling (the engine calls it): a load started now waits through the steps
        of the requests running now (`budget`: a step's token budget)."""
        todo = [r.num_tokens - r.num_computed_tokens for r in running]
        self.period_s = self.cost.step_period(todo, budget, self.poll_s)

    # ---- the scheduler's KVLoader ---------------------------------------------------------
    def prepare(self, req: Request, computed: list[KVBlock]) -> str:
        """At admission, after a device hit of `computed` blocks: find the following blocks in
        the victim cache (blocks evicted a moment ago, still staged) and then in the store (at
        once for a store in this process, else on the loader thread), and load what is worth
        it. Blocks from the victim cache and an in-process DRAM tier are copied right here
        (NONE: admit it now, they are prefix hits); others load on the loader thread (LOADING).
        WAIT: a lookup is out. Asked again at every admission attempt, so blocks evicted from
        the device since the last attempt are found too."""
        rid = req.request_id
        device_blocks = len(computed)
        if rid in self.kv.load_holds or req.num_loads >= MAX_LOADS:
            return NONE  # its load landed: admit it with what it brought
        n = self.kv.lookup_blocks(req)
        hashes = req.block_hashes[device_blocks:n]
        staged = self.saver.staged_run(hashes)
        rest = device_blocks + len(staged)
        found = self._found.get(rid)
        if rest < n and (found is None or found[0] != rest):  # ask the store beyond them
            if rid in self._lookups_out:
                self._drain()
                found = self._found.get(rid)
            elif not self.sync_lookup:
                self._lookup(req, rest)
                return WAIT
            else:
                self._lookup(req, rest)
                found = self._found.get(rid)
            if found is None or found[0] != rest:
                if not staged:
                    return WAIT
                found = (rest, [])  # load the staged run now; the rest may come next time
        run = [STAGED] * len(staged) + (found[1] if found else [])
        if not run:
            return NONE
        state = self._start_load(req, computed, run, staged)
        if state != NONE or req.request_id in self.kv.load_holds:
            self._found.pop(rid, None)
        return state

    def _lookup(self, req: Request, first: int) -> None:
        n = self.kv.lookup_blocks(req)
        keys = [h.digest for h in req.block_hashes[first:n]]
        if not keys:
            self._found[req.request_id] = (first, [])
            return
        self.counts.lookups += 1
        if self.sync_lookup:
            self._found[req.request_id] = (first, self._locate(keys))
            return
        self._lookups_out.add(req.request_id)
        rid = req.request_id
        self._load_jobs.put(lambda: ("lookup", rid, first, self._locate(keys)))

    def _locate(self, keys: list[bytes]) -> list[str]:
        try:
            tiers = self.store.batch_locate(keys)
        except Exception as exc:  # an unreachable store is a miss
            log.warning("KV store lookup failed (%s); recomputing", exc)
            return []
        run = []
        for t in tiers:
            if t is None:
                break
            run.append(t)
        return run

    def _start_load(
        self, req: Request, computed: list[KVBlock], run: list[str], staged: list[int]
    ) -> str:
        first = len(computed)
        bpb = self.io.bytes_per_block
        plan = plan_load(
            run, bpb, self.block_size, self.cost, self.always_load, self.inline, self.period_s
        )
        self._log_plan(req, first, plan)
        if plan.skipped:
            self.counts.skipped += plan.found_blocks
        if plan.num_blocks == 0:
            return NONE
        k = plan.num_blocks
        from_cache = staged[:k]
        self.saver.hold(from_cache)  # no capture may reuse them while they are read
        try:
            blocks = self.kv.allocate_for_load(req, computed, k)
            if blocks is None:
                self.counts.no_room += 1
                return NONE
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
        if not hashes:  # everything came from the victim cache
            job.ok = len(from_cache)
            self._land(job)
            return NONE
        store_part = job.tiers[job.done :]
        job.predicted = predict_load(store_part, bpb, self.cost, self.inline, self.period_s)
        if set(store_part) <= self.inline:  # an in-process DRAM tier: a copy
            ok, job.seconds = self._read(job)
            job.ok, job.waited = job.done + ok, job.seconds
            self._land(job)
            return NONE
        self._loads[req.request_id] = job
        self._load_jobs.put(functools.partial(self._load_job, job))
        return LOADING

    def _read(self, job: _Load) -> tuple[int, float]:
        """Read the store's part of a load (after the victim cache's `job.done` blocks)."""
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
        return ok, time.perf_counter() - t0

    def landed(self) -> list[Request]:
        self._drain()
        out = []
        now = time.monotonic()
        for rid, job in list(self._loads.items()):
            if job.ok is None and now - job.started > self.load_timeout_s:
                log.warning("KV load of %s timed out; recomputing", rid)
                job.abandoned, job.ok = True, 0
                self._abandoned.append(job)
                self.kv.quarantine(job.req)
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
            self.kv.finish_load(job.req, job.first_block, ok)
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

    # ---- saves ----------------------------------------------------------------------------
    def capture_evicted(self) -> None:
        """Write-back on eviction: stage the cached blocks scheduling just handed out; then
        start the loads scheduling asked for (they may write into those very blocks)."""
        self.saver.capture()
        for job in self._to_submit:
            self._load_jobs.put(functools.partial(self._load_job, job))
        self._to_submit.clear()

    def _load_job(self, job: _Load) -> tuple[Any, ...]:
        return ("load", job, *self._read(job))

    def after_step(self) -> None:
        """Write-through of a shared store's new prompt blocks; give the saver its next batch."""
        self._drain()
        fresh, self.kv.newly_cached = self.kv.newly_cached, []
        if self.write_through:
            self.saver.enqueue([b for b, is_prompt in fresh if is_prompt])
        self.saver.pump()

    # ---- plumbing --------------------------------------------------------------------------
    def _work(self) -> None:
        while (job := self._load_jobs.get()) is not None:
            self._results.put(job())  # jobs catch their own failures: every job reports

    def _drain(self) -> None:
        while True:
            try:
                kind, *rest = self._results.get_nowait()
            except queue.Empty:
                return
            if kind == "lookup":
                rid, first, tiers = rest
                self._lookups_out.discard(rid)
                self._found[rid] = (first, tiers)
                if len(self._found) > MAX_FOUND:  # lookups of requests that went away
                    self._found.popitem(last=False)
            elif kind == "load":
                job, ok, seconds = rest
                if job.abandoned:  # the request went on without it: just release the blocks
                    self._abandoned.remove(job)
                    self.kv.unpin(job.blocks)
                else:
                    job.ok, job.seconds = ok, seconds

    def forget(self, req: Request) -> None:
        """A request ended: drop what its lookup found (its load, if any, lands anyway)."""
        self._found.pop(req.request_id, None)

    def stats(self) -> TierStats:
        return self.counts.stats(self.saver)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Save every free cached device block the store may lack; wait (at most `timeout_s`)
        until no save is left. Returns whether everything was saved in time."""
        return self.saver.flush(timeout_s)

    def make_cold(self) -> None:
        """Make the next reads of what was saved come from the medium (the SSD tier drops its
        page cache), so a benchmark sees what a load after a restart would."""
        for h in self.saver.saved_hashes():
            self.store.make_cold(h.digest)

    def close(self, flush_s: float = 10.0) -> None:
        """Save what the store lacks (bounded by `flush_s`), stop the workers, close it."""
        self.flush(flush_s)
        self.saver.close()
        self._load_jobs.put(None)
        self._thread.join(timeout=5)
        self.store.close()

    def check_integrity(self) -> None:
        assert not self._to_submit, "loads planned but never started"
        self.saver.check_integrity()
        held = [b.block_id for j in self._abandoned for b in j.blocks]
        for bid in held:
            assert self.kv.pinned.get(bid, 0) >= 1, bid
        for rid, job in self._loads.items():
            assert self.kv.tables.get(rid) is job.blocks or job.abandoned, rid
