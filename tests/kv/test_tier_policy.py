"""Load-or-recompute: load a run of stored blocks only where it beats recomputing them."""

import pytest

from hetserve.kv.tier_policy import CostModel, TierCost, plan_load

MB = 1 << 20
BS = 16


def model(rate=2000.0, **tiers):
    return CostModel({n: TierCost(*c) for n, c in tiers.items()}, prefill_tokens_per_s=rate)


def test_fast_tier_loads_the_whole_run():
    m = model(dram=(1e-4, 10e9))  # recompute: 8 ms a block; load: ~0.2 ms
    plan = plan_load(["dram"] * 6, MB, BS, m)
    assert (plan.num_blocks, plan.reason, plan.skipped) == (6, "load", False)
    assert plan.load_s < plan.recompute_s


def test_slow_tier_is_recomputed_and_counted_as_skipped():
    m = model(rate=200_000.0, ssd=(5e-3, 100e6))  # recompute 0.08 ms a block; load > 5 ms
    plan = plan_load(["ssd"] * 4, MB, BS, m)
    assert (plan.num_blocks, plan.reason, plan.skipped) == (0, "recompute cheaper", True)
    assert plan.load_s > plan.recompute_s


def test_latency_is_paid_once_per_tier_so_long_runs_can_be_worth_it():
    m = model(rate=2000.0, pool=(50e-3, 10e9))  # 50 ms per read vs 8 ms a block
    assert plan_load(["pool"] * 3, MB, BS, m).num_blocks == 0
    assert plan_load(["pool"] * 20, MB, BS, m).num_blocks == 20


def test_mixed_run_stops_where_the_next_tier_costs_more_than_it_saves():
    m = model(rate=20_000.0, dram=(1e-4, 10e9), ssd=(20e-3, 50e6))
    plan = plan_load(["dram"] * 5 + ["ssd"] * 3, MB, BS, m)
    assert plan.num_blocks == 5 and plan.found_blocks == 8


def test_unknown_tier_and_missing_rate_load_nothing_they_cannot_predict():
    m = model(dram=(1e-4, 10e9))
    assert plan_load(["dram", "dram", "tape", "dram"], MB, BS, m).num_blocks == 2
    assert plan_load(["tape"], MB, BS, m).reason == "unknown tier"
    no_rate = CostModel({"dram": TierCost(1e-4, 10e9)})
    assert plan_load(["dram"], MB, BS, no_rate).reason == "no prefill rate yet"
    assert plan_load([], MB, BS, m).num_blocks == 0


def test_measurements_refine_the_model():
    m = model(rate=1000.0, dram=(1e-3, 1e9))
    m.observe_load("dram", 100 * MB, 1e-3 + 100 * MB / 4e9)  # really 4 GB/s
    assert 1e9 < m.tiers["dram"].bandwidth < 4e9
    for _ in range(50):
        m.observe_load("dram", 100 * MB, 1e-3 + 100 * MB / 4e9)
    assert m.tiers["dram"].bandwidth == pytest.approx(4e9, rel=1e-3)
    m.observe_load("dram", MB, 1e-4)  # all latency: nothing learnt about bandwidth
    assert m.tiers["dram"].bandwidth == pytest.approx(4e9, rel=1e-3)
    m.observe_prefill(3000, 1.0)
    assert 1000 < m.prefill_tokens_per_s < 3000
