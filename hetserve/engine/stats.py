"""EngineCore's statistics (`EngineCore.stats`): the scheduler's queues, the KV pools, the
prefix cache's hits by tier, the step counters, the tiers' and hand-offs' own figures.

Who calls it: EngineCore.stats (the engine's thread; /metrics and `LLM.stats` read the result).
Reads only; nothing fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetserve.config import Role
from hetserve.core.stats import EngineStats
from hetserve.kv.handoff import handoff_stats

if TYPE_CHECKING:
    from hetserve.engine.core import EngineCore


def engine_stats(core: EngineCore) -> EngineStats:
    """The engine's counters and pools now (EngineCore.stats)."""
    pool = core.kv.pool
    c = core._counts
    return EngineStats(
        num_running=len(core.scheduler.running),
        num_waiting=len(core.scheduler.waiting),
        kv_blocks_used=pool.num_usable - pool.num_free,
        kv_blocks_total=pool.num_usable,
        prefix_queries=core.kv.queries,
        prefix_hits=core.kv.hits,
        prefix_hits_by_tier=dict(core.kv.hits_by_tier),
        preemptions=c["preemptions"],
        steps=c["steps"],
        prompt_tokens_computed=c["prompt_tokens"],
        generation_tokens=c["generation"],
        failed_requests=core._finished.get("error", 0),
        finished=dict(core._finished),
        tiers=core.tiers.stats() if core.tiers is not None else None,
        handoff=None
        if core.config.disagg.role is Role.BOTH
        else handoff_stats(core.handoff.sender, core.handoff.receiver),
        load=core.scheduler.load(),
        step_kinds=core.step_log.stats(),
    )
