"""/v1/responses with `background: true` (poll, stream again from a sequence number, cancel)
and `include` (the output text's logprobs, the reasoning's encrypted_content), through the
official openai client. These were accepted and ignored: a background request blocked until
the whole reply was done, and `client.responses.cancel` was a 404."""

import asyncio
import base64
import threading
import time

import httpx
import openai
import pytest

from hetserve.config import EngineConfig
from hetserve.engine.async_llm import AsyncLLM
from hetserve.server.responses_items import OutputItems
from hetserve.server.tools import Streamer
from hetserve.server.tools.formats import HermesParser
from hetserve.server.tools.reasoning import ThinkSplitter
from tests.server.conftest import LiveServer
from tests.server.test_responses_api import check_events, raw_events

LOGPROBS = ["message.output_text.logprobs"]


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = AsyncLLM(EngineConfig(model=str(tiny_model("qwen3-moe")), max_model_len=1024))
    srv = LiveServer(engine)
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def wait_for(client, rid, statuses=("completed", "incomplete"), timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.responses.retrieve(rid)
        if r.status in statuses:
            return r
        time.sleep(0.05)
    raise AssertionError(f"{rid} still {r.status}")


def test_a_background_response_answers_at_once_and_is_polled(client):
    body = {"model": "tiny", "input": "hello the", "max_output_tokens": 12, "temperature": 0}
    want = client.responses.create(**body)
    r = client.responses.create(**body, background=True)
    assert r.status == "queued" and r.background is True and r.output == []
    done = wait_for(client, r.id)
    assert done.status == want.status and done.output_text == want.output_text
    assert done.usage.output_tokens == want.usage.output_tokens
    # Continued like any stored response.
    follow = client.responses.create(model="tiny", previous_response_id=r.id, input="more",
                                     max_output_tokens=2)  # fmt: skip
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_a_background_stream_is_streamed_again_from_a_sequence_number(client, server):
    body = {"input": "hello the", "max_output_tokens": 10, "temperature": 0}
    events = raw_events(client, **body, background=True)
    final = check_events(events[:1] + events[1:])  # the grammar holds, created while queued
    assert events[0]["response"]["status"] == "queued" and final["background"] is True
    rid = final["id"]
    url = f"{server.url}/v1/responses/{rid}"
    with httpx.stream("GET", url, params={"stream": "true", "starting_after": 3}) as s:
        again = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events[4:]] == list(range(4, len(events)))
    assert len(again) == len(events) - 4
    # The SDK's way, from the start: the same events.
    replay = list(client.responses.retrieve(rid, stream=True, starting_after=-1))
    assert [e.type for e in replay] == [e["type"] for e in events]
    assert replay[-1].response.output_text == client.responses.retrieve(rid).output_text


@pytest.fixture()
def release(monkeypatch):
    """Replies held after their first token until the event is set (set again at the end)."""
    import hetserve.server.responses as responses

    event = threading.Event()
    real = responses.merge

    async def held(streams):
        async for i, out in real(streams):
            yield i, out
            while not event.is_set():
                await asyncio.sleep(0.01)

    monkeypatch.setattr(responses, "merge", held)
    yield event
    event.set()


def test_a_background_response_is_cancelled_and_its_blocks_freed(client, server, release):
    try:
        r = client.responses.create(model="tiny", input="hello the", max_output_tokens=200,
                                    background=True)  # fmt: skip
        running = wait_for(client, r.id, statuses=("in_progress",))
        assert running.background is True
        with pytest.raises(openai.BadRequestError) as err:  # not a conversation to continue
            client.responses.create(model="tiny", previous_response_id=r.id, input="x")
        assert "in_progress" in err.value.body["message"]
        cancelled = client.responses.cancel(r.id)
        assert cancelled.status == "cancelled"
        assert client.responses.retrieve(r.id).status == "cancelled"
        assert client.responses.cancel(r.id).status == "cancelled"  # as it ended
    finally:
        release.set()
    stats = server.wait_idle()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


def test_background_responses_running_at_once_are_bounded(client, server, release):
    """Nothing bounded them: a client could queue generations without end, holding no
    connection. One over the bound is a 429 with Retry-After; a foreground one still runs."""
    serving_runs = server.server.config.app.state.responses.runs
    bound = serving_runs.max_running
    serving_runs.max_running = 1
    try:
        r = client.responses.create(model="tiny", input="hello the", max_output_tokens=200,
                                    background=True)  # fmt: skip
        wait_for(client, r.id, statuses=("in_progress",))
        with pytest.raises(openai.RateLimitError) as err:
            client.responses.create(model="tiny", input="again", background=True)
        assert err.value.response.headers["Retry-After"] == "1"
        assert "1 background responses are running" in err.value.body["message"]
        client.responses.cancel(r.id)
    finally:
        serving_runs.max_running = bound
        release.set()
    assert server.wait_idle().kv_blocks_used == 0


