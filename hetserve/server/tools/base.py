"""What every output parser shares: the parsed view of a model's text, the helpers that find
markers and JSON in it, and the streamer that turns growing parses into deltas.

A parser is a pure function of the text generated so far: `parse(text, final)` returns the
content, the reasoning and the tool calls in it. For a text that is still growing
(`final=False`) it returns only what later text cannot change: content and reasoning without
a tail that could still be the start of a marker, a call only once its name is whole, and
arguments without a tail that could still be a closing marker. So the parse of any prefix is
a prefix of the parse of the whole, and `Streamer` sends the difference as deltas: a stream
cut anywhere adds up to the non-streamed answer.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolCall:
    name: str
    arguments: str = ""  # JSON text as the model wrote it (streamed as it grows)
    id: str | None = None  # the format's own id (Kimi's functions.NAME:IDX), else made up


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class OutputParser(Protocol):
    """A family's output format. `parse` must be prefix-consistent (see the module)."""

    def parse(self, text: str, final: bool) -> Parsed: ...


def holdback(text: str, markers: tuple[str, ...]) -> int:
    """Characters at the end of `text` that could be the start of one of `markers`."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def cut(text: str, final: bool, markers: tuple[str, ...]) -> str:
    """`text` without a tail that may still become a marker (unless it is final)."""
    if final:
        return text
    n = holdback(text, markers)
    return text[: len(text) - n] if n else text


def split_blocks(text: str, begin: str, end: str) -> tuple[list[str], list[tuple[str, bool]]]:
    """The text outside begin..end blocks, and each block's body with whether it is closed."""
    outside: list[str] = []
    blocks: list[tuple[str, bool]] = []
    pos = 0
    while True:
        i = text.find(begin, pos)
        if i < 0:
            outside.append(text[pos:])
            return outside, blocks
        outside.append(text[pos:i])
        j = text.find(end, i + len(begin))
        if j < 0:
            blocks.append((text[i + len(begin) :], False))
            return outside, blocks
        blocks.append((text[i + len(begin) : j], True))
        pos = j + len(end)


def json_value_end(text: str, start: int) -> int | None:
    """The end of the JSON value starting at `start` (after whitespace), None if it does not
    parse (yet)."""
    try:
        _, end = json.JSONDecoder().raw_decode(text, start + _skip_ws(text, start))
    except ValueError:
        return None
    return end


def _skip_ws(text: str, start: int) -> int:
    return len(text[start:]) - len(text[start:].lstrip())


def call_from_json(
    body: str,
    final: bool,
    name_keys: tuple[str, ...] = ("name",),
    arg_keys: tuple[str, ...] = ("arguments", "parameters"),
) -> ToolCall | None:
    """A {"name": ..., "arguments": {...}} object (whole or growing) -> ToolCall or None.
    The arguments are the raw text of the value; while it grows, without the trailing braces
    and spaces that may be the wrapper's own end."""
    name = _json_string_field(body, name_keys)
    if name is None:
        return None
    for key in arg_keys:
        k = body.find(f'"{key}"')
        if k < 0:
            continue
        colon = body.find(":", k + len(key) + 2)
        if colon < 0:
            return ToolCall(name)
        start = colon + 1 + _skip_ws(body, colon + 1)
        end = json_value_end(body, start)
        if end is not None:
            raw = body[start:end]
            if raw.startswith('"'):  # arguments given as a JSON string of JSON
                raw = json.loads(raw)
            return ToolCall(name, raw)
        if final:
            return ToolCall(name, body[start:].rstrip().removesuffix("}").rstrip())
        return ToolCall(name, body[start:].rstrip(" \n\t}"))
    return ToolCall(name, "{}" if final else "")


def _json_string_field(body: str, keys: tuple[str, ...]) -> str | None:
    """The value of the first of `keys` in a (possibly partial) JSON object, once its string
    is closed."""
    for key in keys:
        k = body.find(f'"{key}"')
        if k < 0:
            continue
        colon = body.find(":", k + len(key) + 2)
        if colon < 0:
            return None
        start = colon + 1 + _skip_ws(body, colon + 1)
        end = json_value_end(body, start)
        if end is None:
            return None
        value = json.loads(body[start:end])
        return value if isinstance(value, str) else None
    return None


class Streamer:
    """Deltas of a growing parse: feed the whole text so far, get what is new since the last
    feed (OpenAI's delta shapes are built by the server)."""

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.sent = Parsed()
        self.ids: list[str] = []

    def feed(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """(content delta, reasoning delta, tool-call deltas as
        {index, id?, name?, arguments})."""
        now = self.parser.parse(text, final)
        # Trailing whitespace waits for what follows: after words it goes out with the next
        # ones; beside calls, whitespace alone (between two calls) is no content at all.
        shown = now.content if final else now.content.rstrip()
        if final and now.calls and not shown.strip():
            shown = ""
        content = _suffix(self.sent.content, shown)
        reasoning = _suffix(self.sent.reasoning, now.reasoning)
        calls: list[dict[str, Any]] = []
        for i, call in enumerate(now.calls):
            if i >= len(self.sent.calls):
                self.ids.append(call.id or new_call_id())
                self.sent.calls.append(ToolCall(call.name, "", call.id))
                calls.append({"index": i, "id": self.ids[i], "name": call.name, "arguments": ""})
            delta = _suffix(self.sent.calls[i].arguments, call.arguments)
            if delta:
                if calls and calls[-1]["index"] == i:
                    calls[-1]["arguments"] += delta
                else:
                    calls.append({"index": i, "arguments": delta})
            self.sent.calls[i].arguments = call.arguments
        self.sent.content, self.sent.reasoning = shown, now.reasoning
        return content, reasoning, calls


def _suffix(old: str, new: str) -> str:
    # A parser bug would break the prefix rule; then send nothing rather than garbage.
    return new[len(old) :] if new.startswith(old) else ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
