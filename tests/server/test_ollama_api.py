"""Ollama's API through the official `ollama` client: chat, generate, streams, tools, format
and think; the listing routes; errors in Ollama's shape."""

import json

import httpx
import jsonschema_rs
import ollama
import pytest

from hetserve.config import EngineConfig
from hetserve.engine.async_llm import AsyncLLM
from tests.server.conftest import LiveServer

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"type": "integer",
                   "minimum": 0, "maximum": 9}},
    "required": ["city", "n"],
    "additionalProperties": False,
}  # fmt: skip
USER = [{"role": "user", "content": "hello the model"}]


@pytest.fixture(scope="module")
def srv(tiny_model):
    engine = AsyncLLM(EngineConfig(model=str(tiny_model("qwen3-moe")), max_model_len=1024))
    s = LiveServer(engine)
    yield s
    s.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(srv):
    return ollama.Client(host=srv.url)


def test_listing_routes(client, srv):
    listed = httpx.get(srv.url + "/api/tags").json()["models"]
    assert [(m["name"], m["model"]) for m in listed] == [("tiny:latest", "tiny:latest")]
    assert [m.model for m in client.ps().models] == ["tiny:latest"]
    for name in ("tiny", "tiny:latest"):
        show = client.show(name)
        assert "tools" in show.capabilities and "thinking" in show.capabilities
        assert "<tool_call>" in show.template
    assert httpx.get(srv.url + "/api/version").json()["version"]


def test_chat_and_stream_agree(client):
    opts = {"num_predict": 12, "seed": 4, "temperature": 0.7, "top_k": 20, "repeat_penalty": 1.1}
    whole = client.chat(model="tiny", messages=USER, options=opts, stream=False)
    assert whole.done and whole.eval_count == 12 and whole.done_reason == "length"
    assert whole.prompt_eval_count > 0
    parts = list(client.chat(model="tiny", messages=USER, options=opts, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content


def test_generate_and_stream(client):
    whole = client.generate(model="tiny", prompt="hello", options={"num_predict": 6, "seed": 1})
    parts = list(client.generate(model="tiny", prompt="hello", stream=True,
                                 options={"num_predict": 6, "seed": 1}))  # fmt: skip
    assert "".join(p.response for p in parts) == whole.response and whole.eval_count == 6


@pytest.mark.parametrize(("keep_alive", "reason"), [(None, "load"), ("5m", "load"), (-1, "load"),
                                                    (0, "unload"), ("0s", "unload")])  # fmt: skip
def test_load_and_unload_calls(client, srv, keep_alive, reason):
    chat = client.chat(model="tiny", messages=[], keep_alive=keep_alive)
    assert chat.done and chat.done_reason == reason and chat.eval_count is None
    assert (chat.message.role, chat.message.content) == ("assistant", "")
    gen = client.generate(model="tiny", prompt="", keep_alive=keep_alive)
    assert gen.done and gen.done_reason == reason and gen.response == ""
    bare = {"model": "tiny", "keep_alive": keep_alive, "stream": True}  # no messages, no prompt
    for route in ("chat", "generate"):
        assert httpx.post(f"{srv.url}/api/{route}", json=bare).json()["done_reason"] == reason


@pytest.mark.parametrize("fmt", ["json", SCHEMA])
def test_format_constrains_the_reply(client, fmt):
    r = client.chat(model="tiny", messages=USER, format=fmt, options={"num_predict": 200,
                    "seed": 2})  # fmt: skip
    assert r.message.content.startswith("{")
    if fmt == SCHEMA:
        jsonschema_rs.validate(SCHEMA, json.loads(r.message.content))
    gen = client.generate(model="tiny", prompt="hi", format=fmt, options={"num_predict": 200,
                          "seed": 3})  # fmt: skip
    assert gen.response.startswith("{")  # any object may not end within 200 tokens
    if gen.done_reason == "stop":
        assert isinstance(json.loads(gen.response), dict)


def test_tools_and_think(client):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
    history = [
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "n": 1}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "cold"},
    ]  # fmt: skip
    r = client.chat(model="tiny", messages=history, tools=[tool], options={"num_predict": 4})
    assert r.done and r.prompt_eval_count > 60
    on = client.chat(model="tiny", messages=USER, think=True, options={"num_predict": 1})
    off = client.chat(model="tiny", messages=USER, think=False, options={"num_predict": 1})
    assert off.prompt_eval_count > on.prompt_eval_count  # the empty <think></think>


