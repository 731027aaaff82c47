"""The Responses API's request body -> the chat request it means, checked field by field.

Who calls it: `server/responses.py`, before anything is queued. Pure translation: input items
become chat messages (a function_call_output must answer an earlier call), tools, tool_choice,
text.format and reasoning.effort become the chat request's fields. A mistake is an
InvalidInputError (a 400) naming the field as the Responses body names it, also where the
chat request's own checks find it; a media part is an UnsupportedFieldError (text-only
models).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from hetserve.errors import InvalidInputError
from hetserve.server.errors import validation_message
from hetserve.server.protocol import ChatCompletionRequest
from hetserve.server.validation import UnsupportedFieldError, is_json_type

# The body's fields read here and the JSON types they take (null: not given); what the chat
# request checks beyond the type (ranges, names, schemas) is reported under these names.
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "instructions": (str,),
    "previous_response_id": (str,),
    "temperature": (int, float),
    "top_p": (int, float),
    "max_output_tokens": (int,),
    "seed": (int,),
    "parallel_tool_calls": (bool,),
    "stream": (bool,),
    "store": (bool,),
    "tools": (list,),
    "tool_choice": (str, dict),
    "text": (dict,),
    "text.format": (dict,),
    "reasoning": (dict,),
    "reasoning.effort": (str,),
    "metadata": (dict,),
    "truncation": (str,),
    "background": (bool,),
    "include": (list,),
    "top_logprobs": (int,),
}
# What `include` may ask for: the output text's logprobs (with `top_logprobs` alternatives),
# and the reasoning items' content in a form the client can send back (base64 of the text: a
# local server keeps no secret from its client, and an earlier turn's reasoning is not
# rendered again, so it is only carried). The built-in tools' values name tools we do not run.
INCLUDE = ("message.output_text.logprobs", "reasoning.encrypted_content")
JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
              list: "a list", dict: "an object"}  # fmt: skip


def truncated(messages: list[dict], keep: int) -> list[dict] | None:
    """`truncation: "auto"`: the conversation without its oldest item after the first `keep`
    (the instructions), and without tool results whose call went with it; None where only the
    newest item would be left."""
    rest = messages[keep:]
    if len(rest) <= 1:
        return None
    rest = rest[1:]
    while len(rest) > 1 and rest[0].get("role") == "tool":
        rest = rest[1:]
    return messages[:keep] + rest


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    return next(n for t, n in JSON_TYPES.items() if isinstance(value, t))


# What the body may ask for that is not served: a 400 naming it, never silently ignored.
REFUSED = {
    "conversation": "conversations are not served; continue with previous_response_id",
    "prompt": "prompt templates are not served; send the input and instructions",
}


def check_types(body: dict) -> None:
    """Each field in FIELD_TYPES has one of its types, else a 400 naming it; a field in
    REFUSED is an UnsupportedFieldError."""
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise UnsupportedFieldError(name, why)
    for name, types in FIELD_TYPES.items():
        parent, _, key = name.rpartition(".")
        where = body.get(parent) if parent else body
        value = where.get(key) if isinstance(where, dict) else None
        if value is None:
            continue
        if not is_json_type(value, types):
            wanted = " or ".join(JSON_TYPES[t] for t in types if t is not int or float not in types)
            raise InvalidInputError(f"{name} must be {wanted}, got {json_type(value)}", name)


def included(body: dict) -> set[str]:
    """The body's `include` values, each one we serve, else a 400 naming it."""
    values = body.get("include") or []
    for i, v in enumerate(values):
        if v not in INCLUDE:
            raise InvalidInputError(
                f"include {v!r} is not supported here (supported: {', '.join(INCLUDE)})",
                f"include.{i}",
            )
    return set(values)


TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}  # -> its key
MEDIA_PARTS = ("input_image", "input_file", "input_audio")


