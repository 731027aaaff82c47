"""The routing policy on hand-built cluster states: exact choices, ties, threshold edges."""

import math

import pytest

from hetserve.disagg.costs import (
    DecodeFit,
    DeliveryFit,
    InstanceProfile,
    PrefillFit,
    fit_decode,
    fit_prefill,
    held_out,
)
from hetserve.disagg.policy import (
    POOL,
    ClusterView,
    InstanceState,
    PrefixHolding,
    RequestInfo,
    Role,
    Router,
    RouterConfig,
)
from hetserve.kv.tier_policy import TierCost

BS = 16
# 1 ms per step + 1 ms per 10 tokens, no attention term: easy to compute by hand.
PREFILL = PrefillFit(c0=0.001, c1=0.0001, c2=0.0)
DECODE = DecodeFit(d0=0.010, d1=0.001, d2=0.0)
KV_PER_TOKEN = 1000  # bytes
TIERS = {"dram": TierCost(0.0, 1e9), "ssd": TierCost(0.001, 1e8), POOL: TierCost(0.0005, 5e8)}
PROFILE = InstanceProfile("test", PREFILL, DECODE, KV_PER_TOKEN, TIERS)


def inst(name, role=Role.PREFILL, **kw):
    return InstanceState(name, role, PROFILE, **kw)


def view(instances, holdings=None):
    holdings = holdings or {}
    return ClusterView(
        instances, {h: PrefixHolding(h, b) for h, b in holdings.items()}, block_size=BS
    )


def route(instances, req, holdings=None, **cfg):
    return Router(RouterConfig(**cfg)).decide(view(instances, holdings), req, now=0.0)


REQ = RequestInfo("r", num_tokens=1601)  # 100 full usable blocks
CLUSTER = [inst("p0"), inst("p1"), inst("d0", Role.DECODE), inst("d1", Role.DECODE)]


def test_kvcentric_prefers_the_holder_and_predicts_its_ttft():
    d = route(CLUSTER, REQ, {"p1": {"device": 60}}, policy="kvcentric")
    assert d.prefill == "p1" and d.cached_tokens == 60 * BS and d.pull is None
    assert d.predicted_ttft_s == pytest.approx(PREFILL.seconds(1601 - 960, 960))
    assert d.scores["p0"] == pytest.approx(PREFILL.seconds(1601))


def test_a_measured_delivery_adds_to_every_prediction_and_changes_no_choice():
    timed = InstanceProfile(
        "timed", PREFILL, DECODE, KV_PER_TOKEN, TIERS, delivery=DeliveryFit(0.004, 1e-6)
    )
    cluster = [InstanceState(i.name, i.role, timed) for i in CLUSTER]
    plain = route(CLUSTER, REQ, {"p1": {"device": 60}}, policy="kvcentric")
    d = route(cluster, REQ, {"p1": {"device": 60}}, policy="kvcentric")
    assert (d.prefill, d.decode, d.cached_tokens) == (
        plain.prefill,
        plain.decode,
        plain.cached_tokens,
    )
    assert d.predicted_ttft_s == pytest.approx(plain.predicted_ttft_s + 0.004 + 1e-6 * 1601)


def test_kvcentric_queue_outweighs_a_prefix():
    busy = inst("p1", queued_prefill_tokens=100_000, queued_requests=10)
    d = route([inst("p0"), busy, inst("d0", Role.DECODE)], REQ, {"p1": {"device": 60}})
    assert d.prefill == "p0" and d.cached_tokens == 0


