"""Tool calling and reasoning through the official openai client, on a model whose template
has both (the tiny Qwen3-MoE): forced calls are valid under a random model, streamed calls add
up to the non-streamed ones, tool results are rendered, thinking goes to reasoning_content."""

import json

import jsonschema_rs
import openai
import pytest

from hetserve.config import EngineConfig
from hetserve.engine.async_llm import AsyncLLM
from tests.server.conftest import LiveServer

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]  # fmt: skip
USER = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_model):
    engine = AsyncLLM(EngineConfig(model=str(tiny_model("qwen3-moe")), max_model_len=1024))
    srv = LiveServer(engine)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    srv.stop()
    engine.shutdown()


def test_named_function_returns_valid_arguments(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=60, seed=1
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"  # OpenAI's for a named call ("required": calls)
    assert msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.function.name == "get_weather" and call.id and call.type == "function"
    jsonschema_rs.validate(PARAMS, json.loads(call.function.arguments))
    chunks = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=60, seed=1,
        stream=True,
    )  # fmt: skip
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "stop" and reasons.count(None) == len(reasons) - 1


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_valid_calls_streamed_as_whole(client, parallel):
    kw = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
              max_tokens=150, seed=3, parallel_tool_calls=parallel)  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert calls and (parallel or len(calls) == 1)
    for name, args in calls:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema_rs.validate(schema, json.loads(args))
    streamed: dict[int, list] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(d.index, [None, ""])
            entry[0] = d.function.name or entry[0]
            entry[1] += d.function.arguments or ""
    assert [tuple(streamed[i]) for i in sorted(streamed)] == calls


def test_tool_results_are_rendered_and_auto_answers(client):
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny and 21 degrees"},
    ]  # fmt: skip
    short = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    long = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=8, seed=2
    )
    assert long.usage.prompt_tokens > short.usage.prompt_tokens + 40  # tools and results
    assert long.choices[0].message.role == "assistant"
    auto = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=2)
    none = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    # as vLLM: the tools are still rendered (the prompt, and its cached prefix, that of the
    # turns around it); the reply is all content
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens > short.usage.prompt_tokens
    assert none.usage.prompt_tokens_details.cached_tokens > 0
    assert none.choices[0].message.tool_calls is None


def test_thinking_goes_to_reasoning_content(client):
    # A grammar makes the random model think, then answer, in Qwen3's format.
    extra = {"guided_regex": "<think>\n[a-z]{4}\n</think>\n\nhi [0-9]{2}"}
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=40, seed=1, extra_body=extra
    )
    msg = r.choices[0].message
    assert len(msg.reasoning_content.strip()) == 4 and msg.content.startswith("hi ")
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    parts = {"reasoning": "", "content": ""}
    for chunk in client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=40, seed=1, extra_body=extra, stream=True
    ):
        delta = chunk.choices[0].delta if chunk.choices else None
        parts["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        parts["content"] += (delta.content or "") if delta else ""
    assert parts == {"reasoning": msg.reasoning_content, "content": msg.content}


def test_thinking_switch_reaches_the_template(client):
    on = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1)
    off = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the empty <think></think>


def test_the_conductor_hashes_the_prompt_the_server_renders(client, tiny_model):
    """The Conductor rendered a chat body from its messages' roles and text alone: with tools,
    a tool call in the history or chat_template_kwargs its tokens were not the instance's, so
    no agent's prefix was ever found cached (the KV index matches block hashes)."""
    import functools

    from hetserve.disagg.conductor import Conductor, ConductorConfig
    from hetserve.disagg.instances import Cluster
    from hetserve.disagg.policy import Router, RouterConfig
    from hetserve.model.tokenizer import Tokenizer
    from hetserve.server.chat import chat_prompt_text

    tok = Tokenizer(tiny_model("qwen3-moe"))
    conductor = Conductor(Cluster([]), Router(RouterConfig()), tok, ConductorConfig())
    conductor.render_chat = functools.partial(chat_prompt_text, tok)
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    for extra in (
        {},
        {"tools": TOOLS},
        {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
        {"tools": TOOLS, "tool_choice": "none"},
        {"messages": history, "tools": TOOLS},
    ):
        body = {"model": "tiny", "messages": USER, "max_tokens": 1, **extra}
        kwargs = body.pop("chat_template_kwargs", None)
        more = {"extra_body": {"chat_template_kwargs": kwargs}} if kwargs else {}
        served = client.chat.completions.create(**body, **more).usage.prompt_tokens
        body.update({"chat_template_kwargs": kwargs} if kwargs else {})
        assert len(conductor.prompt_ids("/v1/chat/completions", body)) == served, extra
    # A body the instance refuses is still routed (by its messages' text).
    assert conductor.prompt_ids("/v1/chat/completions", {"messages": USER, "n": "two"})
