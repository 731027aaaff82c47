"""Bad input through the Conductor: a body of the wrong shape is routed as what can be read of
it and answered with the instance's own 400, never a 500 of the Conductor's; the next request
is served as usual. The instances are answered in-process (httpx's mock transport)."""

import asyncio
import json

import httpx
import pytest

from hetserve.disagg.conductor import Conductor, ConductorConfig
from hetserve.disagg.costs import DecodeFit, InstanceProfile, PrefillFit, profile_to_dict
from hetserve.disagg.instances import Cluster
from hetserve.disagg.policy import Router, RouterConfig
from hetserve.server.conductor_app import create_conductor_app

PROFILE = profile_to_dict(
    InstanceProfile("t", PrefillFit(0.001, 0.0001, 0.0), DecodeFit(0.01, 0.001, 0.0), 1000)
)


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 100 for c in text]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def _instance(request: httpx.Request) -> httpx.Response:
    """An instance that takes only well-formed integers, as the real one's validation does."""
    if request.url.path == "/internal/load":
        return httpx.Response(200, json={"running_decodes": 0, "free_blocks": 100})
    body = json.loads(request.content)
    if not _valid(request.url.path, body):
        err = {"message": "bad request", "type": "invalid_request_error"}
        return httpx.Response(400, json={"error": err})
    return httpx.Response(200, json={"choices": [{"text": "ok"}]})


def _valid(path: str, body: dict) -> bool:
    if any(name in body and type(body[name]) is not int for name in ("priority", "n")):
        return False
    if path == "/v1/completions":
        return isinstance(body.get("prompt"), str | list)
    messages = body.get("messages")
    return isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
    )


def _conductor(instance) -> tuple[Cluster, Conductor]:
    """A Conductor in front of one prefill and one decode instance, `instance` answering."""
    cluster = Cluster([])
    cluster.http = httpx.AsyncClient(transport=httpx.MockTransport(instance))
    for url, role in (("http://p:1", "prefill"), ("http://d:2", "decode")):
        info = {"role": role, "profile": PROFILE, "block_size": 4, "hash_seed": ""}
        inst = cluster._instance(url, None, info)
        cluster.instances[inst.name] = inst
    cluster.block_size = 4
    router = Router(RouterConfig(policy="load"))
    return cluster, Conductor(cluster, router, _Tokenizer(), ConductorConfig())


BAD = [
    ("/v1/completions", {"prompt": "x", "priority": "high"}),
    ("/v1/completions", {"prompt": "x", "priority": [1]}),
    ("/v1/completions", {"prompt": "x", "n": "two"}),
    ("/v1/completions", {"prompt": 5}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": {"role": "user", "content": "hi"}}),
    ("/v1/chat/completions", {"messages": ["hi"], "priority": "high"}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"text": 5}]}], "priority": "1"},
    ),
]


