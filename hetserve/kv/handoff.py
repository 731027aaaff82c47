"""The engine's side of a prefill -> decode hand-off: what leaves a prefill instance and how it
lands in a decode instance's KV cache.

Who calls it: `EngineCore` on the engine thread. On a prefill instance, once a request that
sends (`KVHandoff.role` SEND) has computed its prompt, `HandoffSender.send` takes references on
its blocks (so they outlive the request) and a worker thread ships the KV of every prompt token
but the last (`handoff_paths.py`); `pump` lets go of what was shipped. On a decode instance the
scheduler reaches `HandoffReceiver` through its `KVLoader` (`loader.py`): a receiving request
WAITs until its hand-off arrived, then lands: blocks it lacks are allocated, filled from
staging, the full ones registered in the prefix cache, and it is admitted with the prompt but
its last token computed (`ready_prefix`): it computes that token and samples, as a colocated
engine would, so outputs match. A linear-attention model's state after those tokens travels
after the blocks (`Manifest.state_bytes`): the prefill forward takes it into a slot of its own
(`StateSlots.plan_handoff`), the receiver writes it into a slot held for the request, from which
its admission resumes.

Failure contract: a hand-off that does not arrive within `timeout_s`, or whose manifest does
not match the request (another prompt, model, dtype, layout or block size), is a miss: the
request is computed here like any other (its prefix may still come from the KV tiers). A send
that fails is logged and counted; the receiver's timeout covers it. Neither fails a request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hetserve.core.block_hash import BlockHash
from hetserve.core.request import HandoffPath, KVHandoff, Request
from hetserve.core.stats import HandoffStats
from hetserve.kv.block_io import BlockIO
from hetserve.kv.block_pool import KVBlock
from hetserve.kv.handoff_direct import DirectPath
from hetserve.kv.handoff_mooncake import MooncakePath
from hetserve.kv.handoff_paths import Arrival, Arrivals, Manifest, StorePath, StoreReceiver
from hetserve.kv.loader import LoadState
from hetserve.kv.manager import KVCacheManager, cdiv
from hetserve.kv.state_tiers import StateIO

log = logging.getLogger(__name__)


@dataclass
class _PathCounts:
    count: int = 0
    failed: int = 0
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(eq=False)
class _Job:
    spec: KVHandoff
    manifest: Manifest
    blocks: list[KVBlock]
    known: list[bool]  # per full block: the store has it already (write-through)
    ok: bool = False
    seconds: float = 0.0
    counts: dict[str, _PathCounts] = field(default_factory=dict)
    request_id: str = ""
    state_slot: int | None = None  # a linear-attention state shipped after the blocks


class HandoffSender:
    def __init__(
        self,
        kv: KVCacheManager,
        io: BlockIO,
        store: StorePath | None,
        direct: DirectPath | None,
        known: Callable[[BlockHash], bool] | None = None,
        mooncake: MooncakePath | None = None,
        state_io: StateIO | None = None,
    ) -> None:
        self.kv, self.pool, self.io, self.state_io = kv, kv.pool, io, state_io
        self.store, self.direct, self.mooncake = store, direct, mooncake
        self._known = known  # callable(BlockHash) -> bool: the tiers' "already saved" memory
        self._out: list[_Job] = []
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.counts: dict[str, _PathCounts] = {}
        self._thread = threading.Thread(target=self._work, daemon=True, name="hetserve-send")
        self._thread.start()
        kv.add_holder(self)

    def send(self, req: Request) -> None:
        """`req` (a SEND hand-off) has computed its whole prompt: ship the KV of all of it but
        its last token. Call before the request's blocks are freed."""
        spec = req.kv_handoff
        assert spec is not None
        bs = self.kv.block_size
        tokens = req.num_prompt_tokens - 1
        table = self.kv.tables[req.request_id][: cdiv(tokens, bs)]
        self.kv.lookup_blocks(req)  # the full blocks' hashes
        full = tokens // bs
        digests = [h.digest for h in req.block_hashes[:full]]
        states = self.kv.states
        slot = None if states is None else states.take_handoff(req.request_id)
        state_bytes = 0 if slot is None or self.state_io is None else self.state_io.slot_bytes
        manifest = Manifest(
            spec.key, self.kv.hash_seed.hex(), bs, self.io.bytes_per_block, tokens,
            [d.hex() for d in digests], state_bytes,
        )  # fmt: skip
        saved = self._known
        known = [saved is not None and saved(h) for h in req.block_hashes[:full]]
        self.pool.touch(table)  # they outlive the request until shipped
        job = _Job(spec, manifest, table, known, request_id=req.request_id, state_slot=slot)
        self._out.append(job)
        self._jobs.put(job)

    def pump(self) -> None:
        """Let go of the blocks of hand-offs that were shipped (or failed)."""
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                return
            self._out.remove(job)
            self.pool.free(list(reversed(job.blocks)))
            if job.state_slot is not None and self.kv.states is not None:
                self.kv.states.shipped(job.request_id)
            c = self.counts.setdefault(job.spec.path.value, _PathCounts())
            c.count += 1
            if job.ok:
                c.nbytes += job.manifest.nbytes
                c.seconds += job.seconds
            else:
                c.failed += 1

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            t0 = time.perf_counter()
            try:
                parts = self.io.save_parts([b.block_id for b in job.blocks], "handoff")
                if job.manifest.state_bytes and self.state_io is not None:
                    assert job.state_slot is not None
                    parts = [*parts, [memoryview(self.state_io.snapshot(job.state_slot))]]
                self._ship(job, parts)
                job.ok = True
            except Exception as exc:  # the decode side times out and recomputes
                log.warning("hand-off %s failed: %s", job.spec.key, exc)
            job.seconds = time.perf_counter() - t0
            self._done.put(job)

    def _ship(self, job: _Job, parts: list[list[memoryview]]) -> None:
        path = job.spec.path
        if path is HandoffPath.STORE:
            if self.store is None:
                raise RuntimeError("this instance has no shared KV store to hand off through")
            self.store.send(job.manifest, parts, job.known)
        elif path is HandoffPath.MOONCAKE:
            if self.mooncake is None or job.spec.peer is None:
                raise RuntimeError("this instance was not started with --handoff-mooncake")
            self.mooncake.send(job.manifest, parts, job.spec.peer)
        else:
            if self.direct is None or job.spec.peer is None:
                raise RuntimeError("a direct hand-off needs the decode instance's address")
            self.direct.send(job.manifest, parts, job.spec.peer)

    def busy(self) -> bool:
        """Hand-offs are out: their blocks come back at a later `pump`."""
        return bool(self._out)

    def held_blocks(self) -> Iterator[KVBlock]:
        for job in self._out:
            yield from job.blocks

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)


