"""The server as a hostile client meets it: every defect of the fault-isolation issue has a test.

A dedicated engine whose forward pass fails for any batch holding the POISON token (and can be
slowed down) lets each engine error path be driven through HTTP.
"""

import json
import logging
import threading
import time

import httpx
import pytest

from hetserve.config import EngineConfig
from hetserve.engine.async_llm import AsyncLLM
from tests.server.conftest import LiveServer

POISON = 499  # a prompt starting [3, POISON] fails in the forward pass, batched or alone
DONE = "data: [DONE]"


@pytest.fixture(scope="module")
def hooks():
    return {"delay": 0.0, "fail_all": False}


@pytest.fixture(scope="module")
def srv(tiny_model, hooks):
    engine = AsyncLLM(
        EngineConfig(model=str(tiny_model("qwen3-moe", lm_head_scale=4.0)), max_model_len=1024)
    )
    forward = engine.engine.runner.forward

    def hooked(seqs):
        if hooks["fail_all"] or any(
            s.num_computed == 0 and s.token_ids[:2] == [3, POISON] for s in seqs
        ):
            raise RuntimeError("injected fault")
        if hooks["delay"]:
            time.sleep(hooks["delay"])
        return forward(seqs)

    engine.engine.runner.forward = hooked
    server = LiveServer(engine)
    yield server
    server.stop()
    engine.shutdown()


@pytest.fixture(autouse=True)
def reset(hooks, srv):
    hooks.update(delay=0.0, fail_all=False)
    yield
    hooks.update(delay=0.0, fail_all=False)
    assert srv.wait_idle().kv_blocks_used == 0


def post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def sse_lines(srv, path, body) -> list[str]:
    with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


def stream_in_thread(srv, path, body, out: list):
    t = threading.Thread(target=lambda: out.append(sse_lines(srv, path, body)))
    t.start()
    return t


CHAT = {"messages": [{"role": "user", "content": "tell me"}], "stream": True}