@pytest.mark.parametrize(("path", "body"), BAD)
def test_a_malformed_body_is_the_instances_400_not_a_500(path, body) -> None:
    async def run() -> None:
        cluster, conductor = _conductor(_instance)
        app = create_conductor_app(conductor, "m")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            r = await client.post(path, json={**body, "max_tokens": 2})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
            ok = {"prompt": "x", "max_tokens": 2, "priority": 1}
            good = await client.post("/v1/completions", json=ok)
            assert good.status_code == 200, good.text
        await asyncio.sleep(0.05)  # the prefill halves run in the background
        await cluster.http.aclose()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("prompt", "handed", "extra"),
    [(["a b c", "d e f"], False, {}), ([[1, 2], [3, 4]], False, {}), (["a b c"], True, {}),
     ([1, 2], True, {}), ([1, 2], False, {"prompt_logprobs": 1})],
)  # fmt: skip
def test_several_prompts_are_not_handed_off_under_one_key(prompt, handed, extra) -> None:
    """Two prompts went disaggregated with one hand-off key: the prefill instance computed
    both, the decode instance logged 'hand-off ... does not match its request; recomputing'
    for each and computed them again. Prompt logprobs the same (the decode side's prefix
    lookup is off for them, so no hand-off can match): served colocated."""
    seen: list[tuple[str, dict]] = []

    def instance(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            seen.append((request.url.host, json.loads(request.content)))
        return _instance(request)

    async def run() -> None:
        cluster, conductor = _conductor(instance)
        transport = httpx.ASGITransport(app=create_conductor_app(conductor, "m"))
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            body = {"prompt": prompt, "max_tokens": 2, **extra}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        await asyncio.sleep(0.05)  # the prefill half runs in the background
        await cluster.http.aclose()

    asyncio.run(run())
    assert sorted(host for host, _ in seen) == (["d", "p"] if handed else ["d"])
    assert all(("kv_handoff" in body) is handed for _, body in seen)


def test_the_request_log_has_only_requests_the_instances_took(tmp_path) -> None:
    """A request the instances refused with a 400 was logged as served, and an empty prompt
    as a record of 0 input tokens, which `hetserve sim --trace DIR` refuses: one bad client
    request made the whole cluster's log unreadable by the simulator."""
    from hetserve.core.trace_record import RequestLogWriter
    from hetserve.sim.trace import read_trace

    log = tmp_path / "conductor.jsonl"

    async def run() -> None:
        cluster, conductor = _conductor(_instance)
        conductor.request_log = RequestLogWriter(str(log))
        transport = httpx.ASGITransport(app=create_conductor_app(conductor, "m"))
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            for body in ({"prompt": []}, {"prompt": "x", "priority": "high"}, {"prompt": "x"}):
                await client.post("/v1/completions", json={**body, "max_tokens": 2})
        await asyncio.sleep(0.05)
        await cluster.http.aclose()

    asyncio.run(run())
    assert [r.input_length for r in read_trace(str(log))] == [1]


def test_a_request_the_decode_half_refuses_stops_its_prefill_half() -> None:
    """A body only the decode instance refuses (stream_options without stream, min_tokens over
    max_tokens: the prefill half asks for one token, not streamed) was still prefilled in full,
    its KV held for a receiver that never came. The prefill call is now cancelled; the
    instance aborts a request whose client left."""
    state = {"started": False, "cancelled": False}

    async def instance(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p" and request.method == "POST":
            state["started"] = True
            try:
                await asyncio.sleep(30)  # a long prompt
            except asyncio.CancelledError:
                state["cancelled"] = True
                raise
        if request.url.host == "d" and request.method == "POST":
            while not state["started"]:  # the prefill half is under way
                await asyncio.sleep(0.005)
            err = {"message": "stream_options needs stream", "type": "invalid_request_error"}
            return httpx.Response(400, json={"error": err})
        return _instance(request)

    async def run() -> None:
        cluster, conductor = _conductor(instance)
        transport = httpx.ASGITransport(app=create_conductor_app(conductor, "m"))
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            body = {"prompt": "x y z", "max_tokens": 2, "stream_options": {"include_usage": True}}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            for _ in range(100):
                if state["cancelled"]:
                    break
                await asyncio.sleep(0.01)
        assert state == {"started": True, "cancelled": True}
        assert conductor._prefills == {}
        await cluster.http.aclose()

    asyncio.run(run())


def test_a_salted_or_truncated_prompt_is_looked_up_as_the_instances_hash_it() -> None:
    """vLLM's cache_salt: the instances mix it into every block hash, so the Conductor must
    look the prompt up under the same hashes (unsalted ones would never be held)."""
    from hetserve.core.block_hash import hash_prefix_blocks, salt_extra

    asked: list[list[bytes]] = []
    cluster, conductor = _conductor(_instance)
    conductor.holdings = lambda hashes: asked.append(list(hashes)) or {}
    body = {"prompt": "abcdefghijkl", "max_tokens": 2}
    ids = conductor.prompt_ids("/v1/completions", body)
    for salt in (None, "tenant-a"):
        conductor.decide("/v1/completions", {**body, "cache_salt": salt})
        want = hash_prefix_blocks(ids, 4, salt_extra(salt), b"")
        assert asked[-1] == [h.digest for h in want]
    assert asked[0] != asked[1]
    # truncate_prompt_tokens: the instances keep the last tokens, so the lookup does too.
    conductor.decide("/v1/completions", {**body, "truncate_prompt_tokens": 8})
    assert asked[-1] == [h.digest for h in hash_prefix_blocks(ids[-8:], 4, (), b"")]
    asyncio.run(cluster.http.aclose())


def test_anthropic_messages_are_routed_as_the_chat_they_mean() -> None:
    """/v1/messages through the Conductor: the decode instance gets the Messages body (with
    its hand-off), the prefill instance the chat request it means (Anthropic's blocks would be
    its 400), and the Conductor's own errors have Anthropic's shape."""
    from hetserve.disagg.conductor import OtherAPI
    from hetserve.server.anthropic import anthropic_error
    from hetserve.server.anthropic_input import chat_body

    seen: list[tuple[str, str, dict]] = []

    def instance(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/internal/load":
            return httpx.Response(200, json={"running_decodes": 0, "free_blocks": 100})
        seen.append((request.url.host, request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={"type": "message", "content": []})

    body = {"model": "m", "max_tokens": 5, "system": "be brief", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "sunny"}]}]}  # fmt: skip

    async def run() -> None:
        cluster, conductor = _conductor(instance)
        conductor.apis["/v1/messages"] = OtherAPI(
            lambda b: chat_body(b, thinking_budget=False), anthropic_error
        )
        transport = httpx.ASGITransport(app=create_conductor_app(conductor, "m"))
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            r = await client.post("/v1/messages", json=body)
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.05)  # the prefill half runs in the background
            for name in list(cluster.instances):
                cluster.mark_down(name)
            r = await client.post("/v1/messages", json=body)
            assert r.status_code == 503 and r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "overloaded_error"
        await cluster.http.aclose()

    asyncio.run(run())
    by_host = {host: (path, b) for host, path, b in seen}
    path, decode = by_host["d"]
    assert path == "/v1/messages" and decode["kv_handoff"]["role"] == "receive"
    assert decode["messages"] == body["messages"]
    path, prefill = by_host["p"]
    assert path == "/v1/chat/completions" and prefill["kv_handoff"]["role"] == "send"
    assert prefill["max_tokens"] == 1 and prefill["messages"][-1]["role"] == "tool"
    assert prefill["messages"][2]["tool_calls"][0]["function"]["name"] == "w"


