"""The OpenAPI spec as the server really behaves: request bodies from the schemas the routes
validate with, 400 (not FastAPI's 422) for bad input, JSON or SSE for 200, OpenAI error
bodies for every error status, and /metrics as Prometheus text.

The routes parse their bodies themselves (pydantic's fast JSON path, one place for errors), so
FastAPI cannot infer the bodies; this module states them, and schemathesis checks the spec
against the server in the tests.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from hetserve.server.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from hetserve.server.protocol import ChatCompletionRequest
from hetserve.server.protocol_completion import CompletionRequest


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, Any] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str  # the base model's served name, or a LoRA adapter's name
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # the directory it was loaded from
    parent: str | None  # a LoRA adapter's base model (None for the base model)
    max_model_len: int
    vocab_size: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


# Each server-sent event: `data:` a JSON chunk (or an {"error": ...} object), the last `[DONE]`.
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
_SSE = {"text/event-stream": {"schema": _SSE_EVENT}}
_ERRORS = {
    "400": "invalid request (OpenAI error body naming the field)",
    "401": "missing or invalid API key",
    "404": "unknown model",
    "413": "request body too large",
    "500": "the request failed inside the engine (other requests are unaffected)",
    "503": "the engine has stopped",
}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str) -> dict:
    return {"application/json": {"schema": _ref(name)}}


def _schemas(*models: type[BaseModel]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


def _operation(spec: dict, path: str, method: str) -> dict:
    return spec["paths"][path][method]


_TEXT = {"text/plain": {"schema": {"type": "string"}}}


def _lora_operations(spec: dict, errors: dict) -> None:
    """vLLM's runtime LoRA endpoints (server/lora.py): plain text on success."""
    for path, body, ok, not_found in (
        (
            "/v1/load_lora_adapter",
            "LoadLoRAAdapterRequest",
            "the adapter is loaded and servable under lora_name",
            "runtime LoRA updates are off (--enable-lora-runtime-updates)",
        ),
        (
            "/v1/unload_lora_adapter",
            "UnloadLoRAAdapterRequest",
            "the name is forgotten (requests already running with it finish with it)",
            "runtime LoRA updates are off, or no adapter is loaded under lora_name",
        ),
    ):
        op = _operation(spec, path, "post")
        op["requestBody"] = {"required": True, "content": _json(body)}
        op["responses"] = {
            "200": {"description": ok, "content": _TEXT},
            "400": {
                "description": "invalid body, an adapter directory that cannot be served, or "
                "a name already taken",
                "content": _json("ErrorResponse"),
            },
            "401": errors["401"],
            "404": {"description": not_found, "content": _json("ErrorResponse")},
            "413": errors["413"],
        }


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        spec = get_openapi(title="hetserve", version="0.1.0", routes=app.routes)
        spec.setdefault("components", {}).setdefault("schemas", {}).update(
            _schemas(
                CompletionRequest,
                ChatCompletionRequest,
                CompletionResponse,
                ChatCompletionResponse,
                ErrorResponse,
                ModelList,
                Health,
                LoadLoRAAdapterRequest,
                UnloadLoRAAdapterRequest,
            )
        )
        errors = {
            code: {"description": d, "content": _json("ErrorResponse")}
            for code, d in _ERRORS.items()
        }
        for path, body, out in (
            ("/v1/completions", "CompletionRequest", "CompletionResponse"),
            ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse"),
        ):
            op = _operation(spec, path, "post")
            op["requestBody"] = {"required": True, "content": _json(body)}
            ok = {"description": "the completion (JSON), or SSE chunks when stream is true"}
            op["responses"] = {"200": ok | {"content": _json(out) | _SSE}, **errors}
        models = _operation(spec, "/v1/models", "get")
        models["responses"] = {
            "200": {"description": "the served model", "content": _json("ModelList")},
            "401": errors["401"],
        }
        _lora_operations(spec, errors)
        health = _operation(spec, "/health", "get")
        health["responses"] = {
            "200": {"description": "serving", "content": _json("Health")},
            "503": errors["503"],
        }
        metrics = _operation(spec, "/metrics", "get")
        metrics["responses"] = {
            "200": {
                "description": "Prometheus text exposition format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        }
        app.openapi_schema = spec
        return spec

    app.openapi = openapi
