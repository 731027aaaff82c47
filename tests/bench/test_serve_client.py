"""The client and runner against the fake server (tests/bench/conftest.py), over real HTTP.

The fake server sends the first token 50 ms after a request arrives and then one every 20 ms.
Sleeps only ever run late on a loaded machine, so lower bounds are tight and upper bounds loose;
exactness is checked on values recomputed from the recorded timestamps and with a scripted clock.
"""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from hetserve.bench.model_facts import TokenSpace
from hetserve.bench.serve.client import build_payload, send_request
from hetserve.bench.serve.datasets import random_workload
from hetserve.bench.serve.metrics import compute_metrics
from hetserve.bench.serve.runner import RunConfig, arrival_offsets, run_benchmark
from hetserve.bench.serve.workload import BenchRequest, Workload

SLACK = 0.5  # seconds a sleep may run late on a shared 2-core machine


def _run(server, workload: Workload, **cfg):
    run = RunConfig(
        base_url=server.url,
        endpoint=cfg.pop("endpoint", "/v1/completions"),
        model="fake",
        progress=False,
        **cfg,
    )
    return asyncio.run(run_benchmark(workload, run))


def _workload(n: int, output_len: int) -> Workload:
    return random_workload(n, 16, output_len, 0.0, 0.0, TokenSpace(100), seed=0)


def test_timings_match_the_servers_known_schedule(fake_server) -> None:
    server = fake_server(ttft_s=0.05, itl_s=0.02)
    results, start, end = _run(server, _workload(4, output_len=6), request_rate=20.0)
    m = compute_metrics(results, start, end, slo={"ttft": 50_000.0, "tpot": 50_000.0})
    assert m["completed"] == 4 and m["failed"] == 0
    assert m["total_output_tokens"] == 24 and m["usage_source"] == "server"
    for r in results:
        assert len(r.token_s) == 6
        assert 0.05 - 0.002 <= r.ttft <= 0.05 + SLACK
        # Token k cannot arrive before the server wrote it: ttft + k * itl after the send. (One
        # gap alone has no lower bound: a token read late makes the next gap look short.)
        assert all(t - r.send_s >= 0.05 + k * 0.02 - 0.002 for k, t in enumerate(r.token_s))
    assert 20.0 - 2 <= m["itl_ms"]["median"] <= 20.0 + 1000 * SLACK
    assert 20.0 - 2 <= m["tpot_ms"]["median"] <= 20.0 + 1000 * SLACK
    # The summaries are exactly the statistics of the recorded timestamps.
    assert m["ttft_ms"]["mean"] == pytest.approx(1000 * np.mean([r.ttft for r in results]))
    itls = [g for r in results for g in r.itls]
    assert m["itl_ms"]["p90"] == pytest.approx(1000 * np.percentile(itls, 90))
    assert m["output_throughput"] == pytest.approx(24 / (end - start))
    assert m["goodput"] == pytest.approx(4 / (end - start))  # generous SLO: all four are good


def test_scripted_clock_gives_exact_metrics(fake_server) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.0)
    ticks = iter([10.0, 10.05, 10.07, 10.09, 10.10])  # send, three tokens, end of stream
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 3, "stream": True}

    async def go():
        async with aiohttp.ClientSession() as s:
            return await send_request(
                s, server.url + "/v1/completions", {}, body, 2, clock=lambda: next(ticks)
            )

    r = asyncio.run(go())
    assert r.ok and r.output_tokens == 3
    assert r.ttft == pytest.approx(0.05) and r.e2e == pytest.approx(0.10)
    assert r.itls == pytest.approx([0.02, 0.02])
    assert r.tpot == pytest.approx(0.025)  # (0.10 - 0.05) / (3 - 1)
    m = compute_metrics([r], 10.0, 10.10, slo={"ttft": 60.0, "tpot": 24.0})
    assert m["ttft_ms"]["mean"] == pytest.approx(50.0) and m["slo_good_requests"] == 0


def test_server_without_usage_is_counted_from_the_stream(fake_server) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.0, omit_usage=True)
    results, start, end = _run(server, _workload(3, output_len=5), endpoint="/v1/chat/completions")
    assert all(r.ok and not r.usage_from_server and r.output_tokens == 5 for r in results)
    m = compute_metrics(results, start, end)
    assert m["total_output_tokens"] == 15
    assert "counted from stream" in m["usage_source"]
    assert all("messages" in b for b in server.cfg.received)  # chat endpoint sends messages


def test_server_errors_are_counted_not_fatal(fake_server) -> None:
    server = fake_server(
        ttft_s=0.0, itl_s=0.0, fail_every=3, fail_midstream_every=4, malformed_every=5
    )
    results, start, end = _run(server, _workload(12, output_len=3))
    m = compute_metrics(results, start, end)
    assert m["requests"] == 12
    # Requests 3, 6, 9, 12 get HTTP 500; 4 and 8 break after their first token; 5 and 10 send
    # a chunk that is not OpenAI's.
    assert m["failed"] == 8 and m["completed"] == 4
    assert sum(n for e, n in m["errors"].items() if e.startswith("HTTP 500")) == 4
    assert sum(n for e, n in m["errors"].items() if "midstream" in e) == 2
    assert sum(n for e, n in m["errors"].items() if "malformed" in e) == 2


