"""The profile JSON format: round trip, and every bad field named."""

import json
import math
from dataclasses import replace

import pytest

from hetserve.disagg.costs import (
    DecodeFit,
    DeliveryFit,
    InstanceProfile,
    PrefillFit,
    fit_delivery,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)
from hetserve.kv.tier_policy import TierCost

PROFILE = InstanceProfile(
    "box",
    PrefillFit(0.01, 9.5e-5, 4.2e-9),
    DecodeFit(0.012, 5.7e-5, 2.9e-8),
    327680,
    {"dram": TierCost(0.0, 1.28e11), "pool": TierCost(0.001, 8.7e10)},
    prefill_fit_error=0.03,
)


def test_round_trip_through_a_file(tmp_path):
    path = tmp_path / "p.json"
    save_profile(str(path), PROFILE, capacity={"device_kv_tokens": 1000}, machine={"cpu": "x"})
    loaded, raw = load_profile(str(path))
    assert loaded == PROFILE
    assert raw["capacity"] == {"device_kv_tokens": 1000} and raw["decode"]["fit_error"] is None


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.pop("kv_bytes_per_token"), "kv_bytes_per_token"),
        (lambda d: d["prefill"].update(c1=-1.0), "profile.prefill.c1"),
        (lambda d: d["decode"].pop("d2"), "profile.decode.d2"),
        (lambda d: d["tiers"]["pool"].update(bandwidth=0), "profile.tiers.pool.bandwidth"),
        (lambda d: d["tiers"].update(ssd="fast"), "profile.tiers.ssd"),
        (lambda d: d.update(colour="red"), "colour"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d["prefill"].update(c0=True), "profile.prefill.c0"),
    ],
)
def test_bad_fields_are_named(edit, field):
    data = json.loads(json.dumps(profile_to_dict(PROFILE)))
    edit(data)
    with pytest.raises(ValueError, match=field):
        profile_from_dict(data)


def test_unreadable_files_name_the_path(tmp_path):
    with pytest.raises(ValueError, match="missing.json"):
        load_profile(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not JSON"):
        load_profile(str(bad))


def test_an_unmeasured_fit_error_is_written_as_null(tmp_path):
    path = tmp_path / "p.json"
    save_profile(str(path), replace(PROFILE, prefill_fit_error=math.nan))
    assert '"fit_error": null' in path.read_text() and "NaN" not in path.read_text()
    loaded, _ = load_profile(str(path))
    assert loaded.prefill_fit_error is None
    data = json.loads(path.read_text())
    data["prefill"]["fit_error"] = math.nan  # a file written by an older version
    assert profile_from_dict(data).prefill_fit_error is None


def test_a_delivery_fit_round_trips_and_is_checked(tmp_path):
    timed = replace(PROFILE, delivery=DeliveryFit(0.005, 7e-6, 0.001))
    path = tmp_path / "p.json"
    save_profile(str(path), timed)
    assert load_profile(str(path))[0] == timed
    data = profile_to_dict(timed)
    data["delivery"]["per_token_s"] = -1.0
    with pytest.raises(ValueError, match="profile.delivery.per_token_s"):
        profile_from_dict(data)
    assert "delivery" not in profile_to_dict(PROFILE)  # an engine-only profile has none


def test_fit_delivery_recovers_a_line_and_needs_two_samples():
    fit = fit_delivery([(n, 0.004 + 5e-6 * n) for n in (16, 256, 1024, 2048)])
    assert fit.overhead_s == pytest.approx(0.004) and fit.per_token_s == pytest.approx(5e-6)
    assert fit.seconds(100) == pytest.approx(0.0045)
    # Noise below the compute prediction cannot make a term negative.
    assert min(fit_delivery([(16, -0.002), (2048, 0.001)]).__dict__.values()) >= 0
    with pytest.raises(ValueError, match="at least 2"):
        fit_delivery([(16, 0.01)])


def test_a_hybrid_models_state_rides_with_every_load_and_hand_off():
    """Linear-attention models: a prefix resumes from its state checkpoint, read with its KV,
    so a load costs the state's bytes beside the tokens'; the field round-trips and is
    written only where it is not zero."""
    hybrid = replace(PROFILE, state_bytes_per_request=75 << 20)
    assert hybrid.kv_bytes(100) == 100 * 327680 + (75 << 20)
    dram = PROFILE.tiers["dram"]
    assert hybrid.load_seconds("dram", 100) == pytest.approx(dram.load_time(hybrid.kv_bytes(100)))
    assert hybrid.load_seconds("dram", 100) > PROFILE.load_seconds("dram", 100)
    assert hybrid.load_seconds("dram", 0) == 0.0  # nothing cached: nothing read
    assert profile_from_dict(json.loads(json.dumps(profile_to_dict(hybrid)))) == hybrid
    assert "state_bytes_per_request" not in profile_to_dict(PROFILE)
    data = profile_to_dict(hybrid)
    data["state_bytes_per_request"] = -1
    with pytest.raises(ValueError, match="profile.state_bytes_per_request"):
        profile_from_dict(data)


def test_the_profiler_counts_one_sequences_state(tiny_model):
    from hetserve import LLM
    from hetserve.disagg.profiler import Plan, measure

    for family, has_state in (("qwen3-next", True), ("qwen3-moe", False)):
        engine = LLM(str(tiny_model(family)), max_model_len=160, placement="device").engine
        profile, _ = measure(engine, Plan((32, 64), (0, 32), (1, 2), (64,), 2, 1))
        state = engine.runner.state
        want = sum(t[0].nbytes for layer in state.layers for t in layer) if has_state else 0
        assert profile.state_bytes_per_request == want
        assert (want > 0) == has_state
