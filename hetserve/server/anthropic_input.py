"""Anthropic's Messages request body -> the chat request it means, checked field by field.

Who calls it: `server/anthropic.py`, before anything is queued. Pure translation: `system`,
`messages` (text, tool_use, tool_result and thinking blocks; a final assistant turn is a
prefill the reply continues), `tools` (input_schema),
`tool_choice` (auto, any, tool, none; disable_parallel_tool_use), `stop_sequences`, `thinking`,
`output_config` (format: a JSON schema; effort) and the sampling fields become the chat
request's. A mistake is an InvalidInputError (a 400)
naming the field as the Messages body names it; an image or document block, or a server tool
(web search, code execution, ...), is an UnsupportedFieldError.
"""

from __future__ import annotations

import json
from typing import Any

from hetserve.errors import InvalidInputError
from hetserve.server.responses_input import json_type
from hetserve.server.validation import UnsupportedFieldError, is_json_type

FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "max_tokens": (int,),
    "messages": (list,),
    "system": (str, list),
    "stop_sequences": (list,),
    "stream": (bool,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "tools": (list,),
    "tool_choice": (dict,),
    "thinking": (dict,),
    "metadata": (dict,),
    "output_config": (dict,),
}
# output_config.effort -> the chat request's reasoning_effort (its levels stop at high).
EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")
# hetserve's own fields, checked by the chat request: what a Conductor adds (a prefill/decode
# hand-off, the priority it routed by) and a session's or a tenant's identity.
PASSED = ("kv_handoff", "priority", "session_id", "cache_salt")


def check_types(body: dict) -> None:
    for name, types in FIELD_TYPES.items():
        value = body.get(name)
        if value is not None and not is_json_type(value, types):
            wanted = " or ".join(t.__name__ for t in types if t is not int or float not in types)
            raise InvalidInputError(f"{name}: expected {wanted}, got {json_type(value)}", name)


def chat_body(body: dict, thinking_budget: bool) -> dict[str, Any]:
    """The chat request body (for ChatCompletionRequest) a Messages body means.
    `thinking_budget`: whether `thinking.budget_tokens` can be enforced (the model has a
    thinking format the server knows); else thinking is only switched on."""
    check_types(body)
    if body.get("max_tokens") is None:
        raise InvalidInputError("max_tokens: field required", "max_tokens")
    messages = _system(body.get("system"))
    turns = body.get("messages")
    if not turns:
        raise InvalidInputError("messages: at least one message is required", "messages")
    for i, m in enumerate(turns):
        last = i == len(turns) - 1 and isinstance(m, dict) and m.get("role") == "assistant"
        if isinstance(m, dict) and m.get("content") in ("", []) and not last:
            raise InvalidInputError(  # as Anthropic's API answers
                f"messages.{i}: all messages must have non-empty content except for the "
                "optional final assistant message", f"messages.{i}.content",
            )  # fmt: skip
        messages += _message(m, i)
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages,
                           "max_tokens": body["max_tokens"]}  # fmt: skip
    last = messages[-1]
    if last["role"] == "assistant" and not last.get("tool_calls") and last["content"].strip():
        # Anthropic's prefill: a final assistant turn is continued, not closed.
        out.update(continue_final_message=True, add_generation_prompt=False)
    for name in ("temperature", "top_p", "top_k", "stream"):
        if body.get(name) is not None:
            out[name] = body[name]
    if not 0 <= out.get("temperature", 1) <= 1:  # Anthropic's range (OpenAI's goes to 2)
        raise InvalidInputError("temperature: must be between 0 and 1", "temperature")
    stops = body.get("stop_sequences")
    if stops:
        out["stop"] = stops
    user = (body.get("metadata") or {}).get("user_id")
    if isinstance(user, str):
        out["user"] = user
    for name in PASSED:
        if body.get(name) is not None:
            out[name] = body[name]
    out.update(_tools(body.get("tools"), body.get("tool_choice")))
    out.update(_thinking(body.get("thinking"), thinking_budget))
    budget = (body.get("thinking") or {}).get("budget_tokens")
    if isinstance(budget, int) and budget >= body["max_tokens"]:
        raise InvalidInputError("max_tokens must be greater than thinking.budget_tokens",
                                "thinking.budget_tokens")  # fmt: skip
    out.update(_output(body.get("output_config")))
    forced = isinstance(out.get("tool_choice"), dict) or out.get("tool_choice") == "required"
    thinking = (out.get("chat_template_kwargs") or {}).get("enable_thinking")
    if thinking and forced:  # as Anthropic refuses it
        raise InvalidInputError(
            "Thinking may not be enabled when tool_choice forces tool use.", "tool_choice"
        )
    if "response_format" in out:  # its grammar holds from the first token: no thinking to cap
        out.pop("thinking_token_budget", None)
    return out


