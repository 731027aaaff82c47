"""Metric definitions on hand-made request timings, where every value is known exactly."""

from __future__ import annotations

import pytest

from hetserve.bench.serve.client import RequestResult
from hetserve.bench.serve.metrics import compute_metrics, meets_slo, parse_slo, pick_bin
from hetserve.errors import InvalidInputError


def _req(send: float, ttft: float, itl: float, n: int, usage: bool = True) -> RequestResult:
    """A request whose n tokens arrive at send+ttft, then every itl; the stream ends at the last."""
    times = [send + ttft + i * itl for i in range(n)]
    return RequestResult(
        send_s=send,
        prompt_len=10,
        token_s=times,
        end_s=times[-1],
        output_tokens=n,
        usage_from_server=usage,
    )


def _failed(send: float, error: str) -> RequestResult:
    return RequestResult(send_s=send, prompt_len=10, end_s=send + 0.01, error=error)


def test_latency_definitions_match_vllm() -> None:
    r = _req(send=1.0, ttft=0.05, itl=0.02, n=5)
    assert r.ttft == pytest.approx(0.05)
    assert r.e2e == pytest.approx(0.05 + 4 * 0.02)
    assert r.tpot == pytest.approx(0.02)  # (E2E - TTFT) / (n - 1)
    assert r.itls == pytest.approx([0.02] * 4)
    assert _req(0.0, 0.05, 0.02, n=1).tpot is None  # undefined for one output token


def test_percentiles_throughput_and_counts() -> None:
    # TTFTs 10..100 ms over ten requests; 4 tokens each with ITL 20 ms.
    results = [_req(send=0.0, ttft=0.01 * k, itl=0.02, n=4) for k in range(1, 11)]
    end = max(r.end_s for r in results)
    m = compute_metrics(results, start_s=0.0, end_s=end)
    assert m["completed"] == 10 and m["failed"] == 0
    assert m["ttft_ms"]["mean"] == pytest.approx(55.0)
    assert m["ttft_ms"]["median"] == pytest.approx(55.0)
    assert m["ttft_ms"]["p90"] == pytest.approx(91.0)  # linear interpolation, as numpy/vLLM
    assert m["ttft_ms"]["p99"] == pytest.approx(99.1)
    assert m["tpot_ms"]["mean"] == pytest.approx(20.0)
    assert m["itl_ms"]["p99"] == pytest.approx(20.0)
    assert m["e2el_ms"]["max"] == pytest.approx(160.0)
    assert m["duration_s"] == pytest.approx(0.16)
    assert m["total_output_tokens"] == 40
    assert m["output_throughput"] == pytest.approx(40 / 0.16)
    assert m["request_throughput"] == pytest.approx(10 / 0.16)
    assert m["total_token_throughput"] == pytest.approx((100 + 40) / 0.16)


def test_goodput_needs_every_limit_and_counts_failures_as_misses() -> None:
    results = [
        _req(0.0, ttft=0.05, itl=0.02, n=5),  # meets both
        _req(0.0, ttft=0.30, itl=0.02, n=5),  # misses TTFT
        _req(0.0, ttft=0.05, itl=0.08, n=5),  # misses TPOT
        _req(0.0, ttft=0.05, itl=0.50, n=1),  # one token: TPOT counts as met
        _failed(0.0, "HTTP 500: boom"),
    ]
    m = compute_metrics(results, 0.0, 2.0, slo={"ttft": 100.0, "tpot": 50.0})
    assert m["slo_good_requests"] == 2
    assert m["slo_attainment"] == pytest.approx(2 / 5)
    assert m["goodput"] == pytest.approx(2 / 2.0)
    assert m["failed"] == 1 and m["errors"] == {"HTTP 500: boom": 1}
    assert not meets_slo(results[4], {})  # a failed request never counts


def test_failed_requests_are_left_out_of_latencies() -> None:
    results = [_req(0.0, 0.05, 0.02, 3), _failed(0.0, "x"), _failed(0.1, "x"), _failed(0.2, "y")]
    m = compute_metrics(results, 0.0, 1.0)
    assert m["errors"] == {"x": 2, "y": 1}
    assert m["ttft_ms"]["mean"] == pytest.approx(50.0)
    assert m["total_output_tokens"] == 3


def test_all_failed_gives_empty_stats_not_a_crash() -> None:
    m = compute_metrics([_failed(0.0, "refused")], 0.0, 1.0, slo={"ttft": 1.0})
    assert m["completed"] == 0 and m["ttft_ms"]["mean"] is None
    assert m["slo_attainment"] == 0.0 and m["usage_source"] is None


def test_throughput_over_time_bins_tokens_by_arrival() -> None:
    # 10 tokens in [0, 1) s and 5 in [1, 2) s.
    results = [_req(0.0, 0.05, 0.1, 10), _req(1.0, 0.05, 0.1, 5)]
    m = compute_metrics(results, 0.0, 2.0, bin_s=1.0)
    assert m["output_throughput_over_time"] == pytest.approx([10.0, 5.0])
    # A last bin cut short by the end of the run is divided by its real width (0.5 s).
    m = compute_metrics(results, 0.0, 1.5, bin_s=1.0)
    assert m["output_throughput_over_time"] == pytest.approx([10.0, 10.0])
    assert compute_metrics(results, 0.0, 2.0)["throughput_bin_s"] == 0.1  # 20 bins of 0.1 s
    assert pick_bin(3600.0) == 60.0


def test_usage_source_is_reported() -> None:
    counted = [_req(0.0, 0.05, 0.02, 3, usage=False)]
    assert "counted from stream" in compute_metrics(counted, 0.0, 1.0)["usage_source"]
    mixed = counted + [_req(0.0, 0.05, 0.02, 3, usage=True)]
    assert compute_metrics(mixed, 0.0, 1.0)["usage_source"].startswith("server for 1 of 2")


def test_parse_slo() -> None:
    assert parse_slo("ttft=200,tpot=50") == {"ttft": 200.0, "tpot": 50.0}
    assert parse_slo(" TTFT = 1.5 , e2el=3000") == {"ttft": 1.5, "e2el": 3000.0}
    assert parse_slo(None) == {}


@pytest.mark.parametrize("bad", ["ttft", "ttft=abc", "latency=5", "ttft=-1", "ttft=inf", "tpot="])
def test_parse_slo_rejects(bad: str) -> None:
    with pytest.raises(InvalidInputError, match="--slo"):
        parse_slo(bad)


def test_rejections_are_counted_among_failures() -> None:
    results = [_req(0.0, 0.05, 0.02, 3), _failed(0.0, "HTTP 429: over SLO"), _failed(0.1, "x")]
    m = compute_metrics(results, 0.0, 1.0)
    assert m["failed"] == 2 and m["rejected"] == 1


def test_a_reply_whose_one_token_has_no_text_is_an_answer() -> None:
    from hetserve.bench.serve.client import _on_chunk

    r = RequestResult(send_s=0.0, prompt_len=10)
    _on_chunk(r, {"choices": [{"text": "", "finish_reason": None}]}, False, lambda: 0.1)
    assert r.token_s == []  # no token yet: a keep-alive or a role-only chunk
    _on_chunk(r, {"choices": [{"text": "", "finish_reason": "length"}]}, False, lambda: 0.2)
    assert r.token_s == [0.2]
