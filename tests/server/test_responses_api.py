"""/v1/responses through the official openai client: text, streaming events, function tools,
previous_response_id served from the prefix cache, store: false."""

import json

import openai
import pytest

from hetserve.config import EngineConfig
from hetserve.engine.async_llm import AsyncLLM
from tests.server.conftest import LiveServer

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
          "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMS}


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
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text


def test_function_call_and_its_output(client):
    r = client.responses.create(model="tiny", input="weather?", tools=[TOOL],
                                tool_choice="required", max_output_tokens=60)  # fmt: skip
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


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="x", previous_response_id=r.id)
    assert err.value.body["param"] == "previous_response_id"
