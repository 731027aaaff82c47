"""Structured output through the official openai client: a pydantic model via `parse`,
response_format json_schema and json_object, vLLM's guided_* on both endpoints, streamed."""

import json
import re

import openai
import pytest
from pydantic import BaseModel, Field


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    kind: str = Field(pattern="^(cat|dog)$", max_length=3)


USER = [{"role": "user", "content": "hello the model"}]


def test_parse_with_a_pydantic_model(client):
    for seed in range(3):
        done = client.chat.completions.parse(
            model="tiny", messages=USER, response_format=Pet, max_tokens=120, seed=seed
        )
        pet = done.choices[0].message.parsed
        assert isinstance(pet, Pet), done.choices[0].message.content
        assert done.choices[0].finish_reason == "stop"


def test_json_object_and_stream(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=USER,
        response_format={"type": "json_object"},
        max_tokens=150,
        seed=1,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "extra,check",
    [
        ({"guided_regex": "[a-c]{2}[0-9]"}, r"^[a-c]{2}[0-9]$"),
        ({"guided_choice": ["alpha", "beta"]}, r"^(alpha|beta)$"),
        ({"structured_outputs": {"choice": ["up", "down"]}}, r"^(up|down)$"),
        ({"guided_grammar": 'start: "x" /[0-9]{1,3}/ "y"'}, r"^x[0-9]{1,3}y$"),
        (
            {"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
            r"^\[.*\]$",
        ),
    ],
)
def test_vllm_extensions_on_both_endpoints(client, extra, check):
    chat = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=40, seed=2, extra_body=extra
    )
    assert re.match(check, chat.choices[0].message.content), chat.choices[0].message.content
    cmpl = client.completions.create(
        model="tiny", prompt="hello", max_tokens=40, seed=2, extra_body=extra
    )
    assert re.match(check, cmpl.choices[0].text), cmpl.choices[0].text


def test_uncompilable_schema_is_400_naming_it(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=USER, response_format=fmt)
    assert err.value.body["param"] == "response_format.json_schema.schema"
