"""A Responses reply's output items (reasoning, message, function_call) and the typed stream
events that build them, from the parsed deltas of the reply as it grows.

Who calls it: `server/responses.py`, once per response, for the stream and the whole reply
alike (the same items for the same tokens). Pure: no I/O, no clock; nothing it is fed fails.
"""

from __future__ import annotations

import base64
import copy
import uuid


class OutputItems:
    """A reply's output items, built from a `Streamer`'s deltas in the order they begin, with
    the typed events that build them in a stream: each item is added, gets its content part
    and deltas, then is done, before the next one is added.

    Reasoning and text items open on their first delta; whitespace outside an item waits, and
    is dropped if a function call comes next (the newline between two calls is no message).
    The item left open when the reply was cut off is `incomplete`. A reply without a message
    or a call gets one (possibly empty) message, so `output_text` is always there.
    """

    def __init__(self, encrypt_reasoning: bool = False, logprobs: bool = False) -> None:
        self.encrypt_reasoning = encrypt_reasoning  # `include: reasoning.encrypted_content`
        self.items: list[dict] = []
        self._events: list[tuple[str, dict]] = []
        self._open: dict | None = None
        self._space = ""  # whitespace not yet in a message
        self._calls: dict[int, int] = {}  # the streamer's call index -> output index
        self._held: list[dict] = []  # logprobs of tokens whose text no delta has sent yet
        # The output text's logprobs not yet sent (None: not asked).
        self._lp: list[dict] | None = [] if logprobs else None

    def feed(
        self, content: str, reasoning: str, calls: list[dict], logprobs: list[dict] | None = None
    ) -> list[tuple[str, dict]]:
        """Deltas as `Streamer.feed` returns them -> (event type, fields) to send. `logprobs`:
        the step's tokens' (None: not asked); a step that sent nothing (the parser held its
        text back) hands them on to the next text delta (`_spelled` says which are the
        text's)."""
        if logprobs is not None:
            self._held += logprobs
            if not (content or reasoning or calls):
                return self._take()
            if content and self._lp is not None:  # else reasoning's or a call's tokens
                self._lp += self._held
            self._held = []
        if reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                text = {"type": "reasoning_text", "text": ""}
                self._begin({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}",
                             "summary": [], "content": [text]})  # fmt: skip
            self._text(reasoning)
        if content:
            if self._open is not None and self._open["type"] == "message":
                self._text(content)
            else:
                self._space += content
                if self._space.strip():
                    self._message()
        for d in calls:
            if "id" in d:
                self._space = ""  # no message: nor its logprobs
                self._lp = [] if self._lp is not None else None
                self._calls[d["index"]] = len(self.items)
                self._begin({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                             "call_id": d["id"], "name": d["name"], "arguments": ""})  # fmt: skip
            if d["arguments"]:
                i = self._calls[d["index"]]
                item = self.items[i]
                item["arguments"] += d["arguments"]
                self._emit("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=i, delta=d["arguments"])  # fmt: skip
        return self._take()

    def finish(self, cut_off: bool) -> list[tuple[str, dict]]:
        """The end of the reply (`cut_off`: by max_output_tokens) -> the events that close it."""
        if not any(it["type"] in ("message", "function_call") for it in self.items):
            self._message()
        self._close("incomplete" if cut_off else "completed")
        return self._take()

    def _message(self) -> None:
        text = {"type": "output_text", "text": "", "annotations": []}
        if self._lp is not None:
            text["logprobs"] = []
        self._begin({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                     "content": [text]})  # fmt: skip
        if self._space:
            self._text(self._space)
        self._space = ""

    def _begin(self, item: dict) -> None:
        self._close("completed")
        item["status"] = "in_progress"
        self.items.append(item)
        self._open = item
        i = len(self.items) - 1
        shown = {**item, "content": []} if "content" in item else dict(item)
        self._emit("response.output_item.added", output_index=i, item=shown)
        if "content" in item:
            self._emit("response.content_part.added", item_id=item["id"], output_index=i,
                       content_index=0, part=dict(item["content"][0]))  # fmt: skip

    def _text(self, delta: str) -> None:
        item = self._open
        assert item is not None
        item["content"][0]["text"] += delta
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if item["type"] == "message":
            part = item["content"][0]
            lp: list[dict] = []
            if self._lp is not None:
                lp, self._lp = self._spelled(part), []
                part["logprobs"] += lp
            self._emit("response.output_text.delta", **where, delta=delta, logprobs=lp)
        else:
            self._emit("response.reasoning_text.delta", **where, delta=delta)

    def _spelled(self, part: dict) -> list[dict]:
        """The pending logprob entries that are the text's. Within a message all are; before
        its first text, tokens of the format (a thinking's closing tag, the newlines the
        parser drops after it) may wait with them, and go: the entries start at the first
        one whose bytes or string begin the text (all of them where none does)."""
        entries = self._lp or []
        if part["logprobs"] or not entries:
            return entries
        text = part["text"]
        for k, e in enumerate(entries):
            b, s = bytes(e["bytes"]), e["token"]
            if b and (text.encode().startswith(b) or (s and text.startswith(s))):
                return entries[k:]
        return entries

    def _close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        i = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": i}
        if item["type"] == "function_call":
            self._emit("response.function_call_arguments.done", **where,
                       arguments=item["arguments"])  # fmt: skip
        else:
            part = item["content"][0]
            if item["type"] == "message":
                self._emit("response.output_text.done", **where, content_index=0,
                           text=part["text"], logprobs=part.get("logprobs", []))  # fmt: skip
            else:
                self._emit("response.reasoning_text.done", **where, content_index=0,
                           text=part["text"])  # fmt: skip
                if self.encrypt_reasoning:
                    item["encrypted_content"] = base64.b64encode(part["text"].encode()).decode()
            self._emit("response.content_part.done", **where, content_index=0, part=dict(part))
        self._emit("response.output_item.done", output_index=i, item=copy.deepcopy(item))

    def _emit(self, kind: str, **data) -> None:
        self._events.append((kind, data))

    def _take(self) -> list[tuple[str, dict]]:
        out, self._events = self._events, []
        return out