def test_the_latest_tag_names_the_served_model(client, srv):
    assert client.list().models[0].model == "tiny:latest"  # what a client sends back
    r = client.chat(model="tiny:latest", messages=USER, options={"num_predict": 1})
    assert r.done and r.eval_count == 1 and r.model == "tiny:latest"  # echoed as sent
    r = client.generate(model="tiny:latest", prompt="hi", options={"num_predict": 1})
    assert r.done and r.eval_count == 1 and r.model == "tiny:latest"
    lines = list(client.chat(model="tiny:latest", messages=USER, stream=True))
    assert {line.model for line in lines} == {"tiny:latest"}
    assert client.chat(model="tiny:latest", messages=[]).model == "tiny:latest"  # a load call
    assert client.generate(model="tiny", prompt="hi", options={"num_predict": 1}).model == "tiny"
    for route in ("chat", "generate", "show"):
        body = {"model": "tiny:7b", "messages": USER, "prompt": "hi"}
        r = httpx.post(f"{srv.url}/api/{route}", json=body)
        assert r.status_code == 404 and "'tiny:7b'" in r.json()["error"], r.text
        assert "serves 'tiny'" in r.json()["error"]
    openai = {"model": "tiny:latest", "messages": USER, "max_tokens": 1}
    assert httpx.post(srv.url + "/v1/chat/completions", json=openai).status_code == 404


def test_errors_in_ollama_shape(client, srv):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="nope", messages=USER)
    assert err.value.status_code == 404 and "nope" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="tiny", messages=USER, options={"temperature": 9})
    assert err.value.status_code == 400 and "temperature" in err.value.error
    r = httpx.post(srv.url + "/api/chat", json={"model": "tiny", "messages": USER,
                                                  "format": "xml"})  # fmt: skip
    assert r.status_code == 400 and "format" in r.json()["error"]
    for route, rest in (("chat", {"messages": USER}), ("generate", {"prompt": "hi"}),
                        ("show", {})):  # fmt: skip
        r = httpx.post(srv.url + f"/api/{route}", json=rest)  # no model: as Ollama, a 400
        assert r.status_code == 400 and r.json() == {"error": "model is required"}


def test_num_predict_is_a_cap_the_context_lowers(client, srv):
    """Ollama's num_predict is at most so many tokens: past the context it stops there (a
    32,000 on a 1,024-token context was a 400)."""
    for reply in (client.chat(model="tiny", messages=USER, options={"num_predict": 32000,
                                                                     "seed": 1}),
                  client.generate(model="tiny", prompt="hi", options={"num_predict": 32000,
                                                                       "seed": 1})):  # fmt: skip
        assert reply.done and reply.done_reason in ("stop", "length")
        assert 0 < reply.eval_count <= 1024 - reply.prompt_eval_count
    show = client.show("tiny")
    assert show.modelinfo["qwen3_moe.context_length"] == 1024


CALL = {"role": "assistant", "content": ""}


