"""/v1/responses: OpenAI's Responses API, which the current SDKs and agent frameworks use.

A request is translated into the chat request it means (`responses_input.py`: input items ->
messages, tools and tool_choice, text.format -> structured output, reasoning.effort) and run by
the chat route's machinery; the reply becomes output items (reasoning, message, function_call),
streamed as the API's typed events. `previous_response_id` continues a stored conversation: its
messages are rendered again in front of the new input, so the prompt starts with the earlier
turn's tokens and the prefix cache (and the KV tiers behind it) serves them; the chain shares a
session id, so its blocks are kept for the session TTL between turns. `store: false` keeps
nothing. The store is in memory, bounded (least recently used goes first).
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections import OrderedDict

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hetserve.errors import InvalidInputError, PromptTooLongError
from hetserve.server.chat import ChatServing
from hetserve.server.errors import error_body
from hetserve.server.responses_input import (
    chat_request,
    check_types,
    input_messages,
    truncated,
)
from hetserve.server.serving import merge
from hetserve.server.tools import Streamer

MAX_STORED = 1024


class ResponseStore:
    def __init__(self, limit: int = MAX_STORED) -> None:
        self.limit = limit
        self._items: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()

    def put(self, rid: str, messages: list[dict], response: dict) -> None:
        self._items[rid] = (messages, response)
        if len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[list[dict], dict] | None:
        found = self._items.get(rid)
        if found is not None:
            self._items.move_to_end(rid)
        return found

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    async def create(self, body: dict, request: Request):
        prev_id = body.get("previous_response_id")
        history: list[dict] = []
        session = None
        if prev_id is not None:
            found = self.store.get(prev_id)
            if found is None:
                raise InvalidInputError(
                    f"previous response {prev_id!r} was not found (not stored, or evicted)",
                    "previous_response_id",
                )
            history, prev = found
            session = prev.get("_session")
        called = {c["id"] for m in history for c in m.get("tool_calls") or ()}
        new = input_messages(body.get("input", ""), called)
        system = [{"role": "system", "content": body["instructions"]}] if body.get(
            "instructions") else []  # fmt: skip
        messages = system + history + new
        truncation = body.get("truncation") or "disabled"
        if truncation not in ("auto", "disabled"):
            raise InvalidInputError("truncation must be 'auto' or 'disabled'", "truncation")
        rid = f"resp_{uuid.uuid4().hex}"
        session = session or rid  # the chain's blocks outlive each turn for the session TTL
        while True:
            req = chat_request(body, messages)
            req.session_id = session
            try:
                streams, parsers, _ = await self.chat.prepare(rid, req, request)
                break
            except PromptTooLongError:
                # "auto": OpenAI's, the oldest items go until the rest fits.
                shorter = truncated(messages, len(system)) if truncation == "auto" else None
                if shorter is None:
                    raise
                messages = shorter
        state = {"rid": rid, "body": body, "history": history + new, "session": session,
                 "created_at": int(time.time())}  # fmt: skip
        if body.get("stream"):
            events = self._events(state, streams, parsers[0])
            return StreamingResponse(events, media_type="text/event-stream")
        return await self.chat.run_unless_disconnected(
            request, streams, self._collect(state, streams, parsers[0])
        )

    async def _collect(self, state: dict, streams, parser) -> dict:
        # Built as the stream is (same items for the same tokens), its events unsent.
        streamer, items, last = Streamer(parser), OutputItems(), None
        async for _, out in merge(streams):
            last = out
            c = out.outputs[0]
            items.feed(*streamer.feed(c.text, c.finish_reason is not None))
        c = last.outputs[0]
        items.finish(c.finish_reason == "length")
        return self._finish(state, last, c, streamer, items.items)

    def _response(self, state: dict, status: str, output: list[dict]) -> dict:
        body = state["body"]
        return {
            "id": state["rid"],
            "object": "response",
            "created_at": state["created_at"],
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "error": None,
            "model": body.get("model") or self.chat.model_name,
            "output": output,
            "previous_response_id": body.get("previous_response_id"),
            "instructions": body.get("instructions"),
            "store": body.get("store", True),
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {},
            "usage": None,
        }

    def _finish(self, state, out, c, streamer: Streamer, items: list[dict]) -> dict:
        parsed = streamer.sent
        status = "incomplete" if c.finish_reason == "length" else "completed"
        response = self._response(state, status, items)
        usage = self.chat.usage([out])
        reasoning = len(self.chat.tok.encode(parsed.reasoning, False)) if parsed.reasoning else 0
        response["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]
            },  # fmt: skip
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage["total_tokens"],
        }
        if state["body"].get("store", True):
            reply = {"role": "assistant", "content": parsed.content or None}
            if parsed.calls:
                reply["tool_calls"] = [
                    {"id": i, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}
                    for call, i in zip(parsed.calls, streamer.ids, strict=True)
                ]  # fmt: skip
            elif reply["content"] is None:
                reply["content"] = ""
            self.store.put(state["rid"], [*state["history"], reply],
                           {**response, "_session": state["session"]})  # fmt: skip
        return response

    async def _events(self, state: dict, streams, parser):
        seq = -1

        def event(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            payload = {"type": kind, "sequence_number": seq, **data}
            return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

        head = self._response(state, "in_progress", [])
        yield event("response.created", response=head)
        yield event("response.in_progress", response=head)
        streamer, items, last = Streamer(parser), OutputItems(), None
        try:
            async for _, out in merge(streams):
                last = out
                c = out.outputs[0]
                for kind, data in items.feed(*streamer.feed(c.text, c.finish_reason is not None)):
                    yield event(kind, **data)
        except Exception as exc:  # the API's way: an error event, then the response failed
            yield event("error", message=str(exc), code="engine_error", param=None)
            failed = self._response(state, "failed", items.items)
            failed["error"] = {"code": "server_error", "message": str(exc)}
            yield event("response.failed", response=failed)
            return
        finally:
            for s in streams:
                s.abort()
        if last is None:
            return
        c = last.outputs[0]
        for kind, data in items.finish(c.finish_reason == "length"):
            yield event(kind, **data)
        response = self._finish(state, last, c, streamer, items.items)
        yield event(f"response.{response['status']}", response=response)


class OutputItems:
    """A reply's output items, built from a `Streamer`'s deltas in the order they begin, with
    the typed events that build them in a stream: each item is added, gets its content part
    and deltas, then is done, before the next one is added.

    Reasoning and text items open on their first delta; whitespace outside an item waits, and
    is dropped if a function call comes next (the newline between two calls is no message).
    The item left open when the reply was cut off is `incomplete`. A reply without a message
    or a call gets one (possibly empty) message, so `output_text` is always there.
    """

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._events: list[tuple[str, dict]] = []
        self._open: dict | None = None
        self._space = ""  # whitespace not yet in a message
        self._calls: dict[int, int] = {}  # the streamer's call index -> output index

    def feed(self, content: str, reasoning: str, calls: list[dict]) -> list[tuple[str, dict]]:
        """Deltas as `Streamer.feed` returns them -> (event type, fields) to send."""
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
                self._space = ""
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
            self._emit("response.output_text.delta", **where, delta=delta, logprobs=[])
        else:
            self._emit("response.reasoning_text.delta", **where, delta=delta)

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
                           text=part["text"], logprobs=[])  # fmt: skip
            else:
                self._emit("response.reasoning_text.done", **where, content_index=0,
                           text=part["text"])  # fmt: skip
            self._emit("response.content_part.done", **where, content_index=0, part=dict(part))
        self._emit("response.output_item.done", output_index=i, item=copy.deepcopy(item))

    def _emit(self, kind: str, **data) -> None:
        self._events.append((kind, data))

    def _take(self) -> list[tuple[str, dict]]:
        out, self._events = self._events, []
        return out


def install_responses_routes(app: FastAPI, serving: ResponsesServing, check_model) -> None:
    @app.post("/v1/responses")
    async def create(request: Request):
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            raise InvalidInputError("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidInputError("request body must be a JSON object")
        check_types(body)
        return check_model(body.get("model")) or await serving.create(body, request)

    # Not in the OpenAPI spec: FastAPI would describe a 422 for the path parameter, which we
    # never send (an unknown id is a 404).
    @app.get("/v1/responses/{rid}", include_in_schema=False)
    async def get(rid: str):
        found = serving.store.get(rid)
        if found is None:
            return JSONResponse(error_body(f"response {rid!r} not found", "not_found_error"),
                                status_code=404)  # fmt: skip
        return {k: v for k, v in found[1].items() if not k.startswith("_")}

    @app.delete("/v1/responses/{rid}", include_in_schema=False)
    async def delete(rid: str):
        if not serving.store.delete(rid):
            return JSONResponse(error_body(f"response {rid!r} not found", "not_found_error"),
                                status_code=404)  # fmt: skip
        return {"id": rid, "object": "response", "deleted": True}
