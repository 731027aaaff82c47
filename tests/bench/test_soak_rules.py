"""The soak's rules without a real server: how answers are judged, the case deck, the summary."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
import numpy as np
import pytest

from hetserve.bench.model_facts import TokenSpace
from hetserve.bench.soak.cases import BAD, CASES, DISCONNECT, GOOD, Attempt, Context, select_cases
from hetserve.bench.soak.client import (
    BAD_MISHANDLED,
    BAD_REJECTED,
    BUCKETS,
    COMPLETED,
    DISCONNECTED,
    ERROR_REPORTED,
    FAILED,
    Answer,
    judge,
    perform,
)
from hetserve.bench.soak.probe import ServerState
from hetserve.bench.soak.report import summarize
from hetserve.bench.soak.runner import Outcome, Sample, SoakRun, _Deck
from hetserve.cli import main

STREAM = Attempt("/v1/completions", b"{}", stream=True)
PLAIN = Attempt("/v1/completions", b"{}", stream=False)
BAD_400 = Attempt("/v1/completions", b"{}", stream=False, expect=(400,))
BAD_413 = Attempt("/v1/completions", b"{}", stream=False, expect=(413,))


@pytest.mark.parametrize(
    ("group", "attempt", "answer", "bucket"),
    [
        (GOOD, STREAM, Answer(status=200, done=True, chunks=3), COMPLETED),
        (GOOD, STREAM, Answer(status=200, chunks=3), FAILED),  # ended without [DONE]
        (GOOD, STREAM, Answer(status=200, error_event=True), ERROR_REPORTED),
        (GOOD, STREAM, Answer(status=200, chunks=1, problem="no answer within 5 s"), FAILED),
        (GOOD, PLAIN, Answer(status=200, choices=True), COMPLETED),
        (GOOD, PLAIN, Answer(status=200), FAILED),  # 200 without choices
        (GOOD, PLAIN, Answer(status=429, error_json=True), ERROR_REPORTED),
        (GOOD, PLAIN, Answer(status=500, error_json=True), FAILED),  # any 5xx
        (GOOD, PLAIN, Answer(problem="ServerDisconnectedError: x"), FAILED),
        (DISCONNECT, STREAM, Answer(status=200, chunks=2, cut=True), DISCONNECTED),
        (DISCONNECT, PLAIN, Answer(status=200, choices=True), COMPLETED),  # done before the cut
        (BAD, BAD_400, Answer(status=400, error_json=True), BAD_REJECTED),
        (BAD, BAD_400, Answer(status=400), BAD_MISHANDLED),  # not OpenAI error JSON
        (BAD, BAD_400, Answer(status=404, error_json=True), BAD_MISHANDLED),  # wrong status
        (BAD, BAD_400, Answer(status=200, choices=True), BAD_MISHANDLED),  # accepted
        (BAD, BAD_400, Answer(status=500), FAILED),
        (BAD, Attempt("/", b"", True, expect=(400,)), Answer(status=200), FAILED),  # hung stream
        (BAD, BAD_413, Answer(status=413, error_json=True), BAD_REJECTED),
        (BAD, BAD_413, Answer(upload_closed=True, problem="ClientOSError"), BAD_REJECTED),
        (BAD, BAD_400, Answer(upload_closed=True, problem="ClientOSError"), FAILED),
    ],
)
def test_judge_puts_each_answer_in_one_bucket(group, attempt, answer, bucket) -> None:
    got, why = judge(group, attempt, answer)
    assert got == bucket
    # The expected outcomes need no explanation; everything else says why in one line.
    clean = bucket in (COMPLETED, DISCONNECTED, BAD_REJECTED) and not answer.upload_closed
    assert (why == "") == clean


def test_every_case_comes_first_then_decks_by_weight() -> None:
    deck = _Deck(CASES, np.random.default_rng(0))
    first = [deck.draw(Counter()).name for _ in CASES]
    assert sorted(first) == sorted(c.name for c in CASES) and deck.first_round_left == 0
    size = sum(c.weight for c in CASES)
    counts = Counter(deck.draw(Counter()).name for _ in range(3 * size))
    assert counts == {c.name: 3 * c.weight for c in CASES}
    # A case at its in-flight cap is held back, never dropped; alone and capped, nothing comes.
    heavy = select_cases([c.name for c in CASES if c.max_in_flight is None])
    assert _Deck(heavy, np.random.default_rng(0)).draw(Counter({heavy[0].name: 1})) is None


def test_cases_stay_inside_vocabulary_and_context() -> None:
    ctx = Context("m", vocab_size=300, max_model_len=200, space=TokenSpace(300))
    rng = np.random.default_rng(1)
    for case in CASES:
        for _ in range(20):
            attempt = case.make(ctx, rng)
            if case.group == BAD or not isinstance(attempt.body, bytes):
                continue
            body = json.loads(attempt.body)
            assert body["max_tokens"] <= 200 - 128  # room for a 64-word prompt and a template
            prompt = body.get("prompt")
            if isinstance(prompt, list):
                assert all(10 <= t < 300 for t in prompt)
    with pytest.raises(ValueError, match="unknown case 'nope'; cases: bad-json"):
        select_cases(["nope"])


def test_oversized_body_is_chunked_valid_json_over_the_size() -> None:
    ctx = Context("m", None, None, None, oversized_bytes=1 << 20)
    (attempt,) = [
        c.make(ctx, np.random.default_rng(0)) for c in CASES if c.name.startswith("chunk")
    ]

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in attempt.body()])

    body = asyncio.run(collect())
    assert len(body) > 1 << 20 and json.loads(body)["model"] == "m"


def test_summary_counts_and_verdict() -> None:
    outcomes = [
        Outcome("completion", GOOD, COMPLETED, "", 0.0, 0.1),
        Outcome("completion", GOOD, FAILED, "HTTP 500", 0.0, 0.1),
        Outcome("bad-json", BAD, BAD_REJECTED, "", 0.0, 0.1),
        Outcome("tool-without-name", BAD, BAD_MISHANDLED, "accepted with HTTP 200", 0.0, 0.1),
    ]
    run = SoakRun(
        outcomes=outcomes,
        timeline=[Sample(0.0, 2, ServerState(kv_blocks_used=7)), Sample(1.0, 0, ServerState())],
        before=ServerState(kv_blocks_used=0, running=0),
        after=ServerState(kv_blocks_used=3, running=0),
        idle=False,
        idle_wait_s=60.0,
    )
    s = summarize(run)
    assert s["sent"] == 4 == sum(s["totals"].values())
    assert s["by_case"]["completion"] == {
        "group": GOOD, "sent": 2, **dict.fromkeys(BUCKETS, 0), COMPLETED: 1, FAILED: 1,
    }  # fmt: skip
    assert s["problems"][BAD_MISHANDLED] == {"tool-without-name: accepted with HTTP 200": 1}
    assert s["server"]["peak"]["kv_blocks_used"] == 7 and s["server"]["peak"]["rss_bytes"] is None
    assert s["server"]["kv_back_to_baseline"] is False
    assert s["verdict"] == {
        "ok": False,
        "reasons": [
            "1 failed",
            "1 bad requests not answered with a 4xx error JSON",
            "KV blocks in use 3 > 0 before, 60 s after the load",
        ],
    }


def test_cut_mid_request_and_mid_stream(fake_server) -> None:
    server = fake_server(ttft_s=0.5, itl_s=0.01)

    async def go() -> tuple[Answer, Answer]:
        async with aiohttp.ClientSession() as session:
            url = server.url + "/v1/completions"
            body = json.dumps({"prompt": [1, 2], "max_tokens": 50, "stream": True}).encode()
            early = Attempt("/v1/completions", body, True, cut_after_s=0.1)
            mid = Attempt("/v1/completions", body, True, cut_after_chunks=3)
            return (await perform(session, url, {}, early, 10.0),
                    await perform(session, url, {}, mid, 10.0))  # fmt: skip

    early, mid = asyncio.run(go())
    assert early.cut and early.chunks == 0
    assert mid.cut and mid.chunks == 3 and not mid.done


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "0"], "--concurrency must be >= 1"),
        (["--duration", "nan"], "--duration must be > 0"),
        (["--skip-cases", "bad-json,nope"], "--skip-cases: unknown case 'nope'"),
        (["--skip-cases", ",".join(c.name for c in CASES)], "leaves nothing to send"),
    ],
)
def test_bad_soak_options_exit_2_with_one_line(fake_server, capsys, args, message) -> None:
    server = fake_server()
    assert main(["bench", "soak", "--url", server.url, "--disable-tqdm", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert server.cfg.received == []


def test_an_early_413_with_connection_close_is_a_proper_rejection() -> None:
    """What a server that enforces its body limit while reading does: answer before the upload
    ends, then close. The client must read that answer, not call it a broken connection."""
    (case,) = [c for c in CASES if c.name == "chunked-oversized-body"]
    attempt = case.make(Context("m", None, None, None), np.random.default_rng(0))
    error = json.dumps({"error": {"message": "body over 8 MiB", "type": "invalid"}}).encode()

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.read(1 << 16)  # a little of the body, never all of it
        head = b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\n"
        head += b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(error)
        writer.write(head + error)
        await writer.drain()
        writer.close()

    async def go() -> Answer:
        server = await asyncio.start_server(refuse, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        async with server, aiohttp.ClientSession() as session:
            return await perform(session, url, {}, attempt, 10.0)

    assert judge(BAD, attempt, asyncio.run(go())) == (BAD_REJECTED, "")
