"""The start-up probe's arithmetic on injected timings: medians per size, a line through them,
the bounds a real tier cannot break, and the doubts it flags (no clock is read here)."""

from __future__ import annotations

import pytest

from hetserve.store.probe_fit import (
    CAPPED,
    FLAT,
    ONE_SIZE,
    SLOW,
    UNSTEADY,
    fit_tier,
    medians,
    unsteady,
)

BLOCK = 1 << 16  # 64 KiB
SIZES = (1, 8, 32)


def line(latency: float, bandwidth: float, *noise: float) -> dict[int, list[float]]:
    """Reads of 1, 8 and 32 blocks on the line latency + bytes / bandwidth, each size read
    once per factor in `noise` (1.0: exactly on the line)."""
    return {
        k * BLOCK: [(latency + k * BLOCK / bandwidth) * f for f in noise or (1.0,) * 5]
        for k in SIZES
    }


def test_a_clean_line_is_recovered():
    fit = fit_tier(line(1e-4, 2e9), copy_bandwidth=2e10)
    assert fit.latency_s == pytest.approx(1e-4) and fit.bandwidth == pytest.approx(2e9)
    assert fit.flags == () and [n for n, _ in fit.points] == [BLOCK, 8 * BLOCK, 32 * BLOCK]
    assert fit.load_time(115 * BLOCK) == pytest.approx(1e-4 + 115 * BLOCK / 2e9)


def test_a_stray_slow_read_per_size_moves_nothing():
    # Two of five reads of every size were disturbed (10x and 30x): the medians hold.
    fit = fit_tier(line(1e-4, 2e9, 1.0, 10.0, 1.0, 30.0, 1.0), copy_bandwidth=None)
    assert fit.latency_s == pytest.approx(1e-4) and fit.bandwidth == pytest.approx(2e9)


def test_no_tier_reads_faster_than_a_memory_copy():
    fit = fit_tier(line(2e-4, 1e11), copy_bandwidth=1e10)
    assert CAPPED in fit.flags and fit.bandwidth == 1e10
    # The fixed cost is refitted for that slope: what the capped line leaves unexplained.
    explained = [fit.load_time(n) for n, _ in fit.points]
    assert sum(t for _, t in fit.points) == pytest.approx(sum(explained))
    assert fit.latency_s >= 0


def test_reads_that_cost_the_same_at_every_size_are_a_fixed_cost_at_copy_speed():
    samples = {k * BLOCK: [3e-4] * 5 for k in SIZES}
    fit = fit_tier(samples, copy_bandwidth=1e10)
    assert FLAT in fit.flags and fit.bandwidth == 1e10
    assert fit.latency_s == pytest.approx(3e-4 - 41 * BLOCK / 3 / 1e10)
    # Without a copy rate to bound it: the conservative reading, every second per byte.
    fit = fit_tier(samples, copy_bandwidth=None)
    assert fit.latency_s == 0 and fit.bandwidth == pytest.approx(32 * BLOCK / 3e-4)


def test_a_negative_fixed_cost_is_refitted_through_the_origin():
    samples = {BLOCK: [1e-5] * 3, 8 * BLOCK: [1e-4] * 3, 32 * BLOCK: [6e-4] * 3}
    fit = fit_tier(samples, copy_bandwidth=None)
    assert fit.latency_s == 0
    xs, ys = [BLOCK, 8 * BLOCK, 32 * BLOCK], [1e-5, 1e-4, 6e-4]
    slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    assert fit.bandwidth == pytest.approx(1 / slope)


def test_scattered_or_inverted_reads_are_flagged_unsteady():
    assert not unsteady(line(1e-4, 2e9, 1.0, 1.1, 0.9, 1.2, 1.0))
    scattered = line(1e-4, 2e9, 1.0, 2.0, 0.5, 3.0, 1.0)  # half the reads far off the median
    assert unsteady(scattered) and UNSTEADY in fit_tier(scattered, None).flags
    inverted = {BLOCK: [5e-4] * 5, 8 * BLOCK: [2e-4] * 5, 32 * BLOCK: [9e-4] * 5}
    assert unsteady(inverted)
    assert medians(inverted) == [(BLOCK, 5e-4), (8 * BLOCK, 2e-4), (32 * BLOCK, 9e-4)]


def test_a_memory_tier_far_below_the_copy_rate_is_flagged_slow():
    crawl = line(1e-4, 1e8)  # 0.1 GB/s against a 10 GB/s copy
    assert SLOW in fit_tier(crawl, copy_bandwidth=1e10, memory=True).flags
    assert SLOW not in fit_tier(crawl, copy_bandwidth=1e10, memory=False).flags  # an SSD may
    assert SLOW not in fit_tier(line(1e-4, 2e9), copy_bandwidth=1e10, memory=True).flags


def test_one_size_is_charged_all_to_bandwidth_and_none_is_an_error():
    fit = fit_tier({4 * BLOCK: [2e-3, 1e-3, 3e-3]}, copy_bandwidth=1e10)
    assert ONE_SIZE in fit.flags and fit.latency_s == 0
    assert fit.bandwidth == pytest.approx(4 * BLOCK / 2e-3)
    with pytest.raises(ValueError):
        fit_tier({BLOCK: []}, copy_bandwidth=None)