def test_anthropics_count_tokens_and_a_dying_stream_through_the_conductor() -> None:
    """count_tokens was a 404 at the Conductor; a Messages stream whose instance died ended
    with OpenAI's data line, which Anthropic's SDKs skip (the reply looked whole)."""
    from hetserve.disagg.conductor import OtherAPI
    from hetserve.server.anthropic import anthropic_error, anthropic_stream_error
    from hetserve.server.anthropic_input import chat_body

    class Dying(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'event: message_start\ndata: {"type":"message_start"}\n\n'
            raise httpx.ReadError("connection reset")

    def instance(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/internal/load":
            return httpx.Response(200, json={"running_decodes": 0, "free_blocks": 100})
        if request.url.path == "/v1/messages/count_tokens":
            return httpx.Response(200, json={"input_tokens": 7})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=Dying())  # fmt: skip

    async def run() -> None:
        cluster, conductor = _conductor(instance)
        conductor.apis["/v1/messages"] = OtherAPI(
            lambda b: chat_body(b, thinking_budget=False), anthropic_error,
            anthropic_stream_error,
        )  # fmt: skip
        transport = httpx.ASGITransport(app=create_conductor_app(conductor, "m"))
        body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            r = await client.post("/v1/messages/count_tokens", json=body)
            assert r.status_code == 200 and r.json() == {"input_tokens": 7}
            r = await client.post("/v1/messages", json={**body, "stream": True})
            text = r.text
        assert text.rstrip().splitlines()[-2] == "event: error", text
        assert '"type":"api_error"' in text and "[DONE]" not in text
        await asyncio.sleep(0.05)
        await cluster.http.aclose()

    asyncio.run(run())
