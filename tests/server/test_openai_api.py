"""The server through the official openai client and raw HTTP."""

import asyncio

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_model_is_retrieved_by_name_through_the_sdks(server, client):
    """`models.retrieve` was a 404 (no route) in both SDKs."""
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    assert claude.models.retrieve("tiny").id == "tiny"
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.models.retrieve("claude-x")
    assert missing.value.body["type"] == "error"
    assert "does not exist" in missing.value.body["error"]["message"]


def test_responses_carry_their_request_id_as_the_sdks_read_it(server, client):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert raw.headers["x-request-id"].startswith("chatcmpl-")
    assert raw.parse()._request_id == raw.headers["x-request-id"]
    for prompt in ("x", ["x", "y"]):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.headers["x-request-id"] == r.json()["id"]


def test_completion_usage_and_text(server, client):
    tok = server.engine.tokenizer
    r = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == len(tok.encode("hello world"))
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.choices[0].finish_reason == "length"


def test_completion_with_token_ids_and_n(client):
    r = client.completions.create(
        model="tiny",
        prompt=[[5, 6, 7, 8], [9, 10]],
        max_tokens=3,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 12


def test_streaming_matches_non_streaming(client):
    kw = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    msgs = [{"role": "user", "content": "tell me about experts"}]
    full = client.chat.completions.create(messages=msgs, **kw)
    stream = client.chat.completions.create(
        messages=msgs, stream=True, stream_options={"include_usage": True}, **kw
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content
    assert usage.completion_tokens == 12 == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens and finish == "length"

    comp = client.completions.create(prompt="abc", **kw)
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(prompt="abc", stream=True, **kw)
        if c.choices
    )
    assert text == comp.choices[0].text


def test_logprobs_stop_and_seed(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    c = client.completions.create(
        model="tiny", prompt="abc", max_tokens=3, logprobs=2, extra_body={"ignore_eos": True}
    )
    assert len(c.choices[0].logprobs.token_logprobs) == 3
    a, b = (
        client.completions.create(
            model="tiny", prompt="seeded", max_tokens=8, temperature=1.0, seed=11
        )
        .choices[0]
        .text
        for _ in range(2)
    )
    assert a == b


def test_sixteen_concurrent_requests(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        tasks = [
            aclient.completions.create(
                model="tiny",
                prompt=f"request {i}",
                max_tokens=5 + i,
                stream=(i % 2 == 0),
                stream_options={"include_usage": True} if i % 2 == 0 else None,
                extra_body={"ignore_eos": True},
            )
            for i in range(16)
        ]
        results = await asyncio.gather(*tasks)
        usages = []
        for r in results:
            if isinstance(r, openai.AsyncStream):
                usage = None
                async for chunk in r:
                    usage = chunk.usage or usage
                usages.append(usage.completion_tokens)
            else:
                usages.append(r.usage.completion_tokens)
        await aclient.close()
        return usages

    assert asyncio.run(main()) == [5 + i for i in range(16)]
    assert server.wait_idle().kv_blocks_used == 0


BAD = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "x", "model": "gpt-17"}, 404),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": [999999]}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400),
    ("/v1/completions", {"prompt": list(range(300))}, 400),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", [1, 2, 3], 400),
]


@pytest.mark.parametrize("path,body,status", BAD)
def test_bad_input_gets_openai_error(server, path, body, status):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.wait_idle().kv_blocks_used == 0


def test_oversized_body_is_rejected(server):
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"x" * (9 << 20),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"prompt": "a long story", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert server.engine.stats().kv_blocks_used > 0
    stats = server.wait_idle()
    assert stats.num_running == 0 and stats.kv_blocks_used == 0


def test_metrics_exposes_engine_and_latency(server, client):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "hetserve_num_requests_running",
        "hetserve_kv_blocks_used",
        "hetserve_prefix_cache_hit_rate",
        "hetserve_time_to_first_token_seconds_count",
        "hetserve_inter_token_latency_seconds_count",
        "hetserve_e2e_request_latency_seconds_count",
        "hetserve_generation_tokens_total",
    ):
        assert name in text, name


def test_api_key_auth(engine):
    srv = LiveServer(engine, api_key="s3cret")
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=1).choices
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()


def test_serve_refuses_public_bind_without_key(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetserve.cli",
            "serve",
            "--host",
            "0.0.0.0",
            "--model",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "API key" in r.stderr and "Traceback" not in r.stderr


def test_chat_cli_against_server(server):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "hetserve.cli", "chat", "--url", server.url, "--max-tokens", "5"],
        input="hello\nhow are you\n\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) >= 1 and "Traceback" not in r.stderr


def test_chat_cli_goes_on_when_the_conversation_fills_the_context(tiny_model):
    """The whole session ended (exit 2) when a turn no longer fitted; now it says so and waits
    for /clear, which starts over; an unknown /command says it is unknown."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "hetserve.cli", "chat", "--model", str(tiny_model("qwen3-moe")),
         "--max-model-len", "48"],
        input="hello there how are you\nmore\n/bogus\n/clear\nhi\n",
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "no longer fits the context; /clear starts" in r.stderr
    assert "unknown command /bogus" in r.stderr
    replies = [ln for ln in r.stdout.splitlines() if ln.startswith("eval count:")]
    assert len(replies) == 2  # the first turn and the one after /clear


def test_chat_cli_unreachable_server_is_one_line_error():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "hetserve.cli", "chat", "--url", "http://127.0.0.1:9"],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "cannot reach" in r.stderr and "Traceback" not in r.stderr


def test_streamed_logprobs_match_non_streamed(client):
    kw = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt="abc", logprobs=2, **kw)
    streamed = []
    for chunk in client.completions.create(prompt="abc", logprobs=2, stream=True, **kw):
        for ch in chunk.choices:
            if ch.logprobs:
                streamed += ch.logprobs.token_logprobs
    assert streamed == pytest.approx(full.choices[0].logprobs.token_logprobs)
    msgs = [{"role": "user", "content": "x"}]
    chat_full = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=1, **kw)
    chat_streamed = []
    for chunk in client.chat.completions.create(
        messages=msgs, logprobs=True, top_logprobs=1, stream=True, **kw
    ):
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                chat_streamed += [c.logprob for c in ch.logprobs.content]
    assert chat_streamed == pytest.approx(
        [c.logprob for c in chat_full.choices[0].logprobs.content]
    )


def test_echo_returns_prompt_and_its_logprobs(client, server):
    r = client.completions.create(
        model="tiny",
        prompt="hello world",
        max_tokens=3,
        echo=True,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    plain = client.completions.create(
        model="tiny",
        prompt="hello world",
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    assert choice.text.startswith("hello world")
    n_prompt = len(server.engine.tokenizer.encode("hello world"))
    lps = choice.logprobs.token_logprobs
    assert len(lps) == n_prompt + 3 and lps[0] is None and all(x is not None for x in lps[1:])
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny",
            prompt="hello world",
            max_tokens=3,
            echo=True,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if c.choices
    )
    assert streamed == "hello world" + plain.choices[0].text


def test_echo_logprobs_streamed_equal_the_whole_answer(client):
    """With echo, the stream's first chunk carries the prompt's logprobs and offsets too, and
    every later offset counts the echoed prompt, as the non-streamed answer does."""
    args = dict(model="tiny", prompt="hello world", max_tokens=4, echo=True, logprobs=1,
                temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**args).choices[0].logprobs
    tokens, lps, offsets = [], [], []
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert tokens == whole.tokens
    assert lps[0] is None and lps[1:] == pytest.approx(whole.token_logprobs[1:])
    assert offsets == whole.text_offset
