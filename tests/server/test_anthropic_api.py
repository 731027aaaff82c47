"""Anthropic's Messages API (/v1/messages, what Claude Code and Anthropic's SDKs send) through
the official anthropic client: text, the stream's events, tool use and tool results, stop
sequences, prefill, thinking budgets, count_tokens, the API key as x-api-key, and Anthropic's
error bodies."""

import json

import anthropic
import httpx
import pytest

from hetserve.config import EngineConfig
from hetserve.engine.async_llm import AsyncLLM
from tests.server.conftest import LiveServer

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
          "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOL = {"name": "get_weather", "description": "the weather in a city", "input_schema": PARAMS}
HELLO = [{"role": "user", "content": "hello the"}]
KEY = "sesame"
GREEDY = {"temperature": 0}  # the SDK no longer sends sampling fields; older clients do


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = AsyncLLM(EngineConfig(model=str(tiny_model("qwen3-moe")), max_model_len=1024))
    srv = LiveServer(engine, api_key=KEY)
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture()
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def chat_text(server, messages, **extra) -> str:
    body = {"model": "tiny", "messages": messages, "temperature": 0, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"] or ""


def raw_events(server, **body) -> list[tuple[str, dict]]:
    with httpx.stream("POST", server.url + "/v1/messages", headers={"x-api-key": KEY},
                      json={"model": "tiny", "stream": True, **body}, timeout=60) as r:  # fmt: skip
        lines = list(r.iter_lines())
    names = [ln.removeprefix("event: ") for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln.removeprefix("data: ")) for ln in lines if ln.startswith("data: ")]
    assert [d["type"] for d in data] == names
    return list(zip(names, data, strict=True))


def check_stream(events) -> dict:
    """Anthropic's stream grammar: message_start, then each block's start, deltas and stop in
    index order, then message_delta and message_stop. Returns the message it builds."""
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    message = events[0][1]["message"]
    blocks, open_ = [], None
    for kind, data in events[1:-2]:
        if kind == "content_block_start":
            assert open_ is None and data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
            open_ = data["index"]
        elif kind == "content_block_delta":
            assert data["index"] == open_
            d, b = data["delta"], blocks[open_]
            key = {"text_delta": "text", "thinking_delta": "thinking",
                   "input_json_delta": "partial_json"}[d["type"]]  # fmt: skip
            b[key] = b.get(key, "") + d[key]
        else:
            assert kind == "content_block_stop" and data["index"] == open_
            open_ = None
    assert open_ is None
    return {**message, "content": blocks, **events[-2][1]["delta"]}


def test_a_text_reply_whole_and_streamed(client, server):
    r = client.messages.create(model="tiny", max_tokens=8, messages=HELLO, system="be brief",
                               extra_body=GREEDY)  # fmt: skip
    assert r.type == "message" and r.role == "assistant" and r.model == "tiny"
    assert [b.type for b in r.content] == ["text"]
    assert r.stop_reason in ("end_turn", "max_tokens") and 0 < r.usage.output_tokens <= 8
    want = chat_text(server, [{"role": "system", "content": "be brief"}, *HELLO], max_tokens=8)
    assert r.content[0].text == want
    with client.messages.stream(model="tiny", max_tokens=8, messages=HELLO, system="be brief",
                                extra_body=GREEDY) as stream:  # fmt: skip
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == want and final.stop_reason == r.stop_reason
    built = check_stream(raw_events(server, max_tokens=8, messages=HELLO, system="be brief",
                                    temperature=0))  # fmt: skip
    assert built["content"][0]["text"] == want


