"""Tool-call formats of the families, each as published in its chat template (see
hetserve/testing/chat_templates.py for the renderings these parse back):

- hermes (Qwen2.5, Qwen3, Hermes): <tool_call>{"name": ..., "arguments": {...}}</tool_call>
- llama3_json (Llama 3.1-3.3): the reply is {"name": ..., "parameters": {...}} (several
  joined by ';'), optionally after <|python_tag|>
- deepseek_v3 (DeepSeek-V3, R1-0528, and V3.1's shorter form):
  <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
- kimi_k2: <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>
- glm45 (GLM-4.5, 4.6): <tool_call>NAME <arg_key>K</arg_key><arg_value>V</arg_value></tool_call>
"""

from __future__ import annotations

import json
from typing import Any

from hetserve.server.tools.base import (
    Parsed,
    ToolCall,
    call_from_json,
    cut,
    json_value_end,
    split_blocks,
)


class HermesParser:
    BEGIN, END = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def parse(self, text: str, final: bool) -> Parsed:
        outside, blocks = split_blocks(text, self.BEGIN, self.END)
        if not blocks or blocks[-1][1]:  # the text ends outside a block
            outside[-1] = cut(outside[-1], final, (self.BEGIN,))
        calls = []
        for body, closed in blocks:
            call = call_from_json(body, final or closed)
            if call is None:
                break
            calls.append(call)
        return Parsed(content="".join(outside), calls=calls)


class Llama3JsonParser:
    TAG = "<|python_tag|>"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        if not body:
            return Parsed(content=text if final else "")
        if not body.startswith("{"):
            if not final and self.TAG.startswith(body):
                return Parsed()
            return Parsed(content=text)
        calls, pos = [], 0
        while pos < len(body):
            end = json_value_end(body, pos)
            piece = body[pos:end] if end is not None else body[pos:]
            call = call_from_json(piece, final or end is not None)
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            pos = end
            rest = body[pos:].lstrip()
            if not rest.startswith(";"):
                break
            pos = len(body) - len(rest) + 1
        return Parsed(calls=calls)


class _SectionParser:
    """Calls inside a section of call blocks (DeepSeek-V3's and Kimi-K2's formats): text outside
    the sections is content; each block is read by the subclass's `_call`, and the first that
    cannot be read yet ends the list."""

    SECTION: tuple[str, str]
    CALL: tuple[str, str]

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def parse(self, text: str, final: bool) -> Parsed:
        outside, sections = split_blocks(text, *self.SECTION)
        if not sections or sections[-1][1]:
            outside[-1] = cut(outside[-1], final, (self.SECTION[0],))
        calls: list[ToolCall] = []
        for section, closed in sections:
            for body, done in split_blocks(section, *self.CALL)[1]:
                call = self._call(body, final or closed or done)
                if call is None:
                    break
                calls.append(call)
        return Parsed(content="".join(outside), calls=calls)

    def _call(self, body: str, done: bool) -> ToolCall | None:
        raise NotImplementedError


class DeepSeekV3Parser(_SectionParser):
    SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
    SEP = "<｜tool▁sep｜>"
    FENCE = ("```json\n", "\n```")

    def _call(self, body: str, done: bool) -> ToolCall | None:
        if self.SEP not in body:
            return None
        left, right = body.split(self.SEP, 1)
        if left.strip() != "function":  # V3.1: NAME<｜tool▁sep｜>ARGS
            return ToolCall(left.strip(), right.strip() if done else cut(right, False, self.CALL))
        if "\n" not in right:
            return None if not done else ToolCall(right.strip(), "{}")
        name, rest = right.split("\n", 1)
        open_, close = self.FENCE
        if rest.startswith(open_):
            rest = rest[len(open_) :]
        elif not done and open_.startswith(rest):
            return ToolCall(name.strip())
        j = rest.find(close)
        if j >= 0:
            return ToolCall(name.strip(), rest[:j])
        return ToolCall(name.strip(), rest.rstrip("`\n") if done else cut(rest, False, (close,)))


class KimiK2Parser(_SectionParser):
    SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    CALL = ("<|tool_call_begin|>", "<|tool_call_end|>")
    ARGS = "<|tool_call_argument_begin|>"

    def _call(self, body: str, done: bool) -> ToolCall | None:
        if self.ARGS not in body:
            return None
        call_id, args = body.split(self.ARGS, 1)
        call_id = call_id.strip()
        name = call_id.removeprefix("functions.").rsplit(":", 1)[0]
        return ToolCall(name, args.strip() if done else cut(args, False, self.CALL), call_id)


class Glm45Parser:
    BEGIN, END = "<tool_call>", "</tool_call>"
    KEY = ("<arg_key>", "</arg_key>")
    VALUE = ("<arg_value>", "</arg_value>")

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        # Which arguments are strings: GLM writes strings raw and other values as JSON.
        self.types: dict[str, dict[str, Any]] = {}
        for t in tools or []:
            fn = t.get("function") or {}
            props = (fn.get("parameters") or {}).get("properties") or {}
            self.types[fn.get("name", "")] = props

    def parse(self, text: str, final: bool) -> Parsed:
        outside, blocks = split_blocks(text, self.BEGIN, self.END)
        if not blocks or blocks[-1][1]:  # the text ends outside a block
            outside[-1] = cut(outside[-1], final, (self.BEGIN,))
        calls = []
        for body, closed in blocks:
            call = self._call(body, final or closed)
            if call is None:
                break
            calls.append(call)
        return Parsed(content="".join(outside), calls=calls)

    def _call(self, body: str, done: bool) -> ToolCall | None:
        stop = min((i for i in (body.find("\n"), body.find(self.KEY[0])) if i >= 0), default=-1)
        if stop < 0 and not done:
            return None
        name = (body if stop < 0 else body[:stop]).strip()
        parts = []
        _, keys = split_blocks(body, *self.KEY)
        _, values = split_blocks(body, *self.VALUE)
        for (key, kdone), (value, vdone) in zip(keys, values, strict=False):
            if not (kdone and vdone):
                break
            parts.append(f"{json.dumps(key.strip())}: {self._value(name, key.strip(), value)}")
        args = "{" + ", ".join(parts)
        return ToolCall(name, args + "}" if done else args)

    def _value(self, tool: str, key: str, raw: str) -> str:
        if (self.types.get(tool, {}).get(key) or {}).get("type") == "string":
            return json.dumps(raw, ensure_ascii=False)
        try:
            return json.dumps(json.loads(raw), ensure_ascii=False)
        except ValueError:
            return json.dumps(raw, ensure_ascii=False)