@pytest.mark.parametrize(
    ("route", "fields", "named"),
    [
        ("chat", {"messages": [{**CALL, "tool_calls": ["x"]}]}, "messages.0.tool_calls.0"),
        ("chat", {"messages": [{**CALL, "tool_calls": [{"function": "f"}]}]},
         "messages.0.tool_calls.0.function"),
        ("chat", {"messages": [{**CALL, "tool_calls": {"function": {}}}]},
         "messages.0.tool_calls"),
        ("chat", {"messages": [{**CALL, "tool_calls": [{"function": {"name": "f",
         "arguments": [1]}}]}]}, "messages.0.tool_calls.0.function.arguments"),
        ("chat", {"messages": [*USER, 5]}, "messages.1"),
        ("chat", {"messages": {"role": "user"}}, "messages"),
        ("chat", {"messages": [{"role": "user", "content": ["x"]}]}, "messages.0.content"),
        ("chat", {"messages": [{"role": "user", "content": "x", "images": "b64"}]},
         "messages.0.images"),
        ("chat", {"messages": [{**CALL, "thinking": 5}]}, "messages.0.thinking"),
        ("chat", {"messages": [{"role": "tool", "content": "x", "tool_name": 5}]},
         "messages.0.tool_name"),
        ("chat", {"messages": USER, "options": []}, "options"),
        ("chat", {"messages": USER, "options": {"repeat_penalty": "x"}}, "options.repeat_penalty"),
        ("chat", {"messages": USER, "options": {"num_predict": True}}, "options.num_predict"),
        ("chat", {"messages": USER, "format": 5}, "format"),
        ("chat", {"messages": USER, "tools": {"type": "function"}}, "tools"),
        ("chat", {"messages": USER, "think": [1]}, "think"),
        ("chat", {"messages": USER, "think": "yes"}, "think"),
        ("chat", {"messages": USER, "keep_alive": [1]}, "keep_alive"),
        ("chat", {"messages": USER, "keep_alive": "5 minutes"}, "keep_alive"),
        ("chat", {"messages": USER, "stream": "false"}, "stream"),
        ("chat", {"model": ["tiny"], "messages": USER}, "model"),
        ("generate", {"prompt": ["hi"]}, "prompt"),
        ("generate", {"prompt": "hi", "system": 5}, "system"),
        ("generate", {"prompt": "hi", "raw": "no"}, "raw"),
        ("generate", {"prompt": "", "options": "x"}, "options"),
        ("generate", {"prompt": "", "keep_alive": {}}, "keep_alive"),
        ("generate", {"prompt": "hi", "images": "b64"}, "images"),
    ],
)  # fmt: skip
def test_wrong_json_types_are_400s_naming_the_field(srv, route, fields, named):
    r = httpx.post(f"{srv.url}/api/{route}", json={"model": "tiny", **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"].split()[0].removesuffix(":") == named, r.json()


def test_images_are_refused_by_chat_and_generate(client):
    for call in (
        lambda: client.generate(model="tiny", prompt="what is this", images=[b"\x89PNG"]),
        lambda: client.chat(model="tiny", messages=[{**USER[0], "images": [b"\x89PNG"]}]),
    ):
        with pytest.raises(ollama.ResponseError) as err:
            call()
        assert err.value.status_code == 400 and "images are not supported" in err.value.error
    r = client.generate(model="tiny", prompt="hi", images=[], options={"num_predict": 1})
    assert r.done and r.eval_count == 1


@pytest.mark.parametrize("keep_alive", [0, -1, 2.5, "0", "5m", "1h30m", "-1m", "300ms"])
def test_keep_alive_takes_seconds_or_durations(client, keep_alive):
    r = client.chat(model="tiny", messages=USER, keep_alive=keep_alive, options={"num_predict": 1})
    assert r.done and r.eval_count == 1


def test_generate_gives_back_its_context_and_continues_from_one(client, srv):
    """Ollama's (deprecated, still sent) `context`: an answer's token ids, prompt and reply,
    that a later generate puts in front of its own prompt as their text. Ignored before: a
    client keeping a conversation this way lost it at every turn."""
    opts = {"num_predict": 5, "temperature": 0}
    first = client.generate(model="tiny", prompt="hello the model", options=opts)
    assert len(first.context) == first.prompt_eval_count + first.eval_count
    tok = srv.engine.engine.tokenizer
    turn = tok.apply_chat_template([{"role": "user", "content": "and then"}], True)
    want = tok.encode(tok.decode(first.context, skip_special_tokens=False) + turn)
    again = client.generate(model="tiny", prompt="and then", options=opts, context=first.context)
    assert again.prompt_eval_count == len(want) and again.context[: len(want)] == want
    lines = list(client.generate(model="tiny", prompt="and then", options=opts, stream=True,
                                 context=first.context))  # fmt: skip
    assert lines[-1].context == again.context and not any(p.context for p in lines[:-1])
    raw = client.generate(model="tiny", prompt="x", options=opts, raw=True)
    assert not raw.context  # as Ollama: none for a raw prompt
    for bad in (["a"], [10**9], [True]):
        r = httpx.post(srv.url + "/api/generate", timeout=30,
                       json={"model": "tiny", "prompt": "p", "context": bad, "stream": False})
        assert r.status_code == 400 and "context" in r.json()["error"], r.text


def test_logprobs_as_ollama_gives_them(client):
    """Ollama's logprobs (0.12.11): the chosen tokens' with top_logprobs alternatives, in the
    reply and spread over a stream's lines; they were ignored."""
    for generate in (False, True):
        ask = dict(model="tiny", logprobs=True, top_logprobs=2,
                   options={"num_predict": 6, "temperature": 0})  # fmt: skip
        call = client.generate if generate else client.chat
        arg = {"prompt": "hello"} if generate else {"messages": USER}
        whole = call(**ask, **arg)
        assert len(whole.logprobs) == whole.eval_count == 6
        for e in whole.logprobs:
            assert e.logprob <= 0 and len(e.top_logprobs) == 2
            assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        lines = list(call(**ask, **arg, stream=True))
        streamed = [e for line in lines for e in (line.logprobs or [])]
        assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
            (e.token, round(e.logprob, 4)) for e in whole.logprobs]
        assert len(streamed) == lines[-1].eval_count
    plain = client.chat(model="tiny", messages=USER, options={"num_predict": 2})
    assert plain.logprobs is None


def test_a_go_template_is_refused_not_ignored(srv):
    r = httpx.post(srv.url + "/api/generate", json={"model": "tiny", "prompt": "hi",
                                                      "template": "{{ .Prompt }}"})  # fmt: skip
    assert r.status_code == 400 and "raw" in r.json()["error"]