def test_tool_use_and_its_result(client, server):
    r = client.messages.create(model="tiny", max_tokens=200, messages=[{"role": "user",
                               "content": "weather?"}], tools=[TOOL],
                               tool_choice={"type": "any"}, extra_body=GREEDY)  # fmt: skip
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert isinstance(uses[0].input["city"], str)
    assert uses[0].id.startswith("toolu_")  # Anthropic's ids' shape
    follow = client.messages.create(model="tiny", max_tokens=4, tools=[TOOL], messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "sunny"}]},
    ])  # fmt: skip
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > r.usage.input_tokens
    weather = [{"role": "user", "content": "weather?"}]
    built = check_stream(raw_events(server, max_tokens=200, tools=[TOOL], messages=weather,
                                    tool_choice={"type": "tool", "name": "get_weather"},
                                    temperature=0))  # fmt: skip
    assert built["stop_reason"] == "tool_use"
    call = built["content"][0]
    assert call["type"] == "tool_use" and json.loads(call["partial_json"])["city"]


def test_a_reply_carries_its_request_id_header(client, server):
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=2, messages=HELLO)
    assert raw.headers["request-id"] == raw.parse().id and raw.parse().id.startswith("msg_")
    body = {"model": "tiny", "max_tokens": 2, "messages": HELLO, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", headers={"x-api-key": KEY},
                      json=body, timeout=60) as s:  # fmt: skip
        assert s.headers["request-id"].startswith("msg_")  # streamed too


def test_stop_sequences_prefill_and_count_tokens(client, server):
    free = client.messages.create(model="tiny", max_tokens=10, messages=HELLO, system="be brief",
                                  extra_body=GREEDY)  # fmt: skip
    text = free.content[0].text
    assert len(text) >= 6
    stop = text[3:6]
    cut = client.messages.create(model="tiny", max_tokens=10, messages=HELLO, system="be brief",
                                 extra_body=GREEDY, stop_sequences=[stop])  # fmt: skip
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    # Prefill: a final assistant turn is continued; the reply holds what comes after it.
    begun = [*HELLO, {"role": "assistant", "content": "Sure, here"}]
    r = client.messages.create(model="tiny", max_tokens=6, messages=begun, extra_body=GREEDY)
    assert r.content[0].text == chat_text(server, begun, max_tokens=6,
                                          continue_final_message=True,
                                          add_generation_prompt=False)  # fmt: skip
    counted = client.messages.count_tokens(model="tiny", messages=HELLO, system="be brief")
    thinking = {"type": "enabled", "budget_tokens": 2048}  # needs no max_tokens to count
    assert client.messages.count_tokens(model="tiny", messages=HELLO,
                                        thinking=thinking).input_tokens > 0  # fmt: skip
    once = client.messages.create(model="tiny", max_tokens=1, messages=HELLO, system="be brief")
    assert counted.input_tokens == once.usage.input_tokens + once.usage.cache_read_input_tokens


def test_a_thinking_budget_closes_the_thinking(client):
    begun = [*HELLO, {"role": "assistant", "content": "<think>\nlet me see"}]
    r = client.messages.create(model="tiny", max_tokens=12, messages=begun, extra_body=GREEDY,
                               thinking={"type": "enabled", "budget_tokens": 3})  # fmt: skip
    kinds = [b.type for b in r.content]
    assert kinds == ["thinking", "text"], r.content  # closed after the budget, then an answer
    free = client.messages.create(model="tiny", max_tokens=12, messages=begun, extra_body=GREEDY)
    assert [b.type for b in free.content] == ["thinking", "text"]
    assert free.content[1].text == ""  # unbudgeted, the random model never stops thinking