@dataclass
class _Waiting:
    spec: KVHandoff
    deadline: float
    since: float


class HandoffReceiver:
    """A `KVLoader` for requests that receive a hand-off (the engine composes it with the
    tiers' loader: `loader.Loaders`)."""

    def __init__(
        self,
        kv: KVCacheManager,
        io: BlockIO,
        arrivals: Arrivals,
        store: StoreReceiver | None,
        state_io: StateIO | None = None,
        before_write: Callable[[], None] | None = None,
    ) -> None:
        self.kv, self.pool, self.io, self.state_io = kv, kv.pool, io, state_io
        self.arrivals, self.store = arrivals, store
        # A landing writes at once into blocks (and a state slot) it was just handed, which may
        # be cached ones the KV tiers have not staged yet: their capture runs first.
        self.before_write = before_write
        self._waiting: dict[str, _Waiting] = {}
        self._ready: dict[str, tuple[list[KVBlock], int]] = {}  # landed: blocks, tokens
        self._failed: set[str] = set()
        self.received = 0
        self.failed = 0
        self.received_bytes = 0
        self.wait_seconds = 0.0
        kv.add_holder(self)

    def prepare(self, req: Request, computed: list[KVBlock]) -> LoadState:
        rid, spec = req.request_id, req.kv_handoff
        if spec is None or rid in self._failed:
            return LoadState.NONE
        if rid in self._ready:
            return LoadState.READY  # landed earlier; admission had no room then
        now = time.monotonic()
        w = self._waiting.get(rid)
        if w is None:
            w = self._waiting[rid] = _Waiting(spec, now + spec.timeout_s, now)
            if spec.path is HandoffPath.STORE and self.store is not None:
                self.store.want(spec.key, spec.timeout_s)
        arrival = self.arrivals.take(spec.key)
        if arrival is None:
            if now < w.deadline:
                return LoadState.WAIT
            log.warning("hand-off %s did not arrive in %.1f s; recomputing", spec.key,
                        spec.timeout_s)  # fmt: skip
            return self._fail(req)
        state = self._land(req, computed, arrival)
        if state is LoadState.WAIT:  # no room for its blocks yet: keep the bytes
            self.arrivals.put(arrival)
            return state
        self.arrivals.release(arrival)
        if state is LoadState.READY:
            del self._waiting[rid]
            self.received += 1
            self.received_bytes += arrival.manifest.nbytes
            self.wait_seconds += now - w.since
        return state

    def _land(self, req: Request, computed: list[KVBlock], arrival: Arrival) -> LoadState:
        m, bs = arrival.manifest, self.kv.block_size
        if not self._matches(req, m):
            log.warning("hand-off %s does not match its request; recomputing", m.key)
            return self._fail(req)
        have = min(len(computed), len(m.digests))
        need = m.num_blocks - have
        reviving = sum(1 for b in computed[:have] if b.ref_cnt == 0)
        if need > self.pool.num_free - reviving:
            return LoadState.WAIT
        if m.state_bytes and not self._land_state(req, arrival):
            return LoadState.WAIT
        mine = computed[:have]
        self.pool.touch(mine)
        new = self.pool.allocate(need)
        if self.before_write is not None:
            self.before_write()
        bpb = m.bytes_per_block
        data = self.arrivals.staging.view(arrival.offset + have * bpb, need * bpb)
        self.io.write_blocks([b.block_id for b in new], data)
        prompt_blocks = req.num_prompt_tokens // bs
        for i, b in enumerate(new):
            if have + i < len(m.digests):  # full blocks: prefix hits for others too
                self.kv.cache_block(req, have + i, b, prompt_blocks, loaded=True)
        self._ready[req.request_id] = (mine + new, m.tokens)
        handed = m.tokens - have * bs
        req.loaded_tokens["handoff"] = req.loaded_tokens.get("handoff", 0) + handed
        return LoadState.READY

    def _land_state(self, req: Request, arrival: Arrival) -> bool:
        """Write the handed-off state into a slot held for the request (False: none free)."""
        assert self.kv.states is not None and self.state_io is not None
        slot = self.kv.states.reserve_load(req.request_id)
        if slot is None:
            return False
        if self.before_write is not None:
            self.before_write()
        m = arrival.manifest
        at = arrival.offset + m.num_blocks * m.bytes_per_block
        self.state_io.write(slot, self.arrivals.staging.view(at, m.state_bytes))
        return True

    def _matches(self, req: Request, m: Manifest) -> bool:
        if m.seed != self.kv.hash_seed.hex() or m.block_size != self.kv.block_size:
            return False
        # A linear-attention model continues only from the state the blocks end at.
        want = 0 if self.kv.states is None or self.state_io is None else self.state_io.slot_bytes
        if m.state_bytes != want:
            return False
        if m.bytes_per_block != self.io.bytes_per_block:
            return False
        if m.tokens != req.num_prompt_tokens - 1 or m.tokens < 0:
            return False
        self.kv.lookup_blocks(req)
        mine = [h.digest.hex() for h in req.block_hashes[: len(m.digests)]]
        return mine == m.digests and len(m.digests) == m.tokens // m.block_size

    def _fail(self, req: Request) -> LoadState:
        self._waiting.pop(req.request_id, None)
        self._failed.add(req.request_id)
        self.failed += 1
        if self.store is not None and req.kv_handoff is not None:
            self.store.forget(req.kv_handoff.key)
        return LoadState.NONE

    def ready_prefix(self, req: Request) -> tuple[list[KVBlock], int] | None:
        return self._ready.get(req.request_id)

    def landed(self) -> list[Request]:
        return []  # lands on the engine thread, at admission: nothing is ever LOADING

    def release(self, req: Request) -> None:
        rid = req.request_id
        ready = self._ready.pop(rid, None)
        if ready is not None:
            self.pool.free(list(reversed(ready[0])))
        if self.kv.states is not None:  # a landed state it was not admitted with
            self.kv.states.release_load(rid)
        self._failed.discard(rid)
        w = self._waiting.pop(rid, None)
        if w is not None and self.store is not None:
            self.store.forget(w.spec.key)

    def release_all(self) -> int:
        n = sum(len(b) for b, _ in self._ready.values())
        for blocks, _ in self._ready.values():
            self.pool.free(list(reversed(blocks)))
        self._ready.clear()
        if self.kv.states is not None:
            n += self.kv.states.release_all_loads()
        return n

    def held_blocks(self) -> Iterator[KVBlock]:
        for blocks, _ in self._ready.values():
            yield from blocks


def handoff_stats(sender: HandoffSender | None, receiver: HandoffReceiver | None) -> HandoffStats:
    sent = sender.counts if sender is not None else {}
    return HandoffStats(
        sent={p: c.count - c.failed for p, c in sent.items()},
        send_failed=sum(c.failed for c in sent.values()),
        sent_bytes={p: c.nbytes for p, c in sent.items()},
        send_seconds={p: c.seconds for p, c in sent.items()},
        received=receiver.received if receiver else 0,
        receive_failed=receiver.failed if receiver else 0,
        received_bytes=receiver.received_bytes if receiver else 0,
        wait_seconds=receiver.wait_seconds if receiver else 0.0,
    )
