"""Reasoning parsers: the thinking part of a reply goes to `reasoning_content`.

- think (Qwen3, DeepSeek-R1, GLM-4.5/4.6, Kimi-K2-Thinking): thinking between <think> and
  </think>. Where the generation prompt already opened the <think> (DeepSeek-R1's template
  does), the reply starts inside it; where the prompt closed an empty one (thinking switched
  off), none of it is thinking.
- gpt-oss thinks in harmony's analysis channel (tools/harmony.py parses both at once).

`ThinkSplitter` wraps a tool parser: the text after the thinking is what the tool parser sees.
"""

from __future__ import annotations

from hetserve.server.tools.base import OutputParser, Parsed, cut

OPEN, CLOSE = "<think>", "</think>"


def starts_thinking(prompt: str) -> bool:
    """Whether the prompt leaves the model inside a <think> block (opened, not closed)."""
    tail = prompt.rstrip()
    return tail.rfind(OPEN) > tail.rfind(CLOSE)


class ThinkSplitter:
    def __init__(self, inner: OutputParser, in_thinking: bool = False) -> None:
        self.inner = inner
        self.in_thinking = in_thinking

    def parse(self, text: str, final: bool) -> Parsed:
        reasoning, rest = self.split(text, final)
        out = self.inner.parse(rest, final) if rest is not None else Parsed()
        out.reasoning = reasoning
        return out

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        """(reasoning, the text after it); None for the latter while still thinking."""
        body = text
        if not self.in_thinking:
            stripped = text.lstrip()
            if not stripped.startswith(OPEN):
                if not final and OPEN.startswith(stripped):
                    return "", None  # may still become <think>
                return "", text
            body = stripped[len(OPEN) :]
        end = body.find(CLOSE)
        if end < 0:
            if final:  # ended (or cut off) while thinking: all of it was thinking
                return body, ""
            return cut(body, False, (CLOSE,)), None
        # The newlines after </think> are the template's, not the answer's.
        return body[:end], body[end + len(CLOSE) :].lstrip("\n")
