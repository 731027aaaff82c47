"""`/metrics` of the KV tiers: each tier's loads as predicted and as measured."""

from __future__ import annotations

from types import SimpleNamespace

from hetserve.core.stats import EngineStats, LoadFit, TierStats
from hetserve.server.metrics import ServerMetrics


class _Engine:
    config = SimpleNamespace(cache=SimpleNamespace(block_size=16))

    def __init__(self, stats: EngineStats) -> None:
        self.observers: list = []
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats


def test_load_time_predicted_and_measured_per_tier():
    fits = {
        "ssd": LoadFit(2, predicted_s=0.25, measured_s=0.5, predicted_wait_s=0.5,
                       measured_wait_s=0.625),
        "dram": LoadFit(3, 0.125, 0.125, 0.125, 0.125),
    }  # fmt: skip
    text = ServerMetrics(_Engine(EngineStats(tiers=TierStats(load_fit=fits)))).render().decode()
    lines = set(text.splitlines())
    for line in (
        'hetserve_kv_load_seconds_count{tier="ssd"} 2.0',
        'hetserve_kv_load_seconds_sum{tier="ssd"} 0.5',
        'hetserve_kv_load_predicted_seconds_sum{tier="ssd"} 0.25',
        'hetserve_kv_load_wait_seconds_sum{tier="ssd"} 0.625',
        'hetserve_kv_load_wait_predicted_seconds_count{tier="dram"} 3.0',
        'hetserve_kv_load_fit_ratio{part="read",tier="ssd"} 2.0',
        'hetserve_kv_load_fit_ratio{part="wait",tier="ssd"} 1.25',
        'hetserve_kv_load_fit_ratio{part="read",tier="dram"} 1.0',
    ):
        assert line in lines, line


def test_no_loads_yet_is_no_ratio():
    text = ServerMetrics(_Engine(EngineStats(tiers=TierStats()))).render().decode()
    assert "# TYPE hetserve_kv_load_seconds summary" in text
    assert "hetserve_kv_load_fit_ratio{" not in text
