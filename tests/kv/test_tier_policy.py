"""Load-or-recompute: load a run of stored blocks only where it beats recomputing them."""

import math
import random

import pytest

from hetserve.kv.tier_policy import CostModel, TierCost, load_wait, plan_load, predict_load

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


# ---- what a load off the engine thread waits ---------------------------------------------
# Binary fractions throughout, so ties and edges are exact in floating point.
KB = 1024
RATE = 1024.0  # tokens per second: a 16-token block recomputes in 1/64 s
BLOCK_S = BS / RATE


def test_a_load_off_the_engine_thread_waits_until_the_step_boundary_after_its_read():
    assert load_wait(0.25, 0.0) == 0.25  # no steps to wait for: just the read
    assert load_wait(0.25, 0.5) == 0.5  # lands during the first step, seen at its end
    assert load_wait(0.5, 0.5) == 0.5  # exactly one step: not a second one
    assert load_wait(0.75, 0.5) == 1.0
    assert load_wait(0.0, 0.125) == 0.125  # even a free read waits for the step under way
    assert load_wait(1.0, 0.1) == pytest.approx(1.0)  # 10 steps, not 11 (float slack)


def test_steps_run_meanwhile_come_from_what_is_running_not_past_prefills():
    m = CostModel(prefill_tokens_per_s=RATE, decode_step_s=0.03125)
    poll = 0.0005
    assert m.step_period([], 2048, poll) == poll  # a lone request: the engine only polls
    assert m.step_period([1, 1, 1], 2048, poll) == 0.03125  # decodes: one decode step each
    # A running prefill adds its chunk (capped by the step's budget) at the prefill rate.
    assert m.step_period([1, 512], 2048, poll) == 0.03125 + 0.5
    assert m.step_period([4096], 1024, poll) == 1.0
    no_decode_yet = CostModel(prefill_tokens_per_s=RATE)
    assert no_decode_yet.step_period([1, 1], 2048, poll) == 2 / RATE
    assert CostModel().step_period([1], 2048, poll) == poll  # nothing known: at least a poll


def test_long_prefill_steps_refine_the_prefill_rate_and_never_the_decode_step():
    m = CostModel()
    for _ in range(10):
        m.observe_step(2.0, 2048)  # a history of long prefills
    assert m.decode_step_s is None and m.prefill_tokens_per_s == 1024.0
    m.observe_step(0.25, 0)
    m.observe_step(0.5, 32)  # a few prompt tokens: mostly fixed cost, teaches nothing
    assert m.decode_step_s == 0.25 and m.prefill_tokens_per_s == 1024.0
    m.observe_step(0.5, 0)
    assert m.decode_step_s == pytest.approx(0.8 * 0.25 + 0.2 * 0.5)


def test_a_lone_request_loads_a_fast_tier_after_a_history_of_long_prefills():
    m = model(rate=None, pool=(0.0, 1024 * MB))  # a 1 MiB block reads in 1/1024 s
    for _ in range(20):
        m.observe_step(2.0, 2048)  # 2 s steps: the old average charged them to every load
    period = m.step_period([], 2048, 0.0005)
    plan = plan_load(["pool"] * 8, MB, BS, m, period_s=period)
    assert (plan.num_blocks, plan.reason) == (8, "load")
    assert plan.load_s == load_wait(8 / 1024, 0.0005) and plan.recompute_s == 8 * BS / 1024


def test_an_off_thread_load_is_charged_whole_steps_and_an_inline_one_its_read():
    m = model(rate=RATE, ssd=(0.0, 64 * KB))  # one 1 KiB block: 1/64 s, as its recompute
    inline = {"ssd"}
    # Inline: read 1/64 s against recompute 1/64 s, a tie: recompute (no gain, no risk).
    tie = plan_load(["ssd"], KB, BS, m, inline=inline)
    assert (tie.num_blocks, tie.reason) == (0, "recompute cheaper")
    assert tie.load_s == tie.recompute_s == BLOCK_S
    # A hair more bandwidth and the inline load wins.
    faster = model(rate=RATE, ssd=(0.0, 64 * KB + 1))
    assert plan_load(["ssd"], KB, BS, faster, inline=inline).num_blocks == 1
    # Off the thread, steps of 1/128 s: the read spans exactly two, so it waits 1/64 s (no
    # third step for a read ending on a boundary): a tie again. The faster read ends inside
    # the second step and waits as long: still a tie.
    assert plan_load(["ssd"], KB, BS, m, period_s=1 / 128).load_s == BLOCK_S
    assert plan_load(["ssd"], KB, BS, m, period_s=1 / 128).num_blocks == 0
    assert plan_load(["ssd"], KB, BS, faster, period_s=1 / 128).num_blocks == 0
    # Steps of 3/256 s: any number of these blocks waits past its recompute.
    assert plan_load(["ssd"] * 4, KB, BS, m, period_s=3 / 256).num_blocks == 0


