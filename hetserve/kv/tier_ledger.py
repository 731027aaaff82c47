"""The KV tiers' accounting: what was looked up, loaded, skipped and missed, and how long each
load took against what the cost model predicted when it was planned.

Who calls it: `TierManager` (kv/tiers.py) on the engine thread, as loads are planned and land;
`stats` turns it into the plain `TierStats` that `/metrics`, the benchmarks and tests read.
Predicted and measured times are kept side by side per tier so that the model's error is
printed next to its predictions: the load-or-recompute rule, and later the Conductor, are only
as good as these figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetserve.core.stats import LoadFit, TierStats
from hetserve.kv.tier_saves import Saver


@dataclass
class LoadCounters:
    lookups: int = 0
    loads: int = 0
    skipped: int = 0  # blocks found but recomputing them was predicted faster
    no_room: int = 0
    missed: int = 0  # blocks found at lookup but not read (gone, corrupt, timed out)
    loaded: dict[str, int] = field(default_factory=dict)  # tier -> blocks
    load_bytes: int = 0
    load_seconds: float = 0.0
    fit: dict[str, LoadFit] = field(default_factory=dict)  # tier -> predicted vs measured

    def record_fit(
        self,
        tier: str,
        predicted: tuple[float, float],
        measured: tuple[float, float],
    ) -> None:
        """One whole read from `tier`: (read, wait) seconds as predicted and as measured."""
        f = self.fit.get(tier, LoadFit())
        self.fit[tier] = LoadFit(
            f.loads + 1,
            f.predicted_s + predicted[0],
            f.measured_s + measured[0],
            f.predicted_wait_s + predicted[1],
            f.measured_wait_s + measured[1],
        )

    def stats(self, saver: Saver) -> TierStats:
        return TierStats(
            lookups=self.lookups,
            loads=self.loads,
            loaded_blocks=dict(self.loaded),
            load_bytes=self.load_bytes,
            load_seconds=self.load_seconds,
            skipped_blocks=self.skipped,
            missed_blocks=self.missed,
            saved_blocks=saver.saved,
            save_bytes=saver.save_bytes,
            save_failed_blocks=saver.failed,
            shed_saves=saver.shed,
            pending_saves=saver.pending(),
            load_fit=dict(self.fit),
        )
