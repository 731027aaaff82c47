"""The event loop: the only thing here with a clock (simulated seconds).

Each request arrives at its trace time (times the arrival scale), the Conductor's policy
(`hetserve.disagg.policy.Router`, called as the live Conductor calls it) decides from a
`ClusterView` built out of the simulated instances and caches; the request queues at its
prefill instance, loads its cached prefix and computes the rest, pushes its KV to its decode
instance (streamed layer by layer during the prefill, so only what the computation did not hide
remains), joins the decode batch and leaves after its last token.

Events at the same time run in the order they were scheduled, so a run is a function of the
trace, the configuration and the seed (the random policy's).

Who calls it: `run.py`. Failure contract: none of its own; the policy's rejections are results.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hetserve.core.trace_record import TraceRecord
from hetserve.disagg.policy import (
    POOL,
    ClusterView,
    Decision,
    InstanceState,
    PrefixHolding,
    RequestInfo,
    Router,
    RouterConfig,
)
from hetserve.sim.cache import Caches, ReplicaLog
from hetserve.sim.decode import DecodeInstance
from hetserve.sim.hardware import CacheNode, Hardware
from hetserve.sim.jobs import Job
from hetserve.sim.prefill import PrefillInstance
from hetserve.sim.trace import coarsen

ARRIVAL, PREFILL_DONE, KV_ARRIVED, DECODE_BOUNDARY = range(4)

# What a caller may watch: each decision with the view it was made from.
DecisionHook = Callable[[ClusterView, RequestInfo, float, Decision], None]


@dataclass(frozen=True)
class SimConfig:
    router: RouterConfig  # its SLOs are the run's SLOs
    prefill: Sequence[Hardware]  # one per instance
    decode: Sequence[Hardware]
    cache: str = "global"  # "local" | "global"
    cache_nodes: Sequence[CacheNode] = ()
    block_tokens: int = 512
    arrival_scale: float = 1.0  # trace time x this = simulated time
    forecast: bool = True  # the decode side's forecast in the view (`decode_changes`)
    replica_log: bool = False
    output_tokens: int | None = None  # every request's output length, instead of the trace's


@dataclass
class SimResult:
    config: SimConfig
    jobs: list[Job]
    prefill: list[PrefillInstance]
    decode: list[DecodeInstance]
    caches: Caches
    events: int
    wall_s: float
    end: float  # simulated seconds at the last event
    replicas: ReplicaLog | None = field(default=None)
    policy_s: float = 0.0  # wall seconds inside Router.decide: the floor of any run


class Simulation:
    def __init__(
        self, records: Sequence[TraceRecord], cfg: SimConfig, hook: DecisionHook | None = None
    ) -> None:
        if cfg.cache not in ("local", "global"):
            raise ValueError(f"cache {cfg.cache!r}: choose local or global")
        self.cfg, self.hook = cfg, hook
        bs = cfg.block_tokens
        self.router = Router(cfg.router)
        self.prefill = [PrefillInstance(f"p{i}", hw, bs) for i, hw in enumerate(cfg.prefill)]
        self.decode = [DecodeInstance(f"d{i}", hw, bs) for i, hw in enumerate(cfg.decode)]
        self.index = {inst.name: i for i, inst in enumerate(self.prefill)}
        self.index.update({inst.name: i for i, inst in enumerate(self.decode)})
        caps = [hw.host_cache_tokens // bs for hw in cfg.prefill]
        kv = cfg.prefill[0].profile.kv_bytes_per_token if cfg.prefill else 1
        if cfg.cache == "global" and cfg.cache_nodes:
            caps.append(sum(n.dram_bytes for n in cfg.cache_nodes) // kv // bs)
        self.replicas = ReplicaLog() if cfg.replica_log else None
        self.caches = Caches(caps, len(self.prefill), self.replicas)
        self.jobs = [self._job(i, r) for i, r in enumerate(records)]
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.events = 0
        self.policy_s = 0.0
        self.inflight: list[dict[int, Job]] = [{} for _ in self.decode]  # routed, KV not there
        self._dstate: list[InstanceState | None] = [None] * len(self.decode)

    def _job(self, i: int, rec: TraceRecord) -> Job:
        rec = coarsen(rec, self.cfg.block_tokens)
        n, bs = rec.input_length, self.cfg.block_tokens
        out = self.cfg.output_tokens or rec.output_length
        full = rec.hash_ids[: n // bs]
        return Job(
            i,
            rec.timestamp_ms / 1000 * self.cfg.arrival_scale,
            n,
            out,
            rec.priority,
            full,
            (n - 1) // bs,
        )

    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))
        self.seq += 1

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        for job in self.jobs:
            self._push(job.arrival, ARRIVAL, job.idx)
        now = 0.0
        while self.heap:
            now, _, kind, a, b = heapq.heappop(self.heap)
            self.events += 1
            if kind == ARRIVAL:
                self._arrive(self.jobs[a], now)
            elif kind == PREFILL_DONE:
                self._prefill_done(a, now)
            elif kind == KV_ARRIVED:
                self._kv_arrived(self.jobs[a], now)
            elif b == self.decode[a].version:
                self._boundary(a, now)
        return SimResult(
            self.cfg,
            self.jobs,
            self.prefill,
            self.decode,
            self.caches,
            self.events,
            time.perf_counter() - t0,
            now,
            self.replicas,
            self.policy_s,
        )

    # ---- the Conductor ----------------------------------------------------------------------
    def _arrive(self, job: Job, now: float) -> None:
        found, pooled = self.caches.lookup(job.blocks[: job.usable])
        view = self._view(found, pooled, now)
        req = RequestInfo(str(job.idx), job.input_length, job.priority, job.output_length)
        t0 = time.perf_counter()
        decision = self.router.decide(view, req, now)
        self.policy_s += time.perf_counter() - t0
        if self.hook is not None:
            self.hook(view, req, now, decision)
        if decision.rejected or decision.prefill is None or decision.decode is None:
            job.rejected, job.reason = "admission", decision.reject_reason
            return
        p, d = self.index[decision.prefill], self.index[decision.decode]
        job.prefill, job.decode = p, d
        job.cached_tokens = decision.cached_tokens
        job.predicted_ttft = decision.predicted_ttft_s
        cached = decision.cached_tokens // self.cfg.block_tokens
        pull = decision.pull
        job.local_blocks = min(found.get(p, 0), cached)
        job.pool_blocks = cached - job.local_blocks if pull and pull.source == POOL else 0
        assert job.local_blocks + job.pool_blocks == cached, (job.idx, decision)
        self.caches.touch(p, job.blocks[: job.local_blocks])
        end = self.prefill[p].enqueue(job, now)
        if end is not None:
            self._push(end, PREFILL_DONE, p)
        if self.cfg.forecast and job.output_length > 1:
            self.inflight[d][job.idx] = job
            self._dstate[d] = None

    def _view(self, found: dict[int, int], pooled: int, now: float) -> ClusterView:
        caches = self.caches
        states = [
            inst.state(now, caches.capacity[i] - caches.used(i), caches.capacity[i])
            for i, inst in enumerate(self.prefill)
        ]
        states += [self._decode_state(i, now) for i in range(len(self.decode))]
        holdings = {
            self.prefill[h].name: PrefixHolding(
                self.prefill[h].name, {self.prefill[h].hw.cache_tier: k}
            )
            for h, k in found.items()
        }
        if self.cfg.cache == "global" and pooled:
            holdings[POOL] = PrefixHolding(POOL, {POOL: pooled})
        return ClusterView(states, holdings, self.cfg.block_tokens)

    def _decode_state(self, i: int, now: float) -> InstanceState:
        state = self._dstate[i]
        if state is None:
            forecast = None
            if self.cfg.forecast:
                forecast = self.decode[i].finish_forecast() + self._arrivals(i, now)
            state = self._dstate[i] = self.decode[i].state(forecast)
        return state

    def _arrivals(self, d: int, now: float) -> list[tuple[float, int, int]]:
        """Requests routed to decode instance d whose KV has not arrived: expected when their
        prefill was predicted to end, leaving after their output at today's step length."""
        inst = self.decode[d]
        step = inst.fit.seconds(max(inst.batch, 1), inst.context)
        out = []
        for job in self.inflight[d].values():
            eta = job.arrival + (job.predicted_ttft or 0.0)
            out.append((eta, 1, job.input_length))
            out.append((eta + (job.output_length - 1) * step, -1, -(job.decode_tokens - 1)))
        return out

    # ---- instances --------------------------------------------------------------------------
    def _prefill_done(self, p: int, now: float) -> None:
        job, nxt = self.prefill[p].finish(now)
        self.caches.insert(p, job.blocks, now)
        if len(self.caches.capacity) > len(self.prefill):  # write-through to the CPU nodes
            self.caches.insert(len(self.prefill), job.blocks, now)
        if nxt is not None:
            self._push(nxt, PREFILL_DONE, p)
        if job.output_length <= 1:
            job.finish = now  # the prefill gave the only token: nothing to decode
            return
        hw = self.prefill[p].hw
        kv = hw.profile.kv_bytes(job.input_length)  # the recurrent state too (hybrid models)
        # Streamed while the prefix loaded and the new tokens computed: only the rest waits.
        left = max(hw.handoff.latency_s, hw.handoff.load_time(kv) - job.load_s - job.compute_s)
        self._push(now + left, KV_ARRIVED, job.idx)

    def _kv_arrived(self, job: Job, now: float) -> None:
        d = job.decode
        self.inflight[d].pop(job.idx, None)
        self._dstate[d] = None
        ok, at = self.decode[d].arrive(job, now, self.cfg.router.slo_tbt_s)
        if not ok:
            job.rejected, job.reason = "decode", "the decode instance refused it (TBT SLO or room)"
        elif at is not None:
            self._push(at, DECODE_BOUNDARY, d, self.decode[d].version)

    def _boundary(self, d: int, now: float) -> None:
        self._dstate[d] = None
        _, at = self.decode[d].boundary(now)
        if at is not None:
            self._push(at, DECODE_BOUNDARY, d, self.decode[d].version)
