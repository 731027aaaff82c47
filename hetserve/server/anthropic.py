"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, what
Claude Code and Anthropic's SDKs send, served by the chat route's machinery.

Who calls it: `server/app.py` installs the routes. A body is checked and translated into the
chat request it means (`anthropic_input.py`) and run as the chat route runs it: the same
template, tool and reasoning parsers, structured tool calls, prefix cache. The reply becomes
content blocks (thinking, text, tool_use) with a stop_reason (end_turn, max_tokens,
stop_sequence, tool_use) and usage (cache reads apart, as Anthropic counts them), or with
`stream` Anthropic's events: message_start, each block's start, deltas (thinking_delta,
text_delta, input_json_delta) and stop, message_delta, message_stop.

Failure contract: every error on these routes has Anthropic's body (`{"type": "error",
"error": {"type": ..., "message": ...}}`, app.py shapes it): a mistake a 400
(invalid_request_error), an unknown model a 404, a failure mid-stream an `error` event. The
API key may come as `x-api-key` (Anthropic's header) or a bearer token.
"""

from __future__ import annotations

import json
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hetserve.errors import InvalidInputError, PromptTooLongError
from hetserve.server.anthropic_input import chat_body
from hetserve.server.chat import ChatServing
from hetserve.server.protocol import ChatCompletionRequest
from hetserve.server.responses_input import validated_chat
from hetserve.server.stream_merge import merge
from hetserve.server.tools import Streamer
from hetserve.server.tools.registry import thinking_marks
from hetserve.server.validation import json_object

# The chat request's names for what the Messages body calls otherwise (first match wins).
THEIR_NAMES = (
    (re.compile(r"stop"), "stop_sequences"),
    (re.compile(r"reasoning_effort"), "output_config.effort"),
    (re.compile(r"response_format(\.json_schema)?(\.schema)?"), "output_config.format"),
    (re.compile(r"tool_choice\.function"), "tool_choice"),
    (re.compile(r"tools\.(\d+)\.function"), r"tools.\1"),
    (re.compile(r"thinking_token_budget"), "thinking.budget_tokens"),
    (re.compile(r"messages(\.\d+)?"), "messages"),  # its messages are not the body's
)


class AnthropicServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    def request(self, body: dict) -> ChatCompletionRequest:
        # chat_body's own errors name the body's fields already; the chat request's checks
        # name its own, renamed here.
        out = chat_body(body, thinking_marks(self.chat.reasoning_parser) is not None)
        return validated_chat(out, THEIR_NAMES)

    async def count_tokens(self, body: dict) -> dict:
        # Its body has no max_tokens (nothing is generated): one the thinking budget fits in
        thinking = body.get("thinking")
        budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
        fits = budget + 1 if isinstance(budget, int) and budget > 0 else 1
        req = self.request({**body, "max_tokens": body.get("max_tokens") or fits})
        prompt = await self.chat.prompt_of(req)
        return {"input_tokens": len(await self.chat.encode(prompt, add_special_tokens=False))}

    async def create(self, body: dict, request: Request):
        req = self.request(body)
        mid = f"msg_{uuid.uuid4().hex}"
        try:
            streams, parsers, _ = await self.chat.prepare(mid, req, request)
        except PromptTooLongError:
            raise await self._too_long(req) from None
        head = {"id": mid, "type": "message", "role": "assistant",
                "model": body.get("model") or self.chat.model_name}  # fmt: skip
        if req.stream:
            events = self._events(head, streams, parsers[0])
            return StreamingResponse(events, media_type="text/event-stream")
        return await self.chat.run_unless_disconnected(
            request, streams, self._collect(head, streams, parsers[0])
        )

    async def _too_long(self, req: ChatCompletionRequest) -> InvalidInputError:
        """A request past the context, worded as Anthropic words it: Claude Code reads these
        messages (it retries with a smaller max_tokens, or compacts the conversation)."""
        context = self.chat.engine.max_model_len
        prompt = await self.chat.prompt_of(req)
        try:
            n = len(await self.chat.encode(prompt, add_special_tokens=False))
        except PromptTooLongError:  # too long to tokenize at all
            n = len(prompt)
        if n >= context:
            return PromptTooLongError(f"prompt is too long: {n} tokens > {context} maximum",
                                      "messages")  # fmt: skip
        limit = req.output_limit()[0] or 0
        return PromptTooLongError(
            f"input length and `max_tokens` exceed context limit: {n} + {limit} > {context}, "
            "decrease input length or `max_tokens` and try again",
            "max_tokens",
        )

    async def _collect(self, head: dict, streams, parser) -> dict:
        streamer, blocks, last = Streamer(parser), Blocks(), None
        async for _, out in merge(streams):
            last = out
            c = out.outputs[0]
            blocks.feed(*streamer.feed(c.text, c.finish_reason is not None))
        blocks.finish()
        reason, sequence = self._stop(last, streamer)
        return {**head, "content": blocks.final(), "stop_reason": reason,
                "stop_sequence": sequence, "usage": self._usage(last)}  # fmt: skip

    def _stop(self, out, streamer: Streamer) -> tuple[str, str | None]:
        c = out.outputs[0]
        if c.finish_reason == "length":  # a call cut off mid-way is no call to run
            return "max_tokens", None
        if streamer.sent.calls:
            return "tool_use", None
        if isinstance(c.stop_reason, str):
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def _usage(self, out) -> dict:
        u = self.chat.usage([out])
        cached = u["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens":
                u["completion_tokens"], "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0}  # fmt: skip

    async def _events(self, head: dict, streams, parser):
        def start(out) -> str:  # sent with the first output: the cache split is known then
            usage = self._usage(out) if out is not None else {
                "input_tokens": streams[0].num_prompt_tokens, "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0}  # fmt: skip
            message = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                       "usage": {**usage, "output_tokens": 0}}  # fmt: skip
            return _event("message_start", message=message)

        streamer, blocks, last = Streamer(parser), Blocks(), None
        try:
            async for _, out in merge(streams):
                if last is None:
                    yield start(out)
                last = out
                c = out.outputs[0]
                for kind, data in blocks.feed(*streamer.feed(c.text, c.finish_reason is not None)):
                    yield _event(kind, **data)
        except Exception as exc:  # Anthropic's way: an error event ends the stream
            if last is None:
                yield start(None)
            yield _event("error", error={"type": "api_error", "message": str(exc)})
            return
        finally:
            for s in streams:
                s.abort()
        if last is None:
            yield start(None)
            message = "the engine ended the request without an output"
            yield _event("error", error={"type": "api_error", "message": message})
            return
        for kind, data in blocks.finish():
            yield _event(kind, **data)
        reason, sequence = self._stop(last, streamer)
        usage = self._usage(last)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage=usage)  # fmt: skip
        yield _event("message_stop")


def _event(kind: str, **data) -> str:
    payload = json.dumps({"type": kind, **data}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n"


class Blocks:
    """A reply's content blocks, from a `Streamer`'s deltas in the order they begin, with the
    stream events that build them: each block starts, gets its deltas, stops, before the next
    starts. Whitespace between blocks waits and is dropped if a tool_use comes next; a reply
    with no text and no tool_use gets one (possibly empty) text block."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._events: list[tuple[str, dict]] = []
        self._open: dict | None = None
        self._space = ""
        self._calls: dict[int, int] = {}  # the streamer's call index -> block index

    def feed(self, content: str, reasoning: str, calls: list[dict]) -> list[tuple[str, dict]]:
        if reasoning:
            if self._open is None or self._open["type"] != "thinking":
                self._begin({"type": "thinking", "thinking": "", "signature": ""})
            self._delta({"type": "thinking_delta", "thinking": reasoning}, "thinking", reasoning)
        if content:
            if self._open is not None and self._open["type"] == "text":
                self._delta({"type": "text_delta", "text": content}, "text", content)
            else:
                self._space += content
                if self._space.strip():
                    self._text()
        for d in calls:
            if "id" in d:
                self._space = ""
                self._calls[d["index"]] = len(self.blocks)
                # Anthropic's ids read toolu_...; any id comes back as a tool_result's as it is
                rid = "toolu_" + d["id"].removeprefix("call_")
                self._begin({"type": "tool_use", "id": rid, "name": d["name"], "input": {}})
                self.blocks[-1]["_json"] = ""
            if d["arguments"]:
                block = self.blocks[self._calls[d["index"]]]
                block["_json"] += d["arguments"]
                self._emit(
                    "content_block_delta",
                    index=self._calls[d["index"]],
                    delta={"type": "input_json_delta", "partial_json": d["arguments"]},
                )
        return self._take()

    def finish(self) -> list[tuple[str, dict]]:
        if not any(b["type"] in ("text", "tool_use") for b in self.blocks):
            self._text()
        self._close()
        return self._take()

    def final(self) -> list[dict]:
        """The blocks as the whole reply has them (a tool_use's input parsed)."""
        out = []
        for b in self.blocks:
            b = dict(b)
            raw = b.pop("_json", None)
            if raw is not None:
                try:
                    b["input"] = json.loads(raw) if raw.strip() else {}
                except ValueError:  # cut off mid-call: what was written, as Anthropic keeps it
                    b["input"] = {}
            out.append(b)
        return out

    def _text(self) -> None:
        self._begin({"type": "text", "text": ""})
        if self._space:
            self._delta({"type": "text_delta", "text": self._space}, "text", self._space)
        self._space = ""

    def _begin(self, block: dict) -> None:
        self._close()
        self.blocks.append(block)
        self._open = block
        shown = {k: v for k, v in block.items() if not k.startswith("_")}
        self._emit("content_block_start", index=len(self.blocks) - 1, content_block=shown)

    def _delta(self, delta: dict, key: str, text: str) -> None:
        assert self._open is not None
        self._open[key] += text
        self._emit("content_block_delta", index=len(self.blocks) - 1, delta=delta)

    def _close(self) -> None:
        if self._open is not None:
            self._emit("content_block_stop", index=len(self.blocks) - 1)
        self._open = None

    def _emit(self, kind: str, **data) -> None:
        self._events.append((kind, data))

    def _take(self) -> list[tuple[str, dict]]:
        out, self._events = self._events, []
        return out


# OpenAI's error types as Anthropic names them.
_ERROR_TYPES = {"server_error": "api_error", "service_unavailable": "overloaded_error"}


def anthropic_error(body: dict) -> dict:
    """An OpenAI-shaped error body (error_body's) in Anthropic's shape."""
    err = body["error"]
    kind = _ERROR_TYPES.get(err.get("type"), err.get("type") or "api_error")
    return {"type": "error", "error": {"type": kind, "message": err["message"]}}


def anthropic_stream_error(message: str) -> bytes:
    """The event that ends a Messages stream whose producer failed (an `error` event: the
    SDKs raise on it; a nameless data line they would skip)."""
    return _event("error", error={"type": "api_error", "message": message}).encode()


def install_anthropic_routes(app: FastAPI, serving: AnthropicServing, check_model) -> None:
    def refused(model) -> JSONResponse | None:
        answer = check_model(model)
        if answer is None:
            return None
        return JSONResponse(anthropic_error(json.loads(answer.body)), answer.status_code)

    @app.post("/v1/messages", include_in_schema=False)
    async def messages(request: Request):
        body = await json_object(request)
        return refused(body.get("model")) or await serving.create(body, request)

    @app.post("/v1/messages/count_tokens", include_in_schema=False)
    async def count_tokens(request: Request):
        body = await json_object(request)
        return refused(body.get("model")) or await serving.count_tokens(body)
