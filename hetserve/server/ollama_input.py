"""Ollama's request bodies read as the OpenAI chat requests they mean, for server/ollama.py.

Called by the Ollama routes before anything runs: every field the routes read is checked for its
JSON type and range here, and a wrong one is an InvalidInputError (a 400 in Ollama's shape)
naming the field as Ollama names it (`options.num_predict`, not `max_tokens`). Pure translation:
no I/O, no engine.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from hetserve.errors import InvalidInputError
from hetserve.server.errors import validation_message
from hetserve.server.protocol import ChatCompletionRequest
from hetserve.server.validation import is_json_type

OPTION_FIELDS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# The Ollama field each OpenAI request field comes from (a 400 names the one the client sent).
OLLAMA_FIELDS = {
    **{field: f"options.{name}" for name, field in OPTION_FIELDS.items()},
    "max_tokens": "options.num_predict",
    "response_format": "format",
    "reasoning_effort": "think",
    "chat_template_kwargs": "think",
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
}
THINK_LEVELS = ("low", "medium", "high")  # gpt-oss's; true/false for the others
NUMBER = r"(\d+\.?\d*|\.\d+)"
DURATION = re.compile(NUMBER + "(ns|us|µs|ms|s|m|h)")  # Go's time.ParseDuration units
SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def typed(value: Any, kinds: tuple[type, ...], field: str, what: str) -> Any:
    """`value` when null or one of `kinds` (a bool is not a number); else a 400 naming `field`."""
    if value is None or is_json_type(value, kinds):
        return value
    raise InvalidInputError(f"{field} must be {what}", field)


def keep_alive_seconds(value: Any) -> float | None:
    """Ollama's keep_alive in seconds (None when absent): a number of seconds or a duration
    such as "5m" or "1h30m" (negative: for ever)."""
    typed(value, (int, float, str), "keep_alive", "a number of seconds or a duration like '5m'")
    if not isinstance(value, str):
        return None if value is None else float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text[1:] if text[:1] in ("-", "+") else text
    if re.fullmatch(NUMBER, text):  # seconds, as some clients send them
        return sign * float(text)
    if not text or DURATION.sub("", text):
        raise InvalidInputError(f"keep_alive {value!r} is not a duration like '5m'", "keep_alive")
    return sign * sum(float(n) * SECONDS[u] for n, u in DURATION.findall(text))


def check_fields(body: dict[str, Any]) -> None:
    """400 for a field of the wrong JSON type, named as Ollama names it (the load and unload
    calls included, which generate nothing)."""
    typed(body.get("stream"), (bool,), "stream", "true or false")
    typed(body.get("options"), (dict,), "options", "an object")
    typed(body.get("format"), (str, dict), "format", "'json' or a JSON schema object")
    typed(body.get("tools"), (list,), "tools", "a list")
    typed(body.get("logprobs"), (bool,), "logprobs", "true or false")
    typed(body.get("top_logprobs"), (int,), "top_logprobs", "an integer")
    if body.get("template"):  # a Go template of the Modelfile's kind: not run here
        raise InvalidInputError("template is not supported: the model's own chat template is "
                                "used; send raw: true with the prompt written out instead",
                                "template")  # fmt: skip
    think = body.get("think")
    if think is not None and not isinstance(think, bool) and think not in THINK_LEVELS:
        raise InvalidInputError("think must be true, false, 'low', 'medium' or 'high'", "think")
    keep_alive_seconds(body.get("keep_alive"))


def no_images(images: Any, field: str) -> None:
    """A 400 for images (the models served are text-only); an empty list is no images."""
    if typed(images, (list,), field, "a list"):
        raise InvalidInputError("images are not supported (text-only model)", field)


def openai_request(body: dict[str, Any], messages: list[dict]) -> ChatCompletionRequest:
    """The OpenAI chat request an Ollama request means (400s name the Ollama field)."""
    predict = (body.get("options") or {}).get("num_predict")
    if predict is not None:
        if typed(predict, (int,), "options.num_predict", "an integer") == 0 or predict < -2:
            raise InvalidInputError("options.num_predict must be -1, -2 or >= 1",
                                    "options.num_predict")  # fmt: skip
    out = openai_body(body, messages)
    try:
        req = ChatCompletionRequest.model_validate(out)
        req.capped()  # num_predict: at most, as the context allows
        return req
    except ValidationError as exc:
        message, param = validation_message(exc)
        head, _, rest = (param or "").partition(".")
        if head not in OLLAMA_FIELDS:
            raise
        field = OLLAMA_FIELDS[head] + (f".{rest}" if rest else "")
        if message.startswith(param or ""):
            message = field + message.removeprefix(param or "")
        else:
            message = f"{field}: {message}"
        raise InvalidInputError(message, field) from None


def openai_body(body: dict[str, Any], messages: list[dict]) -> dict[str, Any]:
    """The OpenAI chat request's fields from an Ollama body's, unchecked (`openai_request`
    checks them). A P/D Conductor's hand-off part rides along."""
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    options = body.get("options") or {}
    for name, field in OPTION_FIELDS.items():
        if options.get(name) is not None:
            out[field] = options[name]
    predict = options.get("num_predict")
    if isinstance(predict, int) and predict > 0:
        out["max_tokens"] = predict
    if body.get("logprobs"):  # Ollama's: the chosen tokens', with top_logprobs alternatives
        out["logprobs"] = True
        out["top_logprobs"] = body.get("top_logprobs") or 0
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "format", "schema": fmt, "strict": True},
        }
    elif fmt not in (None, ""):
        raise InvalidInputError("format must be 'json' or a JSON schema object", "format")
    if body.get("tools"):
        out["tools"] = body["tools"]
    think = body.get("think")
    if think is not None:
        out["chat_template_kwargs"] = {"enable_thinking": bool(think)}
        if isinstance(think, str):  # gpt-oss: "low" | "medium" | "high"
            out["reasoning_effort"] = think
    if body.get("kv_handoff") is not None:
        out["kv_handoff"] = body["kv_handoff"]
    return out


