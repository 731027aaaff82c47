"""The decode side read at the moment a request would reach it (`decode_changes`)."""

import pytest

from hetserve.disagg.costs import DecodeFit, InstanceProfile, PrefillFit
from hetserve.disagg.policy import (
    ClusterView,
    InstanceState,
    RequestInfo,
    Role,
    Router,
    RouterConfig,
)

PREFILL = PrefillFit(c0=0.0, c1=0.001, c2=0.0)  # 1 ms a token: TTFT of 100 tokens = 0.1 s
DECODE = DecodeFit(d0=0.010, d1=0.001, d2=0.0)
PROFILE = InstanceProfile("t", PREFILL, DECODE, 1000)
REQ = RequestInfo("r", num_tokens=100)
NOW = 50.0  # the caller's clock; arrival at prefill end = 50.1


def decide(decodes, **cfg):
    p0 = InstanceState("p0", Role.PREFILL, PROFILE)
    view = ClusterView([p0, *decodes], {}, block_size=16)
    return Router(RouterConfig(**cfg)).decide(view, REQ, NOW)


def test_finishes_before_arrival_count_and_later_ones_do_not():
    # d0 runs 8 now, 6 of them forecast to finish before this request arrives (50.1); one
    # more finishes after. d1 runs 4 with nothing forecast.
    d0 = InstanceState(
        "d0", Role.DECODE, PROFILE, running_decodes=8,
        decode_changes=((50.05, -6, -600), (50.2, -1, -100)),
    )  # fmt: skip
    d1 = InstanceState("d1", Role.DECODE, PROFILE, running_decodes=4)
    d = decide([d0, d1])
    assert d.decode == "d0" and d.predicted_tbt_s == pytest.approx(DECODE.seconds(3, 100))
    # Without the forecast the load now decides: d1.
    plain = InstanceState("d0", Role.DECODE, PROFILE, running_decodes=8)
    assert decide([plain, d1]).decode == "d1"


def test_arrivals_forecast_from_prefill_can_reject():
    busy = InstanceState(
        "d0", Role.DECODE, PROFILE, running_decodes=2, decode_changes=((50.0, 10, 5000),)
    )
    slo = DECODE.seconds(4, 100)  # fine for the load now, not for the 10 arriving first
    d = decide([busy], admission="predictive", slo_tbt_s=slo)
    assert d.rejected and "TBT" in d.reject_reason
    now_only = InstanceState("d0", Role.DECODE, PROFILE, running_decodes=2)
    assert not decide([now_only], admission="predictive", slo_tbt_s=slo).rejected
