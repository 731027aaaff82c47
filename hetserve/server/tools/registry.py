"""Which parsers read a model's replies: by name (--tool-call-parser, --reasoning-parser) or,
by default, from the markers its chat template writes.

`output_parser(...)` builds one request's parser: the reasoning parser around the tool parser
(the text after the thinking is what the tool parser sees), or either alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hetserve.server.tools.base import OutputParser, Parsed
from hetserve.server.tools.formats import (
    DeepSeekV3Parser,
    Glm45Parser,
    HermesParser,
    KimiK2Parser,
    Llama3JsonParser,
)
from hetserve.server.tools.harmony import HarmonyParser
from hetserve.server.tools.reasoning import ThinkSplitter, starts_thinking

ToolParserFactory = Callable[[list[dict[str, Any]] | None], OutputParser]
# vLLM's names, so the flags of a vLLM deployment work here.
TOOL_PARSERS: dict[str, ToolParserFactory] = {
    "hermes": HermesParser,
    "qwen3": HermesParser,
    "llama3_json": Llama3JsonParser,
    "deepseek_v3": DeepSeekV3Parser,
    "deepseek_v31": DeepSeekV3Parser,
    "kimi_k2": KimiK2Parser,
    "glm45": Glm45Parser,
    "openai": HarmonyParser,
}
# "think": <think>...</think>; "openai": harmony's analysis channel (parsed with its tools).
REASONING_PARSERS = {
    "qwen3": "think",
    "deepseek_r1": "think",
    "glm45": "think",
    "kimi_k2": "think",
    "openai": "openai",
}
# A marker its template writes -> (tool parser, reasoning parser or None), first match wins.
_BY_MARKER = (
    ("<|channel|>", "openai", "openai"),
    ("<｜tool▁call▁begin｜>", "deepseek_v3", None),
    ("<|tool_call_begin|>", "kimi_k2", None),
    ("<arg_key>", "glm45", None),
    ("<tool_call>", "hermes", None),
    ("<|python_tag|>", "llama3_json", None),
    ('"parameters"', "llama3_json", None),
)


def default_parsers(chat_template: str | None) -> tuple[str | None, str | None]:
    """(tool parser, reasoning parser) for a model whose chat template is `chat_template`."""
    template = chat_template or ""
    tool = reasoning = None
    for marker, t, r in _BY_MARKER:
        if marker in template:
            tool, reasoning = t, r
            break
    if reasoning is None and "<think>" in template:
        reasoning = "deepseek_r1"
    return tool, reasoning


# Per reasoning kind: (what opens the thinking, what ends it, what a thinking budget forces
# when it runs out: the end, as the model would write it).
THINKING_MARKS = {
    "think": ("<think>", "</think>", "\n</think>\n\n"),
    "openai": (
        "<|channel|>analysis<|message|>",
        "<|end|>",
        "<|end|><|start|>assistant<|channel|>final<|message|>",
    ),
}


def thinking_marks(reasoning_parser: str | None) -> tuple[str, str, str] | None:
    """The reasoning parser's thinking markers (THINKING_MARKS), None where it has none."""
    return THINKING_MARKS.get(REASONING_PARSERS.get(reasoning_parser or "", ""))


class _Plain:
    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed(content=text)


def output_parser(
    tool_parser: str | None,
    reasoning_parser: str | None,
    tools: list[dict[str, Any]] | None,
    prompt: str,
) -> OutputParser:
    """One request's parser. `tools` None: tool calls are not parsed (none were offered or
    tool_choice is 'none'); the reply is content (and reasoning)."""
    kind = REASONING_PARSERS.get(reasoning_parser or "")
    if kind == "openai" or tool_parser == "openai":
        return HarmonyParser(tools)  # one format holds both
    inner: OutputParser = _Plain()
    if tools is not None and tool_parser is not None:
        inner = TOOL_PARSERS[tool_parser](tools)
    if kind == "think":
        return ThinkSplitter(inner, starts_thinking(prompt))
    return inner