def test_kvcentric_pulls_from_the_pool_only_past_the_balancing_margin():
    # Pulling 100 blocks from the pool: 0.5 ms + 1.6 MB / 0.5 GB/s = 3.7 ms, against 160 ms of
    # recompute: pulled, and p0 keeps them (the pull names the source).
    d = route([inst("p0"), inst("d0", Role.DECODE)], REQ, {POOL: {POOL: 100}})
    assert d.pull is not None and (d.pull.source, d.pull.tier, d.pull.blocks) == (POOL, POOL, 100)
    # A pool so slow that the pull saves less than 10% of the recompute: not taken.
    slow = InstanceProfile("slow", PREFILL, DECODE, KV_PER_TOKEN, {POOL: TierCost(0, 1.05e7)})
    p = InstanceState("p0", Role.PREFILL, slow)
    d = route([p, inst("d0", Role.DECODE)], REQ, {POOL: {POOL: 100}})
    assert d.pull is None and d.cached_tokens == 0


def test_own_lower_tier_is_loaded_when_faster_than_recompute():
    d = route([inst("p0"), inst("d0", Role.DECODE)], REQ, {"p0": {"ssd": 100}})
    assert d.pull is not None and (d.pull.source, d.pull.tier) == ("p0", "ssd")
    load = TIERS["ssd"].load_time(100 * BS * KV_PER_TOKEN)
    assert d.predicted_ttft_s == pytest.approx(load + PREFILL.seconds(1, 1600))


def test_last_token_is_never_counted_as_cached():
    req = RequestInfo("r", num_tokens=160)  # 10 full blocks: at most 9 usable
    d = route([inst("p0"), inst("d0", Role.DECODE)], req, {"p0": {"device": 10}})
    assert d.cached_tokens == 9 * BS


def test_ties_break_by_name():
    d = route(CLUSTER, REQ, policy="kvcentric")
    assert (d.prefill, d.decode) == ("p0", "d0")
    assert route(CLUSTER, REQ, policy="load").prefill == "p0"


def test_round_robin_and_random_are_deterministic():
    r = Router(RouterConfig(policy="round-robin"))
    picks = [r.decide(view(CLUSTER), REQ, 0.0).prefill for _ in range(4)]
    assert picks == ["p0", "p1", "p0", "p1"]
    a = [Router(RouterConfig(policy="random", seed=3)).decide(view(CLUSTER), REQ, 0).prefill]
    b = [Router(RouterConfig(policy="random", seed=3)).decide(view(CLUSTER), REQ, 0).prefill]
    assert a == b


def test_decode_by_predicted_tbt():
    d0 = inst("d0", Role.DECODE, running_decodes=8)
    d1 = inst("d1", Role.DECODE, running_decodes=3)
    d = route([inst("p0"), d0, d1], REQ)
    assert d.decode == "d1" and d.predicted_tbt_s == pytest.approx(DECODE.seconds(4, 1601))


def test_colocated_instance_decodes_what_it_prefilled():
    both = [inst("a", Role.BOTH), inst("b", Role.BOTH, running_decodes=0)]
    d = route(both, REQ, {"b": {"device": 50}})
    assert d.prefill == d.decode == "b"


def test_cache_aware_follows_the_prefix_until_imbalanced():
    holdings = {"p1": {"device": 60}}
    assert route(CLUSTER, REQ, holdings, policy="cache-aware").prefill == "p1"
    # Imbalanced (difference > 32 requests and ratio > 1.0001): the idlest wins.
    busy = [inst("p0"), inst("p1", queued_requests=40), inst("d0", Role.DECODE)]
    assert route(busy, REQ, holdings, policy="cache-aware").prefill == "p0"
    # Exactly 32 more: still balanced (strictly greater is needed).
    edge = [inst("p0"), inst("p1", queued_requests=32), inst("d0", Role.DECODE)]
    assert route(edge, REQ, holdings, policy="cache-aware").prefill == "p1"
    # A match under half the prompt: the instance with the most free KV.
    low = {"p1": {"device": 40}}
    roomy = [inst("p0", free_blocks=500), inst("p1", free_blocks=100), inst("d0", Role.DECODE)]
    assert route(roomy, REQ, low, policy="cache-aware").prefill == "p0"


