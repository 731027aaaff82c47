"""`hetserve bench soak` against a real `hetserve serve` on the demo model.

A few seconds of mixed load (every case at least once), then the server must be whole: every
request accounted for, no failure, every bad request answered with a 4xx error JSON, no
traceback in the server's log, KV blocks back to where they were.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest

from hetserve.bench.model_facts import TokenSpace
from hetserve.bench.soak.cases import BAD, CASES, Context
from hetserve.bench.soak.client import (
    BAD_REJECTED,
    BUCKETS,
    DISCONNECTED,
    FAILED,
    judge,
    perform,
)
from hetserve.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEADERS = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def soak(demo_server, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("soak")
    rc = main(["bench", "soak", "--url", demo_server.url, "--concurrency", "6", "--duration", "3",
               "--request-timeout", "20", "--idle-timeout", "60", "--sample-interval", "0.5",
               "--json", str(out / "soak.json"), "--plot", str(out), "--disable-tqdm"])  # fmt: skip
    doc = json.loads((out / "soak.json").read_text())
    return {**doc, "rc": rc, "plot": (out / "soak.png").read_bytes()[:8]}


def test_every_request_is_counted_once(soak) -> None:
    assert soak["sent"] == sum(soak["totals"].values()) > 0
    assert set(soak["totals"]) == set(BUCKETS)
    assert {c.name for c in CASES} == set(soak["by_case"])  # every case went at least once
    for name, row in soak["by_case"].items():
        assert row["sent"] == sum(row[b] for b in BUCKETS), name
    assert soak["totals"][DISCONNECTED] >= 1
    assert soak["rc"] == (0 if soak["verdict"]["ok"] else 1)
    assert soak["plot"] == PNG_MAGIC and soak["timeline"]
    assert soak["model"] == "demo" and "vocabulary" in soak["notes"][0]


def test_kv_blocks_return_to_baseline(soak) -> None:
    server = soak["server"]
    assert server["before"]["kv_blocks_used"] is not None
    assert server["idle"] is True and server["kv_back_to_baseline"] is True
    assert server["after"]["kv_blocks_used"] <= server["before"]["kv_blocks_used"]
    assert server["after"]["running"] == server["after"]["waiting"] == 0


def test_server_memory_is_reported(soak) -> None:
    assert soak["server"]["before"]["rss_bytes"] and soak["server"]["after"]["rss_bytes"]


def test_no_request_failed(soak) -> None:
    assert soak["totals"][FAILED] == 0, soak["problems"].get(FAILED)


def test_every_bad_request_gets_a_4xx_error_json(soak) -> None:
    bad = [r for r in soak["by_case"].values() if r["group"] == BAD]
    assert sum(r[BAD_REJECTED] for r in bad) == sum(r["sent"] for r in bad), soak["problems"]


def test_server_log_has_no_traceback(soak, demo_server) -> None:
    log = demo_server.log()
    assert "Traceback" not in log, log[log.find("Traceback") :][:2000]


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.name) for c in CASES if c.group == BAD],
)
def test_bad_request_alone_gets_a_4xx_error_json(demo_server, case) -> None:
    # The demo model: vocabulary 576, served with --max-model-len 512.
    ctx = Context("demo", 576, 512, TokenSpace(576), oversized_bytes=9 << 20)
    attempt = case.make(ctx, np.random.default_rng(0))

    async def send():
        # A connection of its own: a server that drops a keep-alive connection after a 500
        # must not be blamed on the next case.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            url = demo_server.url + attempt.endpoint
            return await perform(s, url, HEADERS, attempt, timeout_s=10.0)

    bucket, why = judge(BAD, attempt, asyncio.run(send()))
    assert bucket == BAD_REJECTED, why


def test_bad_stop_token_ids_does_not_end_other_streams(demo_server) -> None:
    body = {"model": "demo", "prompt": "hello the", "max_tokens": 480, "ignore_eos": True,
            "stream": True}  # fmt: skip
    (bad_case,) = [c for c in CASES if c.name == "stop-token-id-outside-vocab"]
    bad = bad_case.make(Context("demo", 512, 512, None), np.random.default_rng(0))
    url = demo_server.url + "/v1/completions"

    async def stream(s: aiohttp.ClientSession, started: asyncio.Event) -> str:
        async with s.post(url, json=body) as resp:
            async for raw in resp.content:
                started.set()  # a first chunk: the request is running in the engine
                if raw.strip() == b"data: [DONE]":
                    return "done"
        return "ended without [DONE]"

    async def go() -> list[str | BaseException]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            started = [asyncio.Event() for _ in range(3)]
            tasks = [asyncio.create_task(stream(s, e)) for e in started]
            await asyncio.gather(*(e.wait() for e in started))
            await perform(s, url, HEADERS, bad, 20.0)
            return await asyncio.gather(*tasks, return_exceptions=True)

    assert asyncio.run(go()) == ["done"] * 3
