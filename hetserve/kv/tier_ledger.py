"""The KV tiers' accounting: what was looked up, loaded, skipped and missed.

Who calls it: `TierManager` (kv/tiers.py) on the engine thread, as loads are planned and land;
`stats` turns it into the plain `TierStats` that `/metrics`, the benchmarks and tests read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetserve.core.stats import TierStats
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
        )
