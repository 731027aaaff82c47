"""The guard in front of every route: the API key on each API's routes, a bug's 500 that keeps
the client's connection, an access line for every answer, and a model name of the wrong type."""

import time

import httpx
import pytest

from tests.server.conftest import LiveServer

KEY = "s3cret"


@pytest.fixture(scope="module")
def keyed(engine):
    srv = LiveServer(engine, api_key=KEY, log_requests=True, max_body_bytes=4096)
    yield srv
    srv.stop()


AUTH = {"authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False}


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("POST", "/api/chat", CHAT),
        ("POST", "/api/generate", {"model": "tiny", "prompt": "hi", "stream": False}),
        ("GET", "/api/tags", None),
        ("GET", "/api/ps", None),
        ("POST", "/api/show", {"model": "tiny"}),
    ],
)
def test_ollama_routes_need_the_key_too(keyed, method, path, body):
    r = httpx.request(method, keyed.url + path, json=body, timeout=60)
    assert r.status_code == 401 and r.json() == {"error": "missing or invalid API key"}
    wrong = httpx.request(method, keyed.url + path, json=body, timeout=60,
                          headers={"authorization": "Bearer nope"})  # fmt: skip
    assert wrong.status_code == 401
    ok = httpx.request(method, keyed.url + path, json=body, headers=AUTH, timeout=60)
    assert ok.status_code == 200, ok.text


def test_health_and_metrics_stay_open(keyed):
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 200


def test_a_bug_answers_500_and_the_connection_serves_the_next_request(keyed, monkeypatch):
    import hetserve.server.app as app_module

    good = {"model": "tiny", "prompt": "hi", "max_tokens": 2}

    def bug(body: bytes):
        if b"boom" in body:
            raise KeyError("a bug of ours")
        return parse(body)

    parse = app_module.parse_completion
    monkeypatch.setattr(app_module, "parse_completion", bug)
    with httpx.Client(base_url=keyed.url, headers=AUTH, timeout=60) as client:
        assert client.post("/v1/completions", json=good).status_code == 200
        r = client.post("/v1/completions", json={**good, "prompt": "boom"})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "KeyError" in err["message"]
        assert r.headers.get("connection") != "close"
        # the same keep-alive connection answers the next request
        assert client.post("/v1/completions", json=good).status_code == 200
        assert client.post("/v1/completions", json=good).status_code == 200


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/responses", {"model": [1], "input": "hi"}),
        ("/v1/responses", {"model": {"a": 1}, "input": "hi"}),
        ("/api/chat", {**CHAT, "model": [1]}),
        ("/api/generate", {"model": 5, "prompt": "hi", "stream": False}),
    ],
)
def test_a_model_name_of_the_wrong_type_is_400(keyed, path, body):
    r = httpx.post(keyed.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    if path.startswith("/api/"):
        assert "model" in r.json()["error"]
    else:
        assert r.json()["error"]["param"] == "model"


def _wait_for(lines: list[str], text: str) -> list[str]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [line for line in lines if text in line]
        if found:
            return found
        time.sleep(0.02)
    return []


def test_every_answer_gets_an_access_line(keyed, access_lines):
    httpx.post(keyed.url + "/v1/completions", json={"prompt": "x"})  # no key
    assert _wait_for(access_lines, '"POST /v1/completions" 401')
    big = {"prompt": "x" * 8192}
    r = httpx.post(keyed.url + "/v1/completions", json=big, headers=AUTH)
    assert r.status_code == 413
    assert _wait_for(access_lines, '"POST /v1/completions" 413')
    # a stream the client leaves after its first event
    body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", keyed.url + "/v1/completions", json=body, headers=AUTH) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 5:
                break
    (line,) = _wait_for(access_lines, '"POST /v1/completions" 499')
    # With what it had streamed (it said 0 tokens and no TTFT: the counts came at the end).
    assert "prompt_tokens=0" not in line and "output_tokens=0" not in line, line
    assert "ttft=-" not in line, line
    keyed.wait_idle()
    assert keyed.engine.stats().kv_blocks_used == 0


def test_the_conductors_load_poll_gets_no_access_line(keyed, access_lines):
    """A Conductor polls each instance's /internal/load 10 times a second: as an access line
    each, they were nearly all of an instance's log (864,000 lines a day)."""
    for _ in range(3):
        assert httpx.get(keyed.url + "/internal/load", headers=AUTH).status_code == 200
    httpx.get(keyed.url + "/v1/models")  # no key: a line, after the polls
    assert _wait_for(access_lines, '"GET /v1/models" 401')
    assert not [line for line in access_lines if "/internal/load" in line]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages", "/api/chat"])
def test_a_forced_stop_answers_503_in_the_apis_shape_not_a_traceback(path):
    """A second Ctrl-C cancels what is in flight: uvicorn answered 'Internal Server Error' and
    logged a traceback for each; the client now gets a 503 it can act on."""
    import asyncio

    from hetserve.server.app import Guard

    async def cancelled(scope, receive, send):
        raise asyncio.CancelledError

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "path": path, "method": "POST", "headers": []}
    asyncio.run(Guard(cancelled, api_key=None, max_body_bytes=1 << 20)(scope, receive, send))
    assert sent[0]["status"] == 503
    body = httpx.Response(503, content=sent[1]["body"]).json()
    message = body["error"] if path.startswith("/api/") else body["error"]["message"]
    assert "shutting down" in message
