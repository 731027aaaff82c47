"""The engine's KV services beyond its own cache, opened once at start-up: the KV tiers (a store
behind the cache), the prefill/decode hand-off, the loaders that bring blocks in from either,
host swap for preemption, and the facts `/kv` reports about the cache.

Who calls it: `EngineCore.__init__`, after the cost model's first measurements (the tiers weigh
loads against recomputing with it). Failure: a store or a hand-off endpoint that cannot open
raises, and the engine does not start; nothing here runs per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hetserve.config import EngineConfig, PreemptionMode, Role
from hetserve.engine.handoff import Handoff, open_handoff
from hetserve.engine.kv_store import BlockIO, open_tiers
from hetserve.engine.runner import ModelRunner
from hetserve.engine.state_io import StateIO
from hetserve.engine.swap import HostSwap
from hetserve.kv.loader import Loaders
from hetserve.kv.manager import KVCacheManager
from hetserve.kv.tier_policy import CostModel
from hetserve.kv.tiers import TierManager

if TYPE_CHECKING:
    from hetserve.disagg.kv_publisher import KVEventPublisher

log = logging.getLogger(__name__)


@dataclass
class KVServices:
    tiers: TierManager | None  # None: no --kv-store
    kv_summary: str | None  # the tiers' start-up line
    handoff: Handoff  # an empty one on a colocated instance
    loader: Loaders | None  # None: nothing to load blocks from
    swap: HostSwap | None  # preemption by swap's host copies


def open_kv_services(
    cfg: EngineConfig,
    kv: KVCacheManager,
    runner: ModelRunner,
    cost: CostModel,
    kv_events: KVEventPublisher | None,
) -> KVServices:
    """What `cfg` asks for beside the cache: tiers (their saves published on `kv_events`), the
    hand-off for its role, their loaders, host swap."""
    c = cfg.cache
    tiers, summary = None, None
    state_io = None if runner.state is None else StateIO(runner.state)
    io = BlockIO(runner.kv) if c.kv_store or cfg.disagg.role is not Role.BOTH else None
    if c.kv_store is not None:
        assert io is not None
        tiers, summary = open_tiers(c.kv_store, c.kv_save, c.kv_load, kv, io, cost, state_io)
        log.info("%s", summary)
        if kv_events is not None:
            kv_events.follow(tiers.store, tiers.saver.on_saved)
    handoff = Handoff() if io is None else open_handoff(cfg.disagg, kv, io, tiers, state_io)
    loader = None
    if handoff.receiver is not None or tiers is not None:
        loader = Loaders(handoff.receiver, tiers)
    swap = None
    if cfg.scheduler.preemption_mode is PreemptionMode.SWAP:
        swap_bytes = int(cfg.scheduler.swap_space_gb * (1 << 30))
        capture = None if tiers is None else tiers.capture_evicted
        swap = HostSwap(runner.kv, runner.state, swap_bytes, capture)
    return KVServices(tiers, summary, handoff, loader, swap)


def kv_facts(
    cfg: EngineConfig,
    kv: KVCacheManager,
    kv_dtype: torch.dtype,
    seed: bytes,
    tiers: TierManager | None,
    kv_events: KVEventPublisher | None,
) -> dict[str, object]:
    """What `/kv` (EngineCore.kv_info) reports about the cache, fixed at start-up."""
    return {
        "block_size": cfg.cache.block_size,
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "hash_seed": seed.hex(),
        "prefix_caching": cfg.cache.enable_prefix_caching,
        "num_blocks": kv.pool.num_usable,
        "store_tiers": [] if tiers is None else [t.name for t in tiers.store.tiers()],
        "kv_events": None if kv_events is None else kv_events.describe(),
    }