# ---- 1. one bad request must not touch the others -----------------------------------------------
def test_bad_stop_token_ids_is_400_and_live_streams_finish(srv, hooks):
    hooks["delay"] = 0.01
    results: list = []
    body = CHAT | {"max_tokens": 40, "ignore_eos": True}
    threads = [stream_in_thread(srv, "/v1/chat/completions", body, results) for _ in range(3)]
    time.sleep(0.2)
    bad = {"prompt": "hello", "max_tokens": 8, "min_tokens": 4, "stop_token_ids": [10**9]}
    r = post(srv, "/v1/completions", bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    for t in threads:
        t.join()
    for lines in results:
        assert lines[-1] == DONE and not any('"error"' in line for line in lines)
        finish = [json.loads(x[6:])["choices"] for x in lines[:-1]]
        assert finish[-1][0]["finish_reason"] == "length"


# ---- 2 and 5. every engine error path ends the stream, or answers JSON ----------------------
def test_engine_fault_ends_completion_stream_with_error_event(srv, hooks):
    hooks["delay"] = 0.005
    others: list = []
    good = {"prompt": [5, 6, 7], "max_tokens": 30, "ignore_eos": True, "stream": True}
    t = stream_in_thread(srv, "/v1/completions", good, others)
    lines = sse_lines(srv, "/v1/completions", good | {"prompt": [3, POISON, 7]})
    t.join()
    assert lines[-1] == DONE
    err = json.loads(lines[-2][6:])["error"]
    assert "injected fault" in err["message"] and err["type"] == "server_error"
    assert others[0][-1] == DONE and not any('"error"' in x for x in others[0])


def test_engine_fault_in_one_of_several_prompts(srv):
    body = {"prompt": [[5, 6], [3, POISON]], "max_tokens": 5, "stream": True}
    lines = sse_lines(srv, "/v1/completions", body)
    assert lines[-1] == DONE and '"error"' in lines[-2]
    r = post(srv, "/v1/completions", body | {"stream": False})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"


@pytest.mark.parametrize("stream", [True, False])
def test_engine_fault_in_chat(srv, hooks, stream):
    hooks["fail_all"] = True
    body = CHAT | {"stream": stream, "max_tokens": 5}
    if stream:
        lines = sse_lines(srv, "/v1/chat/completions", body)
        assert lines[-1] == DONE and "injected fault" in lines[-2]
    else:
        r = post(srv, "/v1/chat/completions", body)
        assert r.status_code == 500
        assert "chatcmpl-" in r.json()["error"]["message"]  # names the request id


def test_failure_while_adding_ends_the_stream(srv, monkeypatch):
    core = srv.engine.engine
    enqueue = core.enqueue

    def faulty(new, stream=True):
        if new.prompt_token_ids[:2] == [9, 9]:
            raise RuntimeError("injected add fault")
        return enqueue(new, stream)

    monkeypatch.setattr(core, "enqueue", faulty)
    lines = sse_lines(srv, "/v1/completions", {"prompt": [9, 9, 1], "stream": True})
    assert lines[-1] == DONE and "injected add fault" in lines[-2]


def test_bug_in_chunk_formatting_ends_the_stream(srv, monkeypatch):
    from hetserve.server.completions import CompletionServing

    def broken(*args, **kwargs):
        raise KeyError("formatting bug")

    monkeypatch.setattr(CompletionServing, "completion_logprobs", broken)
    body = {"prompt": [5, 6], "max_tokens": 4, "logprobs": 1, "stream": True}
    lines = sse_lines(srv, "/v1/completions", body)
    assert lines[-1] == DONE and json.loads(lines[-2][6:])["error"]["type"] == "server_error"


def test_dead_engine_ends_streams_and_health_says_so(tiny_model):
    engine = AsyncLLM(EngineConfig(model=str(tiny_model("qwen3-moe", lm_head_scale=4.0))))
    forward = engine.engine.runner.forward
    engine.engine.runner.forward = lambda seqs: (time.sleep(0.01), forward(seqs))[1]
    server = LiveServer(engine)
    try:
        got: list = []
        body = {"prompt": [5, 6], "max_tokens": 200, "ignore_eos": True, "stream": True}
        t = stream_in_thread(server, "/v1/completions", body, got)
        time.sleep(0.3)
        engine.shutdown()
        t.join(timeout=30)
        assert got[0][-1] == DONE and "engine stopped" in got[0][-2]
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        server.stop()


# ---- 3 and 4. disconnects --------------------------------------------------------------------
def test_abandoned_non_streaming_requests_are_aborted(srv, hooks):
    hooks["delay"] = 0.01
    aborted = srv.engine.stats().finished.get("abort", 0)
    body = {"prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True}

    def give_up():
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)

    threads = [threading.Thread(target=give_up) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = srv.wait_idle()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
    assert stats.finished.get("abort", 0) - aborted == 6


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_stream_disconnects_log_no_traceback(srv, hooks):
    hooks["delay"] = 0.005
    handler = _Records()
    names = ["", "uvicorn", "uvicorn.error", "asyncio", "hetserve"]
    for name in names:
        logging.getLogger(name).addHandler(handler)
    try:
        for path, body in (
            ("/v1/completions", {"prompt": "a story", "stream": True}),
            ("/v1/completions", {"prompt": ["a", "b"], "stream": True}),
            ("/v1/chat/completions", CHAT),
        ):
            for _ in range(5):
                full = body | {"max_tokens": 300, "ignore_eos": True}
                with httpx.stream("POST", srv.url + path, json=full, timeout=30) as r:
                    lines = r.iter_lines()
                    next(lines)
        srv.wait_idle()
        time.sleep(0.2)
    finally:
        for name in names:
            logging.getLogger(name).removeHandler(handler)
    assert [r.getMessage() for r in handler.records] == []


# ---- 6. body limits and the event loop ---------------------------------------------------------
def test_chunked_oversized_body_is_413(srv):
    def chunks():
        for _ in range(50):
            yield b"x" * (1 << 20)

    try:
        r = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=60)
        assert r.status_code == 413 and r.json()["error"]["message"]
    except httpx.TransportError:
        pass  # the server may close the connection while the client is still sending
    assert httpx.get(srv.url + "/health").status_code == 200


def test_guard_stops_reading_a_chunked_body_at_the_limit(srv):
    import asyncio

    from hetserve.server.app import create_app

    app = create_app(srv.engine, "tiny", max_body_bytes=3 << 20)
    received, sent = [], []

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": b"x" * (1 << 20), "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-type", b"application/json")],
        "query_string": b"",
    }
    asyncio.run(app(scope, receive, send))
    assert len(received) == 4  # 3 MiB allowed: the 4th MiB is the first one refused
    assert sent[0]["status"] == 413


def test_long_prompts_are_tokenized_off_the_event_loop(srv, monkeypatch):
    tok = srv.engine.tokenizer
    threads = []
    encode_long = tok.encode_long
    monkeypatch.setattr(
        tok, "encode_long", lambda *a: (threads.append(threading.get_ident()), encode_long(*a))[1]
    )
    r = post(srv, "/v1/completions", {"prompt": "hello world " * 1700})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert threads and threads[0] != srv.thread.ident
    # A text that cannot fit is refused before tokenizing at all.
    r = post(srv, "/v1/completions", {"prompt": "hello " * 600_000})
    assert r.status_code == 400 and "characters cannot fit" in r.json()["error"]["message"]
    assert len(threads) == 1


