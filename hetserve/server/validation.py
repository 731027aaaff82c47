"""Rules a request must meet beyond each field's own type and range: relations between fields,
the content each message role may carry, and features we do not implement.

Every rule raises an error whose `param` names the field it is about, so the client gets a 400
with OpenAI's `error.param` set (see server/errors.py). The sources are OpenAI's API reference
(/v1/chat/completions, /v1/completions) and vLLM's request validators, whose extensions many
clients send; each rule says which.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hetserve.errors import InvalidInputError


class UnsupportedFieldError(InvalidInputError):
    """A request asks for a feature this server does not implement (answered with a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message, param)


# Fields that would change the output and that we do not implement (any non-null value).
UNSUPPORTED = (
    "audio",
    "logits_processors",
    "web_search_options",
)

# vLLM's extensions that would change the output and that we do not implement, with the values
# that ask for nothing (some clients send the defaults explicitly; those are accepted).
VLLM_EXTENSIONS: dict[str, tuple[Any, ...]] = {
    "logprob_token_ids": (None,),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
}
COMPLETION_EXTENSIONS = CHAT_EXTENSIONS = VLLM_EXTENSIONS


async def json_object(request: Any) -> dict[str, Any]:
    """A route's body read as a JSON object (an empty body as {}), else a 400 saying which it
    is not. For the routes that check raw bodies field by field (Responses, Anthropic's,
    Ollama's, /tokenize)."""
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise InvalidInputError("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidInputError("request body must be a JSON object")
    return body


def is_json_type(value: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a parsed JSON `value` is one of `kinds`, as JSON types go: a boolean is not a
    number (Python's bool is an int). Shared by the routes that check raw bodies field by field
    (Ollama's, the Responses API's)."""
    return isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))


def check_unsupported(extra: Mapping[str, Any], extensions: Mapping[str, tuple]) -> None:
    """Unknown fields pass (OpenAI clients send many), but not one that asks for a feature we
    do not implement: other modalities, vLLM's extensions. (Structured output is read by
    server/structured.py.)"""
    _check_tools(extra)
    for name in UNSUPPORTED:
        if extra.get(name) is not None:
            raise UnsupportedFieldError(name, f"{name} is not supported by this server")
    modalities = extra.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise UnsupportedFieldError("modalities", "only the 'text' modality is supported")
    for name, harmless in extensions.items():
        if name in extra and not any(_same(extra[name], h) for h in harmless):
            raise UnsupportedFieldError(
                name,
                f"{name} (a vLLM extension) is not supported by this server; omit it or send "
                "vLLM's default",
            )


def _same(value: Any, harmless: Any) -> bool:
    # Type-exact: 0 == False in Python, but `echo: 0` is not the JSON false vLLM accepts.
    return type(value) is type(harmless) and value == harmless


def _check_tools(extra: Mapping[str, Any]) -> None:
    """OpenAI's deprecated function calling (functions, function_call) is refused with the
    fields to use instead; tools and tool_choice are read by server/tool_calls.py."""
    for name, instead in (("functions", "tools"), ("function_call", "tool_choice")):
        if extra.get(name) is not None:
            raise UnsupportedFieldError(
                name, f"{name} (deprecated by OpenAI) is not supported; use {instead}"
            )


def check_stream_options(stream: bool, stream_options: object) -> None:
    # OpenAI: "Only set this when you set stream: true"; vLLM rejects it too.
    if stream_options is not None and not stream:
        raise InvalidInputError(
            "stream_options is only allowed when stream is true", "stream_options"
        )


def check_min_tokens(min_tokens: int, limit: int | None, limit_name: str) -> None:
    # vLLM: min_tokens <= max_tokens (we used to cap it silently).
    if limit is not None and min_tokens > limit:
        raise InvalidInputError(
            f"min_tokens ({min_tokens}) must not exceed {limit_name} ({limit})", "min_tokens"
        )


def check_logit_bias(bias: Mapping[str, float]) -> None:
    for key, value in bias.items():
        # isdecimal, not isdigit: '²' is a digit that int() refuses.
        if not (key.isascii() and key.isdecimal()):
            raise InvalidInputError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise InvalidInputError(
                f"logit_bias values must be in [-100, 100], got {value}", "logit_bias"
            )


# ---- messages (OpenAI's message types, one per role) ---------------------------------------------
MEDIA_PARTS = ("image_url", "input_audio", "file", "video_url", "audio_url")  # the last two: vLLM
ALLOWED_PARTS = {
    "system": ("text",),
    "developer": ("text",),
    "user": ("text", *MEDIA_PARTS),
    "assistant": ("text", "refusal"),
    "tool": ("text",),
}


def check_message(role: str, content: str | list[dict[str, Any]] | None, extra: Mapping) -> None:
    """One message against its role's type in OpenAI's reference. Raises with `param` relative
    to the message ("content", "tool_call_id", ...)."""
    for name in ("function_call", "audio"):
        if extra.get(name):  # an assistant's deprecated function call or audio reply
            raise UnsupportedFieldError(name, f"{name} in messages are not supported")
    calls = extra.get("tool_calls")
    if calls is not None:
        _check_calls(role, calls)
    if content is None and not (role == "assistant" and calls):
        # Only an assistant message with tool_calls may omit it.
        raise InvalidInputError(f"a {role} message needs content", "content")
    if content is None:
        return
    if isinstance(content, list):
        _check_parts(role, content)
    if role == "tool" and not isinstance(extra.get("tool_call_id"), str):
        raise InvalidInputError("a tool message needs a string tool_call_id", "tool_call_id")


def _check_calls(role: str, calls: Any) -> None:
    """An assistant's earlier tool calls: [{id, type: function, function: {name, arguments}}]."""
    if role != "assistant":
        raise InvalidInputError("only assistant messages carry tool_calls", "tool_calls")
    if not isinstance(calls, list):
        raise InvalidInputError("tool_calls must be a list", "tool_calls")
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        ok = (
            isinstance(c, dict)
            and isinstance(c.get("id"), str)
            and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
            and isinstance(fn.get("arguments"), str)
        )
        if not ok:
            raise InvalidInputError(
                'a tool call is {"id": str, "type": "function", "function": {"name": str, '
                '"arguments": str}}',
                f"tool_calls.{i}",
            )


def _check_parts(role: str, parts: list[dict[str, Any]]) -> None:
    if not parts:
        raise InvalidInputError("content must not be an empty list", "content")
    allowed = ALLOWED_PARTS[role]
    for part in parts:
        kind = part.get("type")
        if kind not in ("text", "refusal", *MEDIA_PARTS):
            raise InvalidInputError(f"unknown content part type {kind!r}", "content")
        if kind not in allowed:
            raise InvalidInputError(
                f"a {role} message's content parts can only be {' or '.join(allowed)}; "
                f"got {kind!r}",
                "content",
            )
        if kind in MEDIA_PARTS:
            raise UnsupportedFieldError(
                "content", f"{kind} content parts are not supported (text-only model)"
            )
        if not isinstance(part.get(kind), str):
            raise InvalidInputError(f"a {kind!r} content part needs a string {kind!r}", "content")


def check_tool_replies(messages: list[tuple[str, Mapping[str, Any]]]) -> None:
    """OpenAI: a tool message answers a tool call of an earlier assistant message. `messages`:
    (role, extra fields) of each message in order."""
    called: set[str] = set()
    for i, (role, extra) in enumerate(messages):
        if role == "assistant":
            called |= {c.get("id") for c in extra.get("tool_calls") or () if isinstance(c, dict)}
        elif role == "tool" and extra.get("tool_call_id") not in called:
            raise InvalidInputError(
                f"tool message {i} answers no tool call of an earlier assistant message "
                f"(tool_call_id {extra.get('tool_call_id')!r})",
                f"messages.{i}.tool_call_id",
            )
