"""Parsers of model replies: tool calls per family format, and the thinking before the answer.

Who calls it: the chat route (server/chat.py, server/tool_calls.py), the Responses and Ollama
routes, with the text the engine has generated so far; never the engine. A parser is pure
(text in, `Parsed` out) and prefix-consistent, so `Streamer` makes deltas of any stream.

Failure contract: a parser never raises on what a model writes; text that does not follow the
format is content, and a call whose arguments are not JSON keeps its text as written.
"""

from hetserve.server.tools.base import OutputParser, Parsed, Streamer, ToolCall, new_call_id
from hetserve.server.tools.registry import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    default_parsers,
    output_parser,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "OutputParser",
    "Parsed",
    "Streamer",
    "ToolCall",
    "default_parsers",
    "new_call_id",
    "output_parser",
]