def input_messages(items: Any, called: set[str] | None = None) -> list[dict]:
    """Responses input (a string or a list of items) -> chat messages. `called`: the call ids
    of earlier turns, which a function_call_output may answer."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise InvalidInputError("input must be a string or a list of items", "input")
    called = set(called or ())
    out: list[dict] = []
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise InvalidInputError(f"an input item must be an object, got {json_type(it)}",
                                    f"input.{i}")  # fmt: skip
        kind = it.get("type", "message")
        if kind == "message":
            if it.get("role") not in ("user", "system", "developer", "assistant"):
                raise InvalidInputError(
                    "a message item's role is user, system, developer or assistant",
                    f"input.{i}.role",
                )
            out.append({"role": it["role"], "content": message_text(it.get("content"), i)})
        elif kind == "function_call":
            fields = {k: it.get(k) for k in ("call_id", "name", "arguments")}
            fields["arguments"] = fields["arguments"] or "{}"
            for k, v in fields.items():
                if not isinstance(v, str):
                    raise InvalidInputError(f"a function_call's {k} must be a string",
                                            f"input.{i}.{k}")  # fmt: skip
            called.add(fields["call_id"])
            call = {"id": fields.pop("call_id"), "type": "function", "function": fields}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = it.get("call_id"), it.get("output")
            if call_id not in called:
                raise InvalidInputError(
                    f"function_call_output answers no earlier function_call (call_id {call_id!r})",
                    f"input.{i}.call_id",
                )
            if not isinstance(output, (str, list)):
                raise InvalidInputError(
                    "a function_call_output's output must be a string or a list of parts",
                    f"input.{i}.output",
                )
            text = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind != "reasoning":  # earlier reasoning items are not rendered again
            raise InvalidInputError(f"input item type {kind!r} is not supported", f"input.{i}")
    return out


def message_text(content: Any, i: int) -> str:
    """A message item's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidInputError("a message item's content must be a string or a list of parts",
                                f"input.{i}.content")  # fmt: skip
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"input.{i}.content.{j}"
        if kind in MEDIA_PARTS:
            raise UnsupportedFieldError(
                where, f"{kind} content parts are not supported (text-only model)"
            )
        key = TEXT_PARTS.get(kind)
        if key is None:
            raise InvalidInputError(f"unknown content part type {kind!r}", where)
        if not isinstance(part.get(key), str):
            raise InvalidInputError(f"a {kind!r} content part needs a string {key!r}", where)
        texts.append(part[key])
    return "".join(texts)


# The chat request's names for what the Responses body calls otherwise (first match wins).
THEIR_NAMES = (
    (re.compile(r"max_tokens"), "max_output_tokens"),
    (re.compile(r"reasoning_effort"), "reasoning.effort"),
    (re.compile(r"response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"tool_choice\.function"), "tool_choice"),
    (re.compile(r"tools\.(\d+)\.function"), r"tools.\1"),
    (re.compile(r"messages(\.\d+)?"), "input"),  # its messages are not the input's items
)


def chat_request(body: dict, messages: list[dict]) -> ChatCompletionRequest:
    return validated_chat(chat_body(body, messages), THEIR_NAMES)


def stateless_chat_body(body: dict) -> dict:
    """The chat request a Responses body that continues no stored response means (the P/D
    Conductor hashes and prefills it); InvalidInputError where the instance answers 400."""
    check_types(body)
    if body.get("previous_response_id") is not None:
        raise InvalidInputError("it continues a stored response", "previous_response_id")
    return chat_body(body, system_messages(body) + input_messages(body.get("input", "")))


def system_messages(body: dict) -> list[dict]:
    """`instructions` as the chat's system message (none without)."""
    text = body.get("instructions")
    return [{"role": "system", "content": text}] if text else []


def chat_body(body: dict, messages: list[dict]) -> dict:
    """The chat request's fields from the Responses body's, unchecked (`chat_request` checks)."""
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"),
                         ("max_tokens", "max_output_tokens"), ("seed", "seed"),
                         ("parallel_tool_calls", "parallel_tool_calls")):  # fmt: skip
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    tools = body.get("tools")
    if tools:
        for i, t in enumerate(tools):
            if not (isinstance(t, dict) and t.get("type") == "function"):
                raise InvalidInputError("only function tools are supported", f"tools.{i}")
        out["tools"] = [
            {
                "type": "function",
                "function": {k: t[k] for k in ("name", "description", "parameters") if k in t},
            }  # fmt: skip
            for t in tools
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}  # fmt: skip
    elif fmt is not None:
        out["response_format"] = fmt
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        out["reasoning_effort"] = effort
    if "message.output_text.logprobs" in included(body):
        out["logprobs"] = True
        out["top_logprobs"] = body.get("top_logprobs") or 0
    elif body.get("top_logprobs"):
        raise InvalidInputError(
            "top_logprobs needs include: ['message.output_text.logprobs']", "top_logprobs"
        )
    return out


def validated_chat(out: dict, names: tuple) -> ChatCompletionRequest:
    """The chat request another API's body was translated into (`out`), its checks' errors
    naming fields as that body names them (`names`, for `their_names`)."""
    try:
        return ChatCompletionRequest.model_validate(out)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise InvalidInputError(*their_names(message, param, names)) from None
    except InvalidInputError as exc:
        raise InvalidInputError(*their_names(str(exc), exc.param, names)) from None


def their_names(
    message: str, param: str | None, names: tuple = THEIR_NAMES
) -> tuple[str, str | None]:
    """An error of the chat request, with its field named as the Responses body (or, with
    other `names`, another API's body) names it."""
    if param is None:
        return message, param
    for pattern, name in names:
        found = pattern.match(param)
        if found:
            theirs = found.expand(name) + param[found.end() :]
            if message.startswith(param):
                message = theirs + message[len(param) :]
            return message, theirs
    return message, param
