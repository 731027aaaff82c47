"""OpenAI's tool calling for the chat route: the request's tools and tool_choice, the grammar
that forces a call, and each choice's parser of the reply.

- `tool_choice` 'auto' (the default with tools): the tools go to the chat template and the
  family's parser finds the calls the model chose to make.
- 'required' and a named function: the grammar engine forces the reply into a call, as vLLM
  does: a JSON array of {"name", "parameters"} (one item when parallel_tool_calls is false),
  or the named function's arguments; so even a random model returns a valid call.
- 'none': the tools are rendered as with 'auto' (as vLLM does: the prompt, and so its cached
  prefix, stays that of the turns around it) and the reply is all content.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hetserve.core.grammar import GrammarSpec
from hetserve.errors import InvalidInputError
from hetserve.server.structured import json_schema
from hetserve.server.tools import OutputParser, Parsed, ToolCall, output_parser
from hetserve.server.tools.base import call_from_json, json_value_end

# Formats whose markers the published tokenizers mark special: the text must keep them.
SPECIAL_MARKERS = {"kimi_k2", "openai"}


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None  # rendered by the template (None: no tools)
    choice: str  # 'none' | 'auto' | 'required' | 'named'
    named: str | None = None
    grammar: GrammarSpec | None = None
    parallel: bool = True  # False: a reply's first call only (parallel_tool_calls)

    @property
    def parses_calls(self) -> bool:
        return self.tools is not None and self.choice != "none"


def plan_tools(extra: Mapping[str, Any]) -> ToolPlan:
    """The request's tools, tool_choice and parallel_tool_calls, checked (400s name the
    field)."""
    tools = extra.get("tools")
    choice = extra.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise InvalidInputError(f"tool_choice {choice!r} needs tools", "tool_choice")
        return ToolPlan(None, "none")
    if not isinstance(tools, list) or not tools:
        raise InvalidInputError("tools must be a non-empty list; omit it instead", "tools")
    names = [_tool_name(t, i) for i, t in enumerate(tools)]
    parallel = extra.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidInputError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if choice in (None, "auto"):
        return ToolPlan(tools, "auto", parallel=parallel)
    if choice == "none":
        return ToolPlan(tools, "none")
    if choice == "required":
        return ToolPlan(tools, "required", grammar=_required_grammar(tools, parallel))
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and name):
        raise InvalidInputError(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in names:
        raise InvalidInputError(
            f"tool_choice names function {name!r}, which is not among the tools", "tool_choice"
        )
    params = _parameters(tools[names.index(name)])
    return ToolPlan(tools, "named", name, json_schema(params, "tools", strict=False))


def _tool_name(tool: Any, i: int) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)):
        raise InvalidInputError(
            'each tool must be {"type": "function", "function": {...}}', f"tools.{i}"
        )
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidInputError("a tool's function needs a name", f"tools.{i}.function.name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidInputError(
            "a function's parameters must be a JSON schema object",
            f"tools.{i}.function.parameters",
        )
    return name


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _required_grammar(tools: list[dict], parallel: bool) -> GrammarSpec:
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return json_schema(schema, "tools", strict=False)


class NamedCallParser:
    """tool_choice naming a function: the whole reply is its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed(calls=[ToolCall(self.name, text.strip() if final else text.lstrip())])


class CallArrayParser:
    """tool_choice 'required': a JSON array of {"name", "parameters"}."""

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip().removeprefix("[")
        calls, pos = [], 0
        while True:
            pos += len(body[pos:]) - len(body[pos:].lstrip(" \n\t,"))
            if pos >= len(body) or body[pos] != "{":
                break
            end = json_value_end(body, pos)
            piece = body[pos:end] if end is not None else body[pos:]
            call = call_from_json(piece, final or end is not None, arg_keys=("parameters",))
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            pos = end
        return Parsed(calls=calls)


def choice_parser(
    plan: ToolPlan, tool_parser: str | None, reasoning_parser: str | None, prompt: str
) -> OutputParser:
    """The parser of one choice's reply under `plan`."""
    if plan.choice == "named":
        return NamedCallParser(plan.named or "")
    if plan.choice == "required":
        return CallArrayParser()
    tools = plan.tools if plan.parses_calls else None
    parser = output_parser(tool_parser, reasoning_parser, tools, prompt)
    return parser if plan.parallel else FirstCallParser(parser)


class FirstCallParser:
    """parallel_tool_calls false under 'auto': a model that writes several calls is answered
    with its first (as vLLM does; OpenAI's models make one)."""

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = self.parser.parse(text, final)
        if len(parsed.calls) > 1:
            parsed = Parsed(parsed.content, parsed.reasoning, parsed.calls[:1])
        return parsed


def needs_special_tokens(plan: ToolPlan, tool_parser: str | None, reasoning: str | None) -> bool:
    if plan.choice in ("named", "required"):
        return False
    return (plan.parses_calls and tool_parser in SPECIAL_MARKERS) or reasoning == "openai"


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates read them: a tool call's arguments as a mapping
    (templates iterate or re-serialize them) and a tool result's function name."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                names[c.get("id", "")] = fn.get("name", "")
                fn["arguments"] = _as_mapping(fn.get("arguments"))
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        if m["role"] == "tool" and not m.get("name"):
            m["name"] = names.get(m.get("tool_call_id", ""), "")
        out.append(m)
    return out


def _as_mapping(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def openai_tool_calls(calls: list[ToolCall], ids: list[str]) -> list[dict]:
    return [
        {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c, i in zip(calls, ids, strict=True)
    ]
