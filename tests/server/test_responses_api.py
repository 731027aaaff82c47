"""/v1/responses through the official openai client: text, streaming events, function tools,
previous_response_id served from the prefix cache, store: false. The stream's events follow
the API's order (checked on the raw events, and by the SDK's own stream helper)."""

import json

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

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
          "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMS}
SHORT_JSON = {"format": {"type": "json_schema", "name": "pet", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 5}},
    "required": ["name"], "additionalProperties": False}}}  # fmt: skip
PARTS = {  # an item's events between output_item.added and .done: opening, deltas, closing
    "message": (["response.content_part.added"], "response.output_text.delta",
                ["response.output_text.done", "response.content_part.done"]),
    "reasoning": (["response.content_part.added"], "response.reasoning_text.delta",
                  ["response.reasoning_text.done", "response.content_part.done"]),
    "function_call": ([], "response.function_call_arguments.delta",
                      ["response.function_call_arguments.done"]),
}  # fmt: skip


def check_events(events: list[dict]) -> dict:
    """The Responses stream grammar on raw events; returns the final response. Each output
    item, in order: added, its parts and deltas, done; then completed or incomplete, whose
    output is the items as done."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["id"] == events[-1]["response"]["id"]
    last = events[-1]
    assert last["type"] == f"response.{last['response']['status']}"
    assert last["type"] in ("response.completed", "response.incomplete")
    cut_off = last["type"] == "response.incomplete"
    assert (last["response"]["incomplete_details"] is not None) == cut_off
    output, body = last["response"]["output"], events[2:-1]
    for i, item in enumerate(output):
        end = next(k for k, e in enumerate(body) if e["type"] == "response.output_item.done")
        added, inner, done, body = body[0], body[1:end], body[end], body[end + 1 :]
        assert added["type"] == "response.output_item.added" and added["output_index"] == i
        assert added["item"]["id"] == item["id"] and added["item"]["status"] == "in_progress"
        assert done["output_index"] == i and done["item"] == item
        opening, delta, closing = PARTS[item["type"]]
        n = len(inner) - len(opening) - len(closing)
        assert [e["type"] for e in inner] == opening + [delta] * n + closing
        assert all(e["output_index"] == i and e["item_id"] == item["id"] for e in inner)
        text = "".join(e["delta"] for e in inner if e["type"] == delta)
        whole = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert text == whole
        ends_open = cut_off and i == len(output) - 1
        assert item["status"] == ("incomplete" if ends_open else "completed")
    assert body == []
    return last["response"]


def raw_events(client, **body) -> list[dict]:
    url = str(client.base_url) + "responses"
    with httpx.stream("POST", url, json={"model": "tiny", "stream": True, **body}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line.removeprefix("data: ")) for line in lines]


@pytest.fixture(scope="module")
def client(tiny_model):
    engine = AsyncLLM(EngineConfig(model=str(tiny_model("qwen3-moe")), max_model_len=1024))
    srv = LiveServer(engine)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    srv.stop()
    engine.shutdown()


def test_text_and_stream(client):
    r = client.responses.create(model="tiny", input="hello the", max_output_tokens=8,
                                temperature=0, instructions="be brief")  # fmt: skip
    assert r.status == "incomplete" and r.usage.output_tokens == 8
    text = r.output_text
    events = list(client.responses.create(model="tiny", input="hello the", stream=True,
                  max_output_tokens=8, temperature=0, instructions="be brief"))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text


def test_function_call_and_its_output(client):
    r = client.responses.create(model="tiny", input="weather?", tools=[TOOL],
                                tool_choice="required", max_output_tokens=60,
                                temperature=0)  # fmt: skip
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"]
    follow = client.responses.create(
        model="tiny", previous_response_id=r.id, max_output_tokens=4, tools=[TOOL],
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
    )  # fmt: skip
    assert follow.previous_response_id == r.id and follow.output


def test_previous_response_is_a_prefix_cache_hit(client):
    first = client.responses.create(model="tiny", input="hello the model " * 8,
                                    max_output_tokens=6, temperature=0)  # fmt: skip
    second = client.responses.create(model="tiny", previous_response_id=first.id,
                                     input="and then", max_output_tokens=2)  # fmt: skip
    # the first turn's prompt and reply are rendered again: served from the cache
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    assert client.responses.retrieve(first.id).id == first.id


def test_truncation_auto_drops_the_oldest_items_until_it_fits(client):
    """`truncation: "auto"` was ignored: a conversation past the context was a 400 where
    OpenAI drops its oldest items. The instructions and the newest item stay."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "the " * 150}
             for i in range(7)]  # fmt: skip
    body = {"model": "tiny", "input": turns, "max_output_tokens": 4, "instructions": "be brief"}
    url = str(client.base_url) + "responses"
    r = httpx.post(url, json=body)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
    assert httpx.post(url, json={**body, "truncation": "disabled"}).status_code == 400
    r = httpx.post(url, json={**body, "truncation": "auto"})
    assert r.status_code == 200, r.text
    used = r.json()["usage"]["input_tokens"]
    assert 300 < used <= 1024 - 4  # some turns dropped, the newest kept with its reply's room
    r = httpx.post(url, json={**body, "truncation": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation"
    one = {**body, "input": [{"role": "user", "content": "the " * 1100}], "truncation": "auto"}
    assert httpx.post(url, json=one).status_code == 400  # nothing older to drop


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="x", previous_response_id=r.id)
    assert err.value.body["param"] == "previous_response_id"


WRONG = [  # fields of a request that are wrong -> the field its 400 names
    ({"text": "abc"}, "text"),
    ({"reasoning": "high"}, "reasoning"),
    ({"previous_response_id": [1]}, "previous_response_id"),
    ({"model": [1]}, "model"),
    ({"max_output_tokens": "8"}, "max_output_tokens"),
    ({"max_output_tokens": True}, "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 32000}, "max_output_tokens"),  # past the context: named as sent
    ({"temperature": "hot"}, "temperature"),
    ({"tools": {"type": "function", "name": "f"}}, "tools"),
    ({"tools": [{"type": "function", "name": 5}]}, "tools.0.name"),
    ({"tool_choice": 5}, "tool_choice"),
    ({"instructions": ["be brief"]}, "instructions"),
    ({"store": "no"}, "store"),
    ({"stream": "yes"}, "stream"),
    ({"metadata": []}, "metadata"),
    ({"text": {"format": "json"}}, "text.format"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"input": [5]}, "input.0"),
    ({"input": [{"role": "user", "content": [5]}]}, "input.0.content.0"),
    ({"input": [{"role": "bot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "call_id": 5, "name": "f"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]},
     "input.0.call_id"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), WRONG, ids=[p for _, p in WRONG])
def test_wrong_fields_are_400s_naming_them(client, fields, param):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, **fields}
    r = httpx.post(str(client.base_url) + "responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    assert "max_tokens" not in r.json()["error"]["message"]  # the chat request's name


@pytest.mark.parametrize("kind", ["input_image", "input_file", "input_audio"])
def test_media_parts_are_refused_not_dropped(client, kind):
    # As /v1/chat/completions refuses an image_url part: a text-only model cannot read it.
    parts = [{"type": "input_text", "text": "what is this?"}, {"type": kind}]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input=[{"role": "user", "content": parts}])
    assert err.value.body["param"] == "input.0.content.1"
    assert err.value.body["code"] == "unsupported" and kind in err.value.body["message"]


def test_stream_events_follow_the_protocol(client):
    whole = client.responses.create(model="tiny", input="a pet", text=SHORT_JSON, temperature=0,
                                    max_output_tokens=100)  # fmt: skip
    assert whole.status == "completed" and json.loads(whole.output_text)
    final = check_events(raw_events(client, input="a pet", text=SHORT_JSON, temperature=0,
                                    max_output_tokens=100))  # fmt: skip
    assert final["status"] == "completed"
    assert [o["content"] for o in final["output"]] == [
        o.model_dump(exclude_none=True)["content"] for o in whole.output
    ]
    # Greedy, as test_text_and_stream (sampled, the reply could end before its limit).
    cut = check_events(raw_events(client, input="hello the", instructions="be brief",
                                  temperature=0, max_output_tokens=8))  # fmt: skip
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    calls = check_events(raw_events(client, input="weather?", tools=[TOOL],
                                    tool_choice="required", max_output_tokens=200,
                                    temperature=0))  # fmt: skip
    assert [o["type"] for o in calls["output"]] == ["function_call"] * len(calls["output"])
    assert calls["output"] and json.loads(calls["output"][0]["arguments"])["city"]


def test_a_failure_mid_stream_ends_with_response_failed(client, monkeypatch):
    import hetserve.server.responses as responses

    real = responses.merge

    async def failing(streams):
        async for i, out in real(streams):
            yield i, out
            raise RuntimeError("injected engine fault")

    monkeypatch.setattr(responses, "merge", failing)
    events = raw_events(client, input="hi", max_output_tokens=20)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert "injected engine fault" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_the_sdk_stream_helper_follows_the_stream(client):
    with client.responses.stream(model="tiny", input="a pet", text=SHORT_JSON, temperature=0,
                                 max_output_tokens=100) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    assert final.status == "completed" and json.loads(final.output_text)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [o.id for o in final.output] == [o.id for o in done]
    texts = [e.snapshot for e in events if e.type == "response.output_text.delta"]
    assert texts[-1] == final.output_text

    # greedy: sampled, the random model now and then runs out of tokens in its fourth call
    calls = {"tools": [TOOL], "tool_choice": "required", "max_output_tokens": 200, "temperature": 0}
    with client.responses.stream(model="tiny", input="weather?", **calls) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output and json.loads(final.output[0].arguments)["city"]
    for call in final.output:  # one or more (parallel calls)
        args = [e.snapshot for e in events if getattr(e, "item_id", None) == call.id
                and e.type == "response.function_call_arguments.delta"]  # fmt: skip
        assert call.type == "function_call" and args[-1] == call.arguments

    with client.responses.stream(model="tiny", input="hello the", instructions="be brief",
                                 temperature=0, max_output_tokens=8) as stream:  # fmt: skip
        events = list(stream)  # the SDK's accumulator takes it (it raised IndexError)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].status == "incomplete"


def test_reasoning_message_and_calls_are_items_in_order():
    # A Qwen3-style reply, fed as it grows: thinking, an answer, two calls (the newline
    # between them is no message), as the server feeds a stream.
    reply = ('<think>\nthe weather\n</think>\n\nLet me check.<tool_call>\n{"name": "f", '
             '"arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": '
             '{}}\n</tool_call>')  # fmt: skip
    streamer, items, events = Streamer(ThinkSplitter(HermesParser([]))), OutputItems(), []
    for n in range(1, len(reply) + 1):
        events += items.feed(*streamer.feed(reply[:n], final=n == len(reply)))
    events += items.finish(cut_off=False)
    response = {"id": "resp_1", "status": "completed", "incomplete_details": None}
    head = {**response, "output": []}
    seq = [{"type": "response.created", "response": head},
           {"type": "response.in_progress", "response": head},
           *({"type": kind, **data} for kind, data in events),
           {"type": "response.completed",
            "response": {**response, "output": items.items}}]  # fmt: skip
    seq = [{**e, "sequence_number": i} for i, e in enumerate(seq)]
    final = check_events(seq)
    assert [o["type"] for o in final["output"]] == [
        "reasoning", "message", "function_call", "function_call"]  # fmt: skip
    assert final["output"][0]["content"][0]["text"] == "\nthe weather\n"
    assert final["output"][1]["content"][0]["text"] == "Let me check."
    assert [(o["name"], o["arguments"]) for o in final["output"][2:]] == [
        ("f", '{"a": 1}'), ("g", "{}")]  # fmt: skip
    assert final["output"][2]["call_id"] == streamer.ids[0]
    # The SDK's stream helper takes these events (served by a stand-in transport).
    sse = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in seq)
    reply_with = httpx.MockTransport(
        lambda _: httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
    )
    sdk = openai.OpenAI(base_url="http://stand-in/v1", api_key="x",
                        http_client=httpx.Client(transport=reply_with))  # fmt: skip
    with sdk.responses.stream(model="tiny", input="weather?") as stream:
        kinds = [e.type for e in stream]
        got = stream.get_final_response()
    assert kinds == [e["type"] for e in seq]
    assert [o.model_dump(exclude_none=True) for o in got.output] == final["output"]


def test_truncation_takes_a_calls_results_with_it():
    from hetserve.server.responses_input import truncated

    sys_ = {"role": "system", "content": "s"}
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    user = {"role": "user", "content": "and then?"}
    assert truncated([sys_, call, result, user], 1) == [sys_, user]
    assert truncated([sys_, user], 1) is None  # the newest item stays
    assert truncated([call, user], 0) == [user]


def test_input_items_are_listed_and_input_tokens_counted_through_the_sdk(client):
    """`responses.input_items.list` was a 404 and `responses.input_tokens.count` a 405."""
    items = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": [{"type": "input_text", "text": "second"}]}]  # fmt: skip
    r = client.responses.create(model="tiny", input=items, max_output_tokens=2,
                                instructions="be brief")  # fmt: skip
    listed = client.responses.input_items.list(r.id, order="asc")
    texts = [(i.role, i.content[0].text) for i in listed.data]
    assert texts == [("user", "first"), ("assistant", "ok"), ("user", "second")]
    assert len({i.id for i in listed.data}) == 3
    newest = client.responses.input_items.list(r.id, limit=2)  # newest first
    assert [i.content[0].text for i in newest.data] == ["second", "ok"] and newest.has_more
    rest = client.responses.input_items.list(r.id, limit=2, after=newest.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["first"] and not rest.has_more
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    # the tokens the same request renders to: its usage's input tokens
    counted = client.responses.input_tokens.count(model="tiny", input=items,
                                                   instructions="be brief")  # fmt: skip
    assert counted.input_tokens == r.usage.input_tokens
    chained = client.responses.input_tokens.count(model="tiny", input="more",
                                                   previous_response_id=r.id)  # fmt: skip
    alone = client.responses.input_tokens.count(model="tiny", input="more")
    assert chained.input_tokens > alone.input_tokens + 5  # the stored chain comes along


@pytest.mark.parametrize("field", ["conversation", "prompt"])
def test_what_is_not_served_is_refused_not_ignored(client, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="hi", **{field: "conv_1" if field ==
                                "conversation" else {"id": "pmpt_1"}})  # fmt: skip
    assert err.value.body["param"] == field
