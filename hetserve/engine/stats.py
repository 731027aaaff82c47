"""EngineCore's statistics (`EngineCore.stats`): the scheduler's queues, the KV pools, the
prefix cache's hits by tier, the step counters, the tiers' and hand-offs' own figures.

Who calls it: EngineCore.stats (the engine's thread; /metrics and `LLM.stats` read the result).
Reads only; nothing fails.
"""

from __future__ import annotations

from hetserve.core.stats import EngineStats
from hetserve.engine.handoff import Handoff
from hetserve.engine.step_log import StepLog
from hetserve.kv.handoff import handoff_stats
from hetserve.kv.manager import KVCacheManager
from hetserve.kv.tiers import TierManager
from hetserve.sched.scheduler import Scheduler


def engine_stats(
    scheduler: Scheduler,
    kv: KVCacheManager,
    counts: dict[str, int],
    finished: dict[str, int],
    tiers: TierManager | None,
    handoff: Handoff | None,
    step_log: StepLog,
) -> EngineStats:
    """The engine's counters and pools now (EngineCore.stats): `counts` its step counters,
    `finished` its requests by finish reason, `handoff` None where it hands nothing off."""
    pool = kv.pool
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        kv_blocks_used=pool.num_usable - pool.num_free,
        kv_blocks_total=pool.num_usable,
        prefix_queries=kv.queries,
        prefix_hits=kv.hits,
        prefix_hits_by_tier=dict(kv.hits_by_tier),
        preemptions=counts["preemptions"],
        layer_slices=scheduler.slices_started,
        steps=counts["steps"],
        prompt_tokens_computed=counts["prompt_tokens"],
        generation_tokens=counts["generation"],
        spec_drafts=counts["spec_drafts"],
        spec_draft_tokens=counts["spec_draft_tokens"],
        spec_accepted_tokens=counts["spec_accepted"],
        failed_requests=finished.get("error", 0),
        finished=dict(finished),
        tiers=tiers.stats() if tiers is not None else None,
        handoff=None if handoff is None else handoff_stats(handoff.sender, handoff.receiver),
        load=scheduler.load(),
        step_kinds=step_log.stats(),
    )