def test_unreachable_server_fails_each_request(fake_server) -> None:
    server = fake_server()
    server.stop()  # nothing listens on the port any more
    results, start, end = _run(server, _workload(2, 3))
    assert [r.ok for r in results] == [False, False]
    assert all("Connect" in r.error for r in results)


def test_api_key_is_sent_as_bearer(fake_server) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.0, api_key="sekret")
    ok, _, _ = _run(server, _workload(1, 2), api_key="sekret")
    bad, _, _ = _run(server, _workload(1, 2), api_key="wrong")
    assert ok[0].ok and bad[0].error.startswith("HTTP 401")


def test_max_concurrency_caps_requests_in_flight(fake_server) -> None:
    server = fake_server(ttft_s=0.03, itl_s=0.01)
    results, _, _ = _run(server, _workload(8, 3), max_concurrency=2)
    assert all(r.ok for r in results)
    assert server.cfg.peak_concurrency == 2


def test_multiturn_resends_the_growing_history(fake_server) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.0)
    turns = [BenchRequest(prompt_len=2, output_len=2, text=f"question {i}") for i in range(3)]
    _run(server, Workload("multiturn", [turns], ignore_eos=False), endpoint="/v1/chat/completions")
    sent = [b["messages"] for b in server.cfg.received]
    assert [len(m) for m in sent] == [1, 3, 5]
    assert sent[2][:4] == [
        {"role": "user", "content": "question 0"},
        {"role": "assistant", "content": "t0 t1 "},
        {"role": "user", "content": "question 1"},
        {"role": "assistant", "content": "t0 t1 "},
    ]
    assert all("ignore_eos" not in b for b in server.cfg.received)


def test_trace_arrivals_follow_timestamps_and_time_scale(fake_server) -> None:
    reqs = [BenchRequest(4, 2, token_ids=[11] * 4, arrival_s=t) for t in (5.0, 5.2, 5.6)]
    w = Workload("mooncake-trace", [[r] for r in reqs], ignore_eos=True)
    offsets, how = arrival_offsets(w, None, 0, time_scale=0.5)
    assert offsets == pytest.approx([0.0, 0.1, 0.3]) and "trace" in how
    server = fake_server(ttft_s=0.0, itl_s=0.0)
    results, start, _ = _run(server, w, time_scale=0.5)
    sends = sorted(r.send_s - start for r in results)
    assert all(o - 0.002 <= s <= o + SLACK for o, s in zip([0.0, 0.1, 0.3], sends, strict=True))


def test_poisson_arrivals_are_seeded_with_the_requested_mean() -> None:
    w = _workload(2000, 1)
    a, how = arrival_offsets(w, 4.0, seed=7, time_scale=1.0)
    b, _ = arrival_offsets(w, 4.0, seed=7, time_scale=1.0)
    c, _ = arrival_offsets(w, 4.0, seed=8, time_scale=1.0)
    assert a == b and a != c and how == "Poisson 4 req/s" and a[0] == 0.0
    gaps = np.diff(a)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.1)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: std equals the mean
    assert arrival_offsets(w, float("inf"), 0, 1.0)[0] == [0.0] * 2000


def test_base_url_with_or_without_v1() -> None:
    for base in ("http://h:1", "http://h:1/", "http://h:1/v1"):
        assert RunConfig(base, "/v1/completions", "m").url == "http://h:1/v1/completions"


def test_completions_multiturn_flattens_history(fake_server) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.0)
    turns = [BenchRequest(prompt_len=2, output_len=2, text=f"q{i}") for i in range(2)]
    _run(server, Workload("multiturn", [turns], ignore_eos=False))
    first, second = (b["prompt"] for b in server.cfg.received)
    assert first == "user: q0\nassistant:"
    assert second == "user: q0\nassistant: t0 t1 \nuser: q1\nassistant:"
    assert second.startswith(first)  # each turn extends the last: the prefix-cache workload
    single = build_payload(
        "/v1/completions",
        "m",
        BenchRequest(1, 1, text="x"),
        None,
        Workload("w", [], ignore_eos=False),
        ignore_eos=False,
    )
    assert single["prompt"] == "x" and "messages" not in single and "ignore_eos" not in single


def test_fake_server_speaks_the_format_the_openai_client_reads(fake_server) -> None:
    """Anchors the fake to the reference client, so these tests do not grade our own format."""
    openai = pytest.importorskip("openai")
    server = fake_server(ttft_s=0.0, itl_s=0.0)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k")
    chunks = list(
        client.completions.create(
            model="m",
            prompt=[11, 12],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "t0 t1 t2 "
    assert chunks[-1].usage.completion_tokens == 3
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "q"}], max_tokens=2, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == "t0 t1 "


def test_itl_per_token_spreads_a_chunk_of_several_tokens() -> None:
    """A chunk whose text waited for more tokens (an incomplete UTF-8 sequence) spans their
    steps: with usage in every chunk its gap counts once per token."""
    from hetserve.bench.serve.client import RequestResult

    r = RequestResult(send_s=0.0, prompt_len=1, token_s=[1.0, 1.1, 1.5], chunk_tokens=[1, 1, 4])
    assert r.itls == pytest.approx([0.1, 0.4])
    assert r.token_itls == pytest.approx([0.1] * 5)
    r.chunk_tokens = []  # no usage per chunk: the chunks' gaps
    assert r.token_itls == pytest.approx([0.1, 0.4])
