"""Presets against the published figures they are derived from; profiles read from JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hetserve.disagg.costs import profile_to_dict
from hetserve.errors import InvalidInputError
from hetserve.sim import hardware as hwm
from tests.sim.conftest import hardware


def test_llama70b_prefill_is_the_papers_equation_1():
    prof = hwm.llama3_70b_a800().profile
    g = 8 * 312e12 * hwm.MFU

    def flops(n):  # Mooncake FAST'25, Eq. 1
        return hwm.L * (hwm.A * n * n * hwm.D + hwm.B * n * hwm.D**2)

    for n, p in ((8192, 0), (16384, 8192), (100_000, 60_000)):
        seconds = prof.prefill.seconds(n - p, p) - prof.prefill.c0
        assert seconds == pytest.approx((flops(n) - flops(p)) / g, rel=1e-12)
    assert prof.kv_bytes_per_token == 327_680  # "320 KB" per token (Sec. 5.3.1)


def test_reuse_pays_off_from_the_papers_bandwidth():
    """Eq. 2's example: for an 8,192-token prefix on 8 x A800 at peak, loading KV beats
    recomputing it from about 6 GB/s."""
    prof = hwm.llama3_70b_a800().profile
    p = 8192
    # Computing the prefix's tokens at peak (what reusing them saves), c0 cancelled out.
    saved_at_peak = (prof.prefill.seconds(p + 1, 0) - prof.prefill.seconds(1, p)) * hwm.MFU
    needed = p * prof.kv_bytes_per_token / saved_at_peak  # bytes per second to break even
    assert needed == pytest.approx(6e9, rel=0.05)


def test_ktransformers_preset_fits_its_published_speeds():
    prof = hwm.deepseek_v3_ktransformers().profile
    for n, (prefill_tps, decode_tps) in hwm.KT_PUBLISHED.items():
        assert n / prof.prefill.seconds(n) == pytest.approx(prefill_tps, rel=0.15)
        step = prof.decode.seconds(1, n + (5 if n < 10 else 150))
        assert 1 / step == pytest.approx(decode_tps, rel=0.05)
    assert prof.prefill_fit_error is not None and prof.prefill_fit_error < 0.1
    assert prof.kv_bytes_per_token == 70_272


def test_every_preset_resolves_and_a_name_that_is_not_one_is_an_error():
    for name in hwm.PRESETS:
        assert hwm.resolve(name).name == name
    with pytest.raises(InvalidInputError, match="not a preset"):
        hwm.resolve("tpu-v9")


def test_a_profile_file_with_and_without_capacity(tmp_path):
    prof = hardware().profile
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_to_dict(prof, capacity={"device_kv_tokens": 5000})))
    hw = hwm.resolve(str(path))
    assert hw.profile == prof and hw.device_kv_tokens == 5000 and hw.host_cache_tokens == 3_000_000
    path.write_text(json.dumps(profile_to_dict(prof, capacity={"host_kv_tokens": -1})))
    with pytest.raises(InvalidInputError, match="capacity.host_kv_tokens"):
        hwm.resolve(str(path))
    path.write_text(json.dumps({"format": "hetserve-profile"}))
    with pytest.raises(InvalidInputError, match="missing field"):
        hwm.resolve(str(path))


def test_a_profile_without_a_host_tier_caches_in_its_device_pool(tmp_path):
    # A hetserve instance served without a KV store: its prefix cache is the device pool, read
    # at no cost, as large as the pool (what its live prefix hits come from).
    prof = hardware().profile
    bare = dataclasses.replace(prof, tiers={k: v for k, v in prof.tiers.items() if k != "dram"})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_to_dict(bare, capacity={"device_kv_tokens": 5000})))
    hw = hwm.resolve(str(path))
    assert (hw.cache_tier, hw.host_cache_tokens) == ("device", 5000)
    assert hwm.resolve(str(path)).profile.load_seconds(hw.cache_tier, 4096) == 0.0
    path.write_text(json.dumps(profile_to_dict(prof)))  # with a DRAM tier: Mooncake's nodes
    assert hwm.resolve(str(path)).cache_tier == "dram"


def test_device_pool_hits_are_predicted(tmp_path):
    from hetserve.disagg.policy import RouterConfig
    from hetserve.sim.loop import SimConfig, Simulation
    from tests.sim.test_cli import synthetic_log

    prof = hardware().profile
    bare = dataclasses.replace(prof, tiers={})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_to_dict(bare, capacity={"device_kv_tokens": 100_000})))
    box = hwm.resolve(str(path))
    records = synthetic_log(tmp_path, 60, seed=5)  # conversations: each turn extends the last
    cfg = SimConfig(RouterConfig(), [box], [box], cache="local", block_tokens=16)
    jobs = Simulation(records, cfg).run().jobs
    assert sum(j.cached_tokens for j in jobs) > 0
