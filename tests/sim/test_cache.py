"""The caches against brute force: hit rates of a replay, and per-holder prefix lookups."""

from __future__ import annotations

import random

import pytest

from hetserve.disagg.policy import RouterConfig
from hetserve.sim.cache import Caches, ReplicaLog
from hetserve.sim.loop import SimConfig, Simulation
from tests.sim.conftest import BS, hardware, random_records


def brute_lru_hits(records, capacity_blocks: int) -> list[int]:
    """Cached tokens of each request replayed in order through one LRU (a list, most recent
    last), blocks touched deepest first so a prompt's root ends most recent."""
    cache: list[int] = []
    hits = []
    for r in records:
        full, usable = r.hash_ids[: r.input_length // BS], (r.input_length - 1) // BS
        k = 0
        while k < usable and full[k] in cache:
            k += 1
        hits.append(k * BS)
        for b in reversed(full):
            if b in cache:
                cache.remove(b)
            cache.append(b)
            if len(cache) > capacity_blocks:
                cache.pop(0)
    return hits


@pytest.mark.parametrize("seed, cap_blocks", [(1, 6), (2, 12), (3, 40), (4, 3)])
def test_one_instance_replay_hits_equal_a_brute_force_lru(seed, cap_blocks):
    records = random_records(120, seed, gap_ms=10_000)  # far apart: one request at a time
    hw = hardware(cache_tokens=cap_blocks * BS)
    cfg = SimConfig(RouterConfig(), [hw], [hw], cache="local", block_tokens=BS)
    res = Simulation(records, cfg).run()
    assert [j.cached_tokens for j in res.jobs] == brute_lru_hits(records, cap_blocks)
    res.caches.check_integrity()


def test_lookup_matches_brute_force_over_holders():
    rng = random.Random(7)
    caches = Caches([5, 8, 3, 20], instances=3, replicas=ReplicaLog())
    for step in range(400):
        holder = rng.randrange(4)
        start = rng.randrange(3)
        blocks = list(range(start, start + rng.randint(1, 9)))
        if rng.random() < 0.5:
            caches.insert(holder, blocks, float(step))
        else:
            caches.touch(holder, blocks)
        caches.check_integrity()
        query = list(range(rng.randint(0, 2), 12))
        found, pooled = caches.lookup(query)
        for h in range(3):
            k = 0
            while k < len(query) and query[k] in caches.lru[h]:
                k += 1
            assert found.get(h, 0) == k
        k = 0
        while k < len(query) and any(query[k] in lru for lru in caches.lru):
            k += 1
        assert pooled == k


def test_replica_counts_follow_the_instances_holding_a_block():
    log = ReplicaLog()
    caches = Caches([4, 4, 4], instances=2, replicas=log)
    caches.insert(0, [1, 2], 0.0)
    caches.insert(1, [1], 10.0)
    caches.insert(2, [1], 15.0)  # a pool node: not a replica
    caches.insert(0, [5, 6, 7, 8], 20.0)  # evicts 2 then 1 from holder 0
    assert [c for _, c in log.history[1]] == [1, 2, 1]
    series = log.ranked([1], end=40.0, every=10.0)
    assert series[1] == [1, 2, 1, 1, 1]  # block 1: the most replica-seconds