def test_a_long_step_is_worth_waiting_for_only_with_enough_blocks():
    m = model(rate=RATE, ssd=(0.0, 128 * KB))  # a block reads in 1/128 s, recomputes in 1/64
    assert plan_load(["ssd"], KB, BS, m, period_s=1 / 128).num_blocks == 1
    # Steps of 3/64 s (a running prefill): 3 blocks recompute in 3/64 s, a tie; 4 in 4/64 s,
    # while their read (4/128 s) still lands within the first step.
    assert plan_load(["ssd"] * 3, KB, BS, m, period_s=3 / 64).num_blocks == 0
    plan = plan_load(["ssd"] * 4, KB, BS, m, period_s=3 / 64)
    assert (plan.num_blocks, plan.load_s, plan.read_s) == (4, 3 / 64, 4 / 128)


def test_equal_gains_load_the_fewest_blocks():
    # dram: free; ssd: one block costs exactly its recompute (latency 0): gains 1/64, 1/64.
    m = model(rate=RATE, dram=(0.0, 1e30), ssd=(0.0, 64 * KB))
    plan = plan_load(["dram", "ssd"], KB, BS, m, inline={"dram", "ssd"})
    assert (plan.num_blocks, plan.found_blocks) == (1, 2)


def test_predicted_loads_name_reads_and_the_wait():
    m = model(rate=RATE, dram=(0.0, 64 * KB), ssd=(1 / 64, 64 * KB))
    assert predict_load(["dram"] * 2, KB, m, {"dram"}, 0.5) == (2 / 64, 2 / 64)
    assert predict_load(["dram", "ssd"], KB, m, {"dram"}, 0.5) == (3 / 64, 0.5)
    assert predict_load(["tape"], KB, m) is None
    always = plan_load(["dram", "ssd"], KB, BS, m, always=True, inline={"dram"}, period_s=0.5)
    assert (always.num_blocks, always.read_s, always.load_s) == (2, 3 / 64, 0.5)


def _brute_force(found, bpb, bs, m, inline, period):
    """Every prefix costed by hand: tiers read one after the other, latency once per tier;
    off the thread, rounded up to whole steps of `period` (at least one)."""
    best_k, best_gain = 0, 0.0
    for k in range(1, len(found) + 1):
        run = found[:k]
        if any(t not in m.tiers for t in run):
            break
        read = sum(
            m.tiers[t].latency_s + run.count(t) * bpb / m.tiers[t].bandwidth for t in set(run)
        )
        if not set(run) <= inline and period > 0:
            steps = max(1, math.ceil(read / period - 1e-9))
            read = steps * period
        gain = k * bs / m.prefill_tokens_per_s - read
        if gain > best_gain + 1e-12:
            best_k, best_gain = k, gain
    return best_k


def test_plan_matches_a_brute_force_search_on_random_cases():
    rng = random.Random(39)
    names = ["dram", "ssd", "pool", "tape"]  # tape: no cost known
    for _ in range(2000):
        m = model(
            rate=rng.choice([200.0, 2000.0, 20_000.0]),
            dram=(rng.uniform(0, 1e-4), rng.uniform(1e9, 2e10)),
            ssd=(rng.uniform(1e-4, 5e-3), rng.uniform(5e7, 3e9)),
            pool=(rng.uniform(1e-4, 2e-2), rng.uniform(1e8, 1e10)),
        )
        found = [rng.choice(names) for _ in range(rng.randint(1, 12))]
        inline = set(rng.sample(names[:3], rng.randint(0, 2)))
        period = rng.choice([0.0, 0.0005, 0.02, 0.3])
        plan = plan_load(found, MB, BS, m, inline=inline, period_s=period)
        assert plan.num_blocks == _brute_force(found, MB, BS, m, inline, period), (found, m)


def test_observed_loads_never_exceed_the_copy_rate():
    m = model(dram=(0.0, 1e9))
    m.copy_bandwidth = 2e9
    for _ in range(100):
        m.observe_load("dram", MB, 1e-9)  # a few blocks can look arbitrarily fast
    assert m.tiers["dram"].bandwidth == pytest.approx(2e9)
