"""One `hetserve sim` invocation: the runs it asks for (every policy x admission x cache mode x
rate x cache size), each a fresh `Simulation`, summarized.

Who calls it: the CLI (`entrypoints/sim.py`), `search.py`, tests. Pure but for the wall clock
each run reports about itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hetserve.core.trace_record import TraceRecord
from hetserve.disagg.policy import RouterConfig
from hetserve.sim.cache import ReplicaLog
from hetserve.sim.hardware import CacheNode
from hetserve.sim.loop import DecisionHook, SimConfig, SimResult, Simulation
from hetserve.sim.metrics import summarize, twin
from hetserve.sim.options import Pool

REPLICA_RANKS = (10, 100, 1000, 10000)
REPLICA_EVERY_S = 30.0  # the paper samples replica counts every 30 s (Fig. 11)


@dataclass(frozen=True)
class Plan:
    records: Sequence[TraceRecord]
    prefill: Pool
    decode: Pool
    cache_nodes: Sequence[CacheNode] = ()
    policies: Sequence[str] = ("kvcentric",)
    admissions: Sequence[str] = ("none",)
    caches: Sequence[str] = ("global",)
    rates: Sequence[float] = (1.0,)
    cache_tokens: Sequence[int | None] = (None,)  # None: each hardware's own
    block_tokens: int = 512
    slo_ttft_s: float | None = None
    slo_tbt_s: float | None = None
    time_scale: float = 1.0  # trace timestamps x this (0.5: twice as fast)
    output_tokens: int | None = None
    forecast: bool = True
    seed: int = 0
    replicas: bool = False


@dataclass
class Run:
    params: dict[str, Any]
    summary: dict[str, Any]
    twin: dict[str, Any] | None
    replicas: dict[str, Any] | None = field(default=None)

    def row(self) -> dict[str, Any]:
        out = {**self.params, **self.summary}
        if self.twin is not None:
            out["twin"] = self.twin
        if self.replicas is not None:
            out["hot_block_replicas"] = self.replicas
        return out


def config(
    plan: Plan,
    policy: str,
    admission: str,
    cache: str,
    rate: float = 1.0,
    cache_tokens: int | None = None,
    prefill: Pool | None = None,
    decode: Pool | None = None,
) -> SimConfig:
    router = RouterConfig(
        policy=policy,
        admission=admission,
        slo_ttft_s=plan.slo_ttft_s,
        slo_tbt_s=plan.slo_tbt_s,
        seed=plan.seed,
    )
    pre = (prefill or plan.prefill).instances()
    if cache_tokens is not None:
        pre = [replace(hw, host_cache_tokens=cache_tokens) for hw in pre]
    return SimConfig(
        router=router,
        prefill=pre,
        decode=(decode or plan.decode).instances(),
        cache=cache,
        cache_nodes=plan.cache_nodes,
        block_tokens=plan.block_tokens,
        arrival_scale=plan.time_scale / rate,
        forecast=plan.forecast,
        replica_log=plan.replicas and cache == "global",
        output_tokens=plan.output_tokens,
    )


def simulate(plan: Plan, cfg: SimConfig, hook: DecisionHook | None = None) -> SimResult:
    return Simulation(plan.records, cfg, hook).run()


def run_all(plan: Plan, progress: Callable[[Run], None] | None = None) -> list[Run]:
    runs = []
    combos = itertools.product(
        plan.policies, plan.admissions, plan.caches, plan.rates, plan.cache_tokens
    )
    for policy, admission, cache, rate, tokens in combos:
        cfg = config(plan, policy, admission, cache, rate, tokens)
        res = simulate(plan, cfg)
        params = {
            "policy": policy,
            "admission": admission,
            "cache": cache,
            "rate": rate,
            "cache_tokens": tokens if tokens is not None else _cache_tokens(cfg),
        }
        run = Run(params, summarize(res), twin(plan.records, res), _replicas(res))
        runs.append(run)
        if progress is not None:
            progress(run)
    return runs


def _cache_tokens(cfg: SimConfig) -> int | None:
    sizes = {hw.host_cache_tokens for hw in cfg.prefill}
    return sizes.pop() if len(sizes) == 1 else None


def _replicas(res: SimResult) -> dict[str, Any] | None:
    log: ReplicaLog | None = res.replicas
    if log is None:
        return None
    series = log.ranked(REPLICA_RANKS, res.end, REPLICA_EVERY_S)
    return {"every_s": REPLICA_EVERY_S, "by_rank": {str(k): v for k, v in series.items()}}