# ---- 7. unsupported features are 400s naming the field; accepted fields work ------------------
HOSTILE = [
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "x", "temperature": float("nan")}, "temperature"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": ["x"] * 257}, "prompt"),
    ("/v1/completions", {"prompt": ["x", "z"], "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2000}, "max_tokens"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]},
        "messages.0.content",
    ),  # noqa: E501
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        "messages.0.content",
    ),  # noqa: E501
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {}}],
            "tool_choice": "required",
        },
        "tools.0.function.name",
    ),  # noqa: E501
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {}},
        },
        "response_format.json_schema.name",
    ),  # noqa: E501
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "x"}},
        "audio",
    ),  # noqa: E501
    (
        "/v1/chat/completions",
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
        "messages.0.tool_calls.0",
    ),  # noqa: E501
]


@pytest.mark.parametrize("path,body,param", HOSTILE)
def test_hostile_request_gets_400_naming_the_field(srv, path, body, param):
    content = json.dumps(body, allow_nan=True)
    r = httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_max_completion_tokens_on_completions(srv):
    r = post(
        srv,
        "/v1/completions",
        {"prompt": "hello the", "max_completion_tokens": 40, "ignore_eos": True},
    )  # noqa: E501
    assert r.json()["usage"]["completion_tokens"] == 40


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(srv, path):
    body = {"max_tokens": 5, "ignore_eos": True, "stream": True}
    body |= {"prompt": "hi"} if "chat" not in path else {"messages": CHAT["messages"]}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    chunks = [json.loads(x[6:]) for x in sse_lines(srv, path, body)[:-1]]
    content = [c for c in chunks if c["choices"] and "role" not in c["choices"][0].get("delta", {})]
    # every content chunk carries the running count (a KeyError if not); on a loaded machine
    # the stream may deliver several tokens, even all five, in one chunk
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts and counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    # every chunk, the chat's first (its role, as vLLM sends it: no completion yet) too
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks), chunks[0]
    if "chat" in path:
        assert chunks[0]["usage"] == {"prompt_tokens": prompt, "completion_tokens": 0,
                                      "total_tokens": prompt}  # fmt: skip


def test_penalties_and_logit_bias_change_the_output(srv):
    base = {"prompt": "hello the of and", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = post(srv, "/v1/completions", base).json()["choices"][0]["text"]
    favoured = srv.engine.tokenizer.encode(" zz")[-1]
    biased = post(srv, "/v1/completions", base | {"logit_bias": {str(favoured): 100}}).json()
    assert biased["choices"][0]["text"] != plain
    r = post(srv, "/v1/completions", base | {"frequency_penalty": 2.0, "presence_penalty": 2.0})
    assert r.status_code == 200


# ---- 8 and 9. the spec tells the truth; metrics from arrival ----------------------------------
def test_openapi_spec_tells_the_truth(srv):
    spec = httpx.get(srv.url + "/openapi.json").json()
    assert '"422"' not in json.dumps(spec)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "500"} <= set(responses)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert spec["paths"][path]["post"]["requestBody"]["required"]
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert httpx.get(srv.url + "/metrics").headers["content-type"].startswith("text/plain")


def test_ttft_is_timed_from_http_arrival(srv, monkeypatch):
    def ttft_sum():
        for line in httpx.get(srv.url + "/metrics").text.splitlines():
            if line.startswith("hetserve_time_to_first_token_seconds_sum"):
                return float(line.split()[1])
        raise AssertionError("no TTFT metric")

    tok = srv.engine.tokenizer
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a: (time.sleep(0.3), encode(*a))[1])
    before = ttft_sum()
    assert post(srv, "/v1/completions", {"prompt": "timed", "max_tokens": 1}).status_code == 200
    assert ttft_sum() - before >= 0.3  # the tokenization delay counts, as clients see it


def test_long_token_id_prompts_are_checked_by_the_engine(srv):
    for bad in (2.5, True, "x", None):  # past the schema's per-element check: the engine's
        ids = [5] * 600 + [bad]
        r = post(srv, "/v1/completions", {"prompt": ids, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (bad, r.text)
    r = post(srv, "/v1/completions", {"prompt": [5] * 900 + [10**9], "max_tokens": 1})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    r = post(srv, "/v1/completions", {"prompt": list(range(10, 500)) * 2300, "max_tokens": 1})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