def openai_messages(messages: Any) -> list[dict]:
    """Ollama messages (tool calls with object arguments, tool results with tool_name) in
    OpenAI's shape."""
    if not isinstance(messages, list):
        raise InvalidInputError("messages must be a list", "messages")
    out, pending = [], []
    for i, m in enumerate(messages):
        at = f"messages.{i}"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidInputError(f"{at} must be an object with a string role", at)
        no_images(m.get("images"), f"{at}.images")
        content = typed(m.get("content"), (str,), f"{at}.content", "a string")
        msg: dict[str, Any] = {"role": m["role"], "content": content or ""}
        if typed(m.get("thinking"), (str,), f"{at}.thinking", "a string"):
            msg["reasoning_content"] = m["thinking"]
        calls = typed(m.get("tool_calls"), (list,), f"{at}.tool_calls", "a list") or []
        if calls:
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                call = openai_call(c, f"{at}.tool_calls.{j}", f"call_{len(pending)}_{i}")
                pending.append((call["id"], call["function"]["name"] or None))
                msg["tool_calls"].append(call)
        if m["role"] == "tool":  # answers the oldest call of that name (Ollama has no ids)
            name = typed(m.get("tool_name"), (str,), f"{at}.tool_name", "a string")
            name = name or typed(m.get("name"), (str,), f"{at}.name", "a string")
            match = next((p for p in pending if name is None or p[1] == name), None)
            msg["tool_call_id"] = match[0] if match else "call_none"
            if match:
                pending.remove(match)
            msg["name"] = name
        out.append(msg)
    return out


def openai_call(call: Any, at: str, cid: str) -> dict:
    """An Ollama tool call ({"function": {"name", "arguments": {...}}}) in OpenAI's shape."""
    fn = typed(call, (dict,), at, "an object") or {}
    fn = typed(fn.get("function"), (dict,), f"{at}.function", "an object") or {}
    name = typed(fn.get("name"), (str,), f"{at}.function.name", "a string") or ""
    args = typed(fn.get("arguments"), (dict, str), f"{at}.function.arguments", "an object")
    args = args if isinstance(args, str) else json.dumps(args or {})
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def conductor_chat_body(body: dict[str, Any], generate: bool = False) -> dict[str, Any]:
    """The chat request an Ollama /api/chat (or, `generate`, /api/generate) body means, for the
    P/D Conductor to hash and prefill; InvalidInputError where it is no chat turn to route
    (a load or unload call, generate's raw or fill-in-the-middle prompt) or the instance
    answers 400."""
    check_fields(body)
    if not generate:
        messages = openai_messages(typed(body.get("messages"), (list,), "messages", "a list"))
    else:
        prompt = typed(body.get("prompt"), (str,), "prompt", "a string")
        system = typed(body.get("system"), (str,), "system", "a string")
        if body.get("raw") or body.get("suffix"):
            raise InvalidInputError("a prompt as written is no chat turn", "raw")
        messages = generate_messages(system, prompt) if prompt else []
    if not messages:
        raise InvalidInputError("a load or unload call generates nothing", "messages")
    return openai_body(body, messages)


def generate_messages(system: str | None, prompt: str) -> list[dict]:
    """The chat turn an /api/generate prompt (with its `system`) is rendered as."""
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": prompt}]