def _output(config: Any) -> dict[str, Any]:
    """output_config: `format` (a JSON schema the reply must match) and `effort`."""
    if not config:
        return {}
    out: dict[str, Any] = {}
    fmt = config.get("format")
    if fmt is not None:
        if (
            not isinstance(fmt, dict)
            or fmt.get("type") != "json_schema"
            or not isinstance(fmt.get("schema"), dict)
        ):
            raise InvalidInputError("output_config.format: expected {type: json_schema, schema}",
                                    "output_config.format")  # fmt: skip
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt["schema"]},
        }
    effort = config.get("effort")
    if effort is not None:
        if effort not in EFFORT:
            raise InvalidInputError(f"output_config.effort: one of {', '.join(EFFORT)}",
                                    "output_config.effort")  # fmt: skip
        out["reasoning_effort"] = EFFORT[effort]
    return out


def _system(system: Any) -> list[dict]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    return [{"role": "system", "content": _texts(system, "system")}]


def _texts(blocks: list, where: str) -> str:
    """Text blocks as one string (a tool result's, the system's)."""
    texts = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind in MEDIA_BLOCKS:
            raise _media(kind, f"{where}.{j}")
        if kind != "text" or not isinstance(b.get("text"), str):
            raise InvalidInputError("expected text blocks ({type: text, text: ...})",
                                    f"{where}.{j}")  # fmt: skip
        texts.append(b["text"])
    return "\n".join(texts)


def _media(kind: str, at: str) -> UnsupportedFieldError:
    return UnsupportedFieldError(at, f"{kind} blocks are not supported (text-only model)")


def _message(m: Any, i: int) -> list[dict]:
    where = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise InvalidInputError("a message is {role: user or assistant, content}", where)
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise InvalidInputError("content: expected a string or a list of blocks",
                                f"{where}.content")  # fmt: skip
    if m["role"] == "assistant":
        return [_assistant(content, where)]
    return _user(content, where)


def _assistant(blocks: list, where: str) -> dict:
    text, calls, thinking = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise InvalidInputError("a tool_use block needs a string id and name", at)
            if not isinstance(b.get("input", {}), dict):
                raise InvalidInputError("a tool_use block's input must be an object", at)
            args = json.dumps(b.get("input", {}), ensure_ascii=False)
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": args}})  # fmt: skip
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thinking.append(b["thinking"])  # the template decides whether it is shown again
        elif kind == "redacted_thinking":
            pass
        elif kind in MEDIA_BLOCKS:
            raise _media(kind, at)
        else:
            raise InvalidInputError(f"unknown or malformed assistant block {kind!r}", at)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        msg["tool_calls"] = calls
    elif msg["content"] is None:
        msg["content"] = ""
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    return msg


def _user(blocks: list, where: str) -> list[dict]:
    """A user turn: its tool results (each a tool message, in order) and its text."""
    out: list[dict] = []
    text: list[str] = []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise InvalidInputError("a tool_result block needs a string tool_use_id", at)
            result = b.get("content", "")
            if not isinstance(result, str | list):
                raise InvalidInputError("a tool_result's content is a string or text blocks",
                                        f"{at}.content")  # fmt: skip
            body = result if isinstance(result, str) else _texts(result, f"{at}.content")
            if b.get("is_error") is True:
                body = f"Error: {body}"
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": body})
        elif kind in MEDIA_BLOCKS:
            raise _media(kind, at)
        else:
            raise InvalidInputError(f"unknown or malformed user block {kind!r}", at)
    if text:
        out.append({"role": "user", "content": "\n".join(text)})
    if not out:
        raise InvalidInputError("a user message needs at least one block", f"{where}.content")
    return out


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if tools:
        functions = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise InvalidInputError("a tool is {name, description, input_schema}",
                                        f"tools.{i}")  # fmt: skip
            if t.get("type") not in (None, "custom"):
                raise UnsupportedFieldError(
                    f"tools.{i}", f"server tool {t['type']!r} is not run by this server; "
                    "describe a client tool with name and input_schema",
                )  # fmt: skip
            if not isinstance(t.get("input_schema"), dict):
                raise InvalidInputError(f"tools.{i}.input_schema: field required (a JSON schema "
                                        "object)", f"tools.{i}.input_schema")  # fmt: skip
            fn = {"name": t["name"], "parameters": t["input_schema"]}
            if isinstance(t.get("description"), str):
                fn["description"] = t["description"]
            functions.append({"type": "function", "function": fn})
        out["tools"] = functions
    if choice is None:
        return out
    kind = choice.get("type")
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise InvalidInputError(
            "tool_choice: expected {type: auto, any, none} or {type: tool, name}", "tool_choice"
        )
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def _thinking(thinking: Any, budget_enforced: bool) -> dict[str, Any]:
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind not in ("enabled", "adaptive", "between_tools"):
        raise InvalidInputError("thinking: expected {type: enabled, budget_tokens}, adaptive, "
                                "between_tools or disabled", "thinking.type")  # fmt: skip
    out: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}}
    budget = thinking.get("budget_tokens")
    if budget is not None:
        if not is_json_type(budget, (int,)) or budget < 1:
            raise InvalidInputError("budget_tokens: expected a positive integer",
                                    "thinking.budget_tokens")  # fmt: skip
        if budget_enforced:
            out["thinking_token_budget"] = budget
    return out