BAD = [
    ({"messages": HELLO}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": "x"}}]}]}, "image"),
    ({"max_tokens": 4, "messages": HELLO, "tools": [{"type": "web_search_20250305",
                                                      "name": "web_search"}]}, "server tool"),
    ({"max_tokens": 4, "messages": HELLO, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": "4", "messages": HELLO}, "max_tokens"),
    ({"max_tokens": 4, "messages": HELLO, "thinking": {"type": "enabled",
                                                        "budget_tokens": 0}}, "budget_tokens"),
    ({"max_tokens": 4, "messages": HELLO, "stop_sequences": [""]}, "stop_sequences"),
    # What Anthropic's API refuses and was served: a budget past max_tokens, temperature above
    # Anthropic's 1, a tool without its schema, an empty message
    ({"max_tokens": 10, "messages": HELLO, "thinking": {"type": "enabled",
                                                         "budget_tokens": 10}}, "greater than"),
    ({"max_tokens": 4, "messages": HELLO, "temperature": 1.5}, "between 0 and 1"),
    ({"max_tokens": 4, "messages": HELLO, "tools": [{"name": "f"}]}, "input_schema"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": ""}]}, "non-empty content"),
    ({"max_tokens": 4, "messages": HELLO, "output_config": {"effort": "huge"}}, "effort"),
    # Found on the last read: a check of the body's own was renamed as the chat request's
    # ("stop_sequences_sequences"), and a tool_result whose content was a number was a 500.
    ({"max_tokens": 4, "messages": HELLO, "stop_sequences": "x"}, "stop_sequences: expected"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": 5}]}]}, "tool_result's content"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "needle"), BAD)
def test_mistakes_are_anthropic_400s(server, body, needle):
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", **body},
                   headers={"x-api-key": KEY}, timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"], err


def test_the_key_and_the_model_are_checked_in_anthropics_shape(server):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model="tiny", max_tokens=2, messages=HELLO)
    assert err.value.body["type"] == "error"
    right = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as err:
        right.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=HELLO)
    assert err.value.body["error"]["type"] == "not_found_error"


def test_output_config_format_constrains_the_reply(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}},
              "required": ["name"], "additionalProperties": False}  # fmt: skip
    config = {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
    pet = [{"role": "user", "content": "a pet"}]
    r = client.messages.create(model="tiny", max_tokens=100, messages=pet, output_config=config,
                               extra_body=GREEDY)  # fmt: skip
    assert r.stop_reason == "end_turn"
    assert set(json.loads(r.content[0].text)) == {"name"}


def test_anthropics_sdk_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].type == "model"
    assert models.data[0].created_at.year >= 2026 and models.has_more is False


def test_second_review_context_errors_cut_off_calls_usage_and_thinking(client, server):
    """Claude Code reads Anthropic's context-overflow messages (it retries with less
    max_tokens, or compacts); a tool call cut off by max_tokens is no call to run; a stream's
    usage splits cache reads as the whole reply's does; thinking with a forced tool call is
    refused as Anthropic refuses it."""
    import re

    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="tiny", max_tokens=2000, messages=HELLO)
    found = re.search(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > "
                      r"(\d+)", err.value.body["error"]["message"])  # fmt: skip
    assert found and found.groups()[1:] == ("2000", "1024")
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="tiny", max_tokens=4,
                               messages=[{"role": "user", "content": "the " * 1100}])
    assert err.value.body["error"]["message"].startswith("prompt is too long: ")
    cut = client.messages.create(model="tiny", max_tokens=3, tools=[TOOL],
                                 tool_choice={"type": "any"},
                                 messages=[{"role": "user", "content": "weather?"}])  # fmt: skip
    assert cut.stop_reason == "max_tokens"
    long = [{"role": "user", "content": "hello the model " * 12}]
    client.messages.create(model="tiny", max_tokens=2, messages=long)  # cached from here on
    whole = client.messages.create(model="tiny", max_tokens=2, messages=long)
    with client.messages.stream(model="tiny", max_tokens=2, messages=long) as stream:
        streamed = stream.get_final_message()
    assert whole.usage.cache_read_input_tokens > 0
    assert streamed.usage.cache_read_input_tokens == whole.usage.cache_read_input_tokens
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="tiny", max_tokens=200, messages=HELLO, tools=[TOOL],
                               tool_choice={"type": "any"},
                               thinking={"type": "enabled", "budget_tokens": 100})  # fmt: skip
    assert "forces tool use" in err.value.body["error"]["message"]
    r = httpx.get(server.url + "/v1/messages", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["type"] == "error"
