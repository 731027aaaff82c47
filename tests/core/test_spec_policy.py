"""Draft lengths (core/spec_policy.py): the expected tokens a step emits and the best length
against brute force; a sequence's record drafts where drafts pay, backs off where they do not,
and comes back when they hold again; over simulated acceptance it never costs much and gains
where drafts hold."""

import itertools
import random

import pytest

from hetserve.core.spec_policy import (
    FIRST_BACKOFF,
    MAX_BACKOFF,
    DraftRecord,
    best_length,
    tokens_per_step,
    try_length,
)

MOE_CPU = [1.0, 1.86, 2.29, 2.79, 3.42]  # bench speculative, 1.7 B MoE all-int8, Zen 4


def brute_tokens(a: float, k: int) -> float:
    """Enumerate which of k drafts hold (each with probability a); tokens = the drafts held
    before the first miss, plus the model's own token."""
    total = 0.0
    for held in itertools.product([True, False], repeat=k):
        p = 1.0
        for h in held:
            p *= a if h else 1 - a
        first_miss = next((j for j, h in enumerate(held) if not h), k)
        total += p * (first_miss + 1)
    return total


@pytest.mark.parametrize("a", [0.0, 0.3, 0.5, 0.8, 0.97, 1.0])
@pytest.mark.parametrize("k", range(0, 6))
def test_tokens_per_step_equals_enumeration(a, k):
    assert tokens_per_step(a, k) == pytest.approx(brute_tokens(a, k))


def test_best_length_equals_brute_force():
    rng = random.Random(0)
    for _ in range(2000):
        costs = [1.0]
        for _ in range(rng.randint(0, 6)):
            costs.append(costs[-1] + rng.uniform(0.0, 1.5))
        a = rng.random()
        rates = [tokens_per_step(a, k) / c for k, c in enumerate(costs)]
        top = max(rates)
        want = next(k for k, r in enumerate(rates) if r >= top * (1 - 1e-9))
        assert best_length(a, costs) == want
    assert best_length(0.99, [1.0, 1.0, 1.0]) == 2  # free drafts: all of them
    assert best_length(0.5, MOE_CPU) == 0  # half of them holding does not pay on this CPU
    assert best_length(0.95, MOE_CPU) == 3  # the fourth draft costs more than it brings


def test_a_record_backs_off_and_comes_back():
    assert DraftRecord().length([1.0] * 5, 4) == 4  # free drafts: all it found
    assert try_length(MOE_CPU) == 1 and try_length([1.0, 2.4, 2.4, 2.5]) == 2
    assert try_length([1.0, 50.0, 60.0]) == 0 and DraftRecord().length([1.0, 50.0, 60.0], 2) == 0
    assert DraftRecord().length([1.0] * 5, 2) == 2
    r = DraftRecord()
    for _ in range(6):  # misses: the rate falls, no length pays
        r.observe(4, 0)
    assert r.rate < 0.3
    gaps, last = [], -1
    for step in range(400):
        n = r.length(MOE_CPU, 4)
        if n:
            assert n == 1  # a try is one draft
            gaps.append(step - last)
            last = step
            r.observe(1, 0)
    # the first try after FIRST_BACKOFF steps, then each twice as far as the one before, up
    # to MAX_BACKOFF steps apart
    assert FIRST_BACKOFF <= gaps[0] <= FIRST_BACKOFF + 1
    assert all(b >= min(2 * a - 1, MAX_BACKOFF) for a, b in itertools.pairwise(gaps))
    assert max(gaps) <= MAX_BACKOFF + 1 and len(gaps) >= 6
    # held tries: it tries every step, and the rate climbs until a length pays again
    while not r.length(MOE_CPU, 4):
        pass
    steps = 0
    while r.length(MOE_CPU, 4) < 2 and steps < 100:
        r.observe(1, 1)
        steps += 1
    assert steps < 40 and r.rate > 0.75
    assert r.length(MOE_CPU, 0) == 0  # nothing proposed: nothing checked


def simulate(a: float, costs: list[float], steps: int = 4000, seed: int = 0) -> float:
    """Tokens per unit of step time (a decode step = 1) for drafts holding i.i.d. with
    probability a, drafts always available."""
    rng, rec = random.Random(seed), DraftRecord()
    tokens = time = 0.0
    for _ in range(steps):
        k = rec.length(costs, len(costs) - 1)
        held = 0
        while held < k and rng.random() < a:
            held += 1
        rec.observe(k, held)
        tokens += held + 1
        time += costs[k]
    return tokens / time


@pytest.mark.parametrize("a", [0.0, 0.2, 0.5, 0.7])
def test_where_drafts_do_not_pay_it_costs_little(a):
    assert simulate(a, MOE_CPU) > 0.96  # plain decoding: 1.0


@pytest.mark.parametrize(("a", "gain"), [(0.9, 1.08), (0.97, 1.25)])
def test_where_drafts_hold_it_gains(a, gain):
    assert simulate(a, MOE_CPU) > gain
    best = max(tokens_per_step(a, k) / c for k, c in enumerate(MOE_CPU))
    assert simulate(a, MOE_CPU) > 0.85 * best  # its estimate of a is noisy
