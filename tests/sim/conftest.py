"""Small traces and clusters for the simulator's tests."""

from __future__ import annotations

import random

import pytest

from hetserve.core.trace_record import TraceRecord
from hetserve.disagg.costs import DecodeFit, InstanceProfile, PrefillFit
from hetserve.disagg.policy import POOL
from hetserve.kv.tier_policy import TierCost
from hetserve.sim.hardware import Hardware

BS = 4  # tokens per block: small traces share prefixes quickly


def hardware(cache_tokens: int = 64, device_tokens: int = 10_000, name: str = "toy") -> Hardware:
    profile = InstanceProfile(
        name,
        PrefillFit(c0=0.01, c1=0.001, c2=1e-6),
        DecodeFit(d0=0.02, d1=0.002, d2=1e-5),
        kv_bytes_per_token=1000,
        tiers={"dram": TierCost(0.0, 1e9), POOL: TierCost(0.001, 1e8)},
    )
    return Hardware(name, profile, cache_tokens, device_tokens, TierCost(0.001, 1e8), 2.0)


def random_records(n: int, seed: int, gap_ms: float = 50.0, roots: int = 5) -> list[TraceRecord]:
    """Requests that extend a few conversations: shared roots, growing prefixes."""
    rng = random.Random(seed)
    convs: list[list[int]] = [[1000 * r] for r in range(roots)]
    next_id = 1
    out = []
    t = 0.0
    for _ in range(n):
        conv = rng.choice(convs)
        conv.extend(range(next_id, next_id + rng.randint(1, 3)))
        next_id += 4
        ids = tuple(conv)
        length = (len(ids) - 1) * BS + rng.randint(1, BS)
        out.append(TraceRecord(t, length, rng.randint(1, 12), ids, block_size=BS))
        t += rng.expovariate(1.0 / gap_ms)
    return out


@pytest.fixture
def toy() -> Hardware:
    return hardware()