def test_tier_credit_is_dynamos_cost():
    router = Router(RouterConfig(policy="tier-credit"))
    p0 = inst("p0", queued_prefill_tokens=320, decode_context_tokens=160)
    v = view([p0, inst("d0", Role.DECODE)], {"p0": {"device": 10, "dram": 30, "ssd": 50}})
    # queued 20 + prompt 101 - (10 * 1.0 + 20 * 0.75 + 20 * 0.25) + decode 10
    assert router._tier_cost(v, REQ, p0) == pytest.approx(20 + 101 - 30 + 10)
    a = inst("a", queued_prefill_tokens=0)
    b = inst("b", queued_prefill_tokens=0)
    d = route([a, b, inst("d0", Role.DECODE)], REQ, {"b": {"dram": 20}}, policy="tier-credit")
    assert d.prefill == "b"


def test_predictive_admission_edges_and_priority():
    slo = PREFILL.seconds(1601)
    ok = route(CLUSTER, REQ, admission="predictive", slo_ttft_s=slo)
    assert not ok.rejected  # exactly at the SLO: admitted
    tight = route(CLUSTER, REQ, admission="predictive", slo_ttft_s=slo * 0.999)
    assert tight.rejected and tight.retry_after_s == 1.0 and "TTFT" in tight.reject_reason
    low = RequestInfo("r", 1601, priority=1)
    assert route(CLUSTER, low, admission="predictive", slo_ttft_s=slo).rejected
    assert not route(CLUSTER, low, admission="predictive", slo_ttft_s=slo / 0.8).rejected
    tbt = route(CLUSTER, REQ, admission="predictive", slo_tbt_s=DECODE.seconds(1, 1601) * 0.99)
    assert tbt.rejected and "TBT" in tbt.reject_reason


def test_threshold_admission_needs_every_instance_past_it():
    full = inst("p0", queued_prefill_tokens=1000)
    free = inst("p1", queued_prefill_tokens=999)
    cfg = dict(admission="threshold", threshold_queue_tokens=1000)
    assert not route([full, free, inst("d0", Role.DECODE)], REQ, **cfg).rejected
    assert route([full, inst("d0", Role.DECODE)], REQ, **cfg).rejected


def test_no_healthy_instance_is_a_rejection_not_an_error():
    down = InstanceState("p0", Role.PREFILL, PROFILE, healthy=False)
    d = route([down, inst("d0", Role.DECODE)], REQ)
    assert d.rejected and "prefill" in d.reject_reason
    with pytest.raises(ValueError, match="policy"):
        Router(RouterConfig(policy="fastest"))


def test_fits_recover_their_coefficients_and_report_held_out_error():
    truth = PrefillFit(0.002, 3e-5, 4e-9)
    samples = [(n, c, truth.seconds(n, c)) for n in (64, 256, 1024, 4096) for c in (0, 2048, 8192)]
    fit, err = held_out(samples, fit_prefill)
    assert fit.c0 == pytest.approx(0.002, rel=1e-6) and fit.c2 == pytest.approx(4e-9, rel=1e-6)
    assert err < 1e-9
    dtruth = DecodeFit(0.01, 0.0005, 2e-7)
    dsamples = [(b, c, dtruth.seconds(b, c)) for b in (1, 4, 16) for c in (100, 10_000)]
    assert fit_decode(dsamples).d2 == pytest.approx(2e-7, rel=1e-6)
    with pytest.raises(ValueError, match="1 sample"):
        fit_prefill([])
    few = fit_prefill(samples[:2])  # fewer points than terms: the best non-negative fit of them
    assert few.seconds(*samples[0][:2]) == pytest.approx(samples[0][2], rel=0.05)
    noisy = [(n, c, s * (1.1 if i % 2 else 0.9)) for i, (n, c, s) in enumerate(samples)]
    _, noisy_err = held_out(noisy, fit_prefill)
    assert 0.0 < noisy_err < 0.25 and not math.isnan(noisy_err)
