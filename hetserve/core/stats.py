"""EngineStats: a snapshot of one engine's state and counters, as `EngineCore.stats()` gives it.

Read by `/metrics`, the benchmarks and tests; a plain value, safe to hand to another thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_queries: int = 0  # full prompt blocks looked up in the prefix cache
    prefix_hits: int = 0  # of those, blocks found
    preemptions: int = 0
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt (and recomputed) tokens run through the model
    generation_tokens: int = 0
    failed_requests: int = 0  # requests failed inside the engine (the others went on)
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV blocks in use (0..1)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Block-weighted: hit blocks over looked-up blocks."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
