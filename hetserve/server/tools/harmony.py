"""gpt-oss's harmony format: thinking, answer and tool calls are messages on channels.

A reply is a run of messages, each `<|start|>assistant` (left out for the first: the
generation prompt wrote it), a header (`<|channel|>NAME`, maybe ` to=functions.X`, maybe
`<|constrain|>json`), `<|message|>`, the text, and `<|end|>` (or `<|call|>` / `<|return|>`, the
end-of-sequence tokens, which the detokenizer leaves out). analysis -> reasoning; final ->
content; commentary to=functions.X -> a call of X whose arguments are the text; commentary
without a recipient (a preamble) -> content.

Why not openai-harmony's StreamableParser: it works on the o200k_harmony token ids and loads
its vocabulary from the network at first use; here the text is parsed (with the markers kept
by `skip_special_tokens=False`), which works for any tokenizer that spells the markers.
"""

from __future__ import annotations

import re
from typing import Any

from hetserve.server.tools.base import Parsed, ToolCall, cut

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
ENDS = (END, "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, *ENDS)
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class HarmonyParser:
    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def parse(self, text: str, final: bool) -> Parsed:
        out = Parsed()
        pos = 0
        while pos < len(text):
            head_end = text.find(MESSAGE, pos)
            if head_end < 0:  # a header still coming (or text outside any message)
                if final and not text[pos:].lstrip().startswith((START, CHANNEL)):
                    out.content += text[pos:]
                break
            header = text[pos:head_end].removeprefix(START).removeprefix("assistant")
            body_start = head_end + len(MESSAGE)
            end, marker = _find_end(text, body_start)
            done = end is not None
            body = text[body_start:end] if done else cut(text[body_start:], final, ENDS)
            self._add(out, header, body)
            if end is None:
                break
            pos = end + len(marker)
        return out

    def _add(self, out: Parsed, header: str, body: str) -> None:
        channel = header.split(CHANNEL, 1)[1].split()[0] if CHANNEL in header else "final"
        recipient = _RECIPIENT.search(header)
        if recipient and recipient.group(1).startswith("functions."):
            name = recipient.group(1).removeprefix("functions.")
            out.calls.append(ToolCall(name, body.lstrip()))
        elif channel == "analysis":
            out.reasoning += body
        else:  # final, and commentary without a recipient (a preamble)
            out.content += body


def _find_end(text: str, start: int) -> tuple[int | None, str]:
    found = [(i, m) for m in (*ENDS, START) if (i := text.find(m, start)) >= 0]
    if not found:
        return None, ""
    i, m = min(found)
    return i, ("" if m == START else m)  # a new message may start without an <|end|>