def test_background_mistakes_are_400s_and_404s(client, server):
    url = server.url + "/v1/responses"
    r = httpx.post(url, json={"model": "tiny", "input": "hi", "background": True,
                              "store": False})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"
    r = httpx.post(url, json={"model": "tiny", "input": "hi", "background": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"
    plain = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(plain.id)
    assert "only background responses" in err.value.body["message"]
    r = httpx.get(f"{url}/{plain.id}", params={"stream": "true"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nothing")
    bg = client.responses.create(model="tiny", input="hi", max_output_tokens=2, background=True)
    wait_for(client, bg.id)
    r = httpx.get(f"{url}/{bg.id}", params={"stream": "true", "starting_after": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after"
    assert client.responses.cancel(bg.id).status in ("completed", "incomplete")


def test_output_text_logprobs_when_included(client):
    body = {"model": "tiny", "input": "hello the", "max_output_tokens": 8, "temperature": 0,
            "instructions": "be brief", "include": LOGPROBS, "top_logprobs": 3}  # fmt: skip
    r = client.responses.create(**body)
    part = r.output[0].content[0]
    assert r.status == "incomplete"  # cut off: every token is the text's (no stop token)
    assert len(part.logprobs) == r.usage.output_tokens == 8
    for lp in part.logprobs:
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
        assert lp.top_logprobs[0].logprob >= lp.logprob - 1e-6  # greedy: the top one
    events = raw_events(client, **{k: v for k, v in body.items() if k != "model"})
    streamed = [lp for e in events if e["type"] == "response.output_text.delta"
                for lp in e["logprobs"]]  # fmt: skip
    assert [lp["token"] for lp in streamed] == [lp.token for lp in part.logprobs]
    final = check_events(events)["output"][0]["content"][0]
    assert final["logprobs"] == streamed  # the item as done holds what the deltas carried
    # (Not equal to the first run's to 1e-5: this one's prompt came from the prefix cache,
    # with the default placement's int8 kernels over a different split.)
    assert [lp["logprob"] for lp in streamed] == pytest.approx(
        [lp.logprob for lp in part.logprobs], abs=1e-2
    )
    plain = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert plain.output[0].content[0].logprobs is None  # not asked, not sent


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"include": ["file_search_call.results"]}, "include.0"),
     ({"include": "message.output_text.logprobs"}, "include"),
     ({"top_logprobs": 2}, "top_logprobs"),
     ({"include": LOGPROBS, "top_logprobs": 21}, "top_logprobs")],
)  # fmt: skip
def test_include_mistakes_are_400s_naming_them(server, fields, param):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, **fields}
    r = httpx.post(server.url + "/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_reasoning_is_carried_and_only_the_answer_has_logprobs():
    def lp(tok):
        return {"token": tok, "logprob": -1.0, "bytes": list(tok.encode()), "top_logprobs": []}

    steps = ["<think>", "\nhmm", "\n</think>", "\n\n", "Hi", " there"]
    streamer = Streamer(ThinkSplitter(HermesParser([])))
    items, text = OutputItems(encrypt_reasoning=True, logprobs=True), ""
    for i, step in enumerate(steps):
        text += step
        items.feed(*streamer.feed(text, final=i == len(steps) - 1), logprobs=[lp(step)])
    items.finish(cut_off=False)
    reasoning, message = items.items
    assert base64.b64decode(reasoning["encrypted_content"]).decode() == "\nhmm\n"
    assert message["content"][0]["text"] == "Hi there"
    # The thinking's tokens are not the answer's, nor the newlines the parser drops after it.
    assert [e["token"] for e in message["content"][0]["logprobs"]] == ["Hi", " there"]
    # The closing tag alone in its step (Qwen3's and R1's single token) is not the text's either.
    steps = ["<think>", "hmm", "</think>", "\n\n", "Hello", " wor", "ld"]
    streamer, items, text = Streamer(ThinkSplitter(HermesParser([]))), OutputItems(True, True), ""
    for i, step in enumerate(steps):
        text += step
        items.feed(*streamer.feed(text, final=i == len(steps) - 1), logprobs=[lp(step)])
    items.finish(cut_off=False)
    part = items.items[-1]["content"][0]
    assert [e["token"] for e in part["logprobs"]] == ["Hello", " wor", "ld"]
    assert "".join(e["token"] for e in part["logprobs"]) == part["text"] == "Hello world"


def test_a_deleted_background_response_stays_deleted(client, server, release):
    """Review findings: a GET after deleting a finished background response was a 500, and
    deleting a running one did not stick (its end stored it again)."""
    release.set()
    done = client.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                   background=True)  # fmt: skip
    wait_for(client, done.id)
    client.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)
    release.clear()
    try:
        r = client.responses.create(model="tiny", input="hi", max_output_tokens=50,
                                    background=True)  # fmt: skip
        wait_for(client, r.id, statuses=("in_progress",))
        client.responses.delete(r.id)
    finally:
        release.set()
    time.sleep(0.3)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    assert server.wait_idle().kv_blocks_used == 0
