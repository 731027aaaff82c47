"""/v1/responses: OpenAI's Responses API, which the current SDKs and agent frameworks use.

A request is translated into the chat request it means (`responses_input.py`: input items ->
messages, tools and tool_choice, text.format -> structured output, reasoning.effort) and run by
the chat route's machinery; the reply becomes output items (reasoning, message, function_call),
streamed as the API's typed events. `previous_response_id` continues a stored conversation: its
messages are rendered again in front of the new input, so the prompt starts with the earlier
turn's tokens and the prefix cache (and the KV tiers behind it) serves them; the chain shares a
session id, so its blocks are kept for the session TTL between turns. `store: false` keeps
nothing. The store is in memory, bounded (least recently used goes first). `background: true`
runs the response as a task of its own (`responses_background.py`: poll it, stream its events
again, cancel it). `include` asks for the output text's logprobs (`top_logprobs`
alternatives) and the reasoning items' `encrypted_content`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hetserve.errors import InvalidInputError, PromptTooLongError
from hetserve.server.chat import ChatServing
from hetserve.server.errors import error_body
from hetserve.server.responses_background import BackgroundRun, BackgroundRuns
from hetserve.server.responses_input import (
    chat_request,
    check_types,
    included,
    input_messages,
    system_messages,
    their_names,
    truncated,
)
from hetserve.server.responses_items import OutputItems
from hetserve.server.responses_listing import input_items, install_listing_routes
from hetserve.server.stream_merge import merge
from hetserve.server.tools import Streamer
from hetserve.server.validation import json_object

MAX_STORED = 1024


class ResponseStore:
    """Stored responses: (the conversation so far, as chat messages, or None where it cannot be
    continued: a background response running, failed or cancelled; the response)."""

    def __init__(self, limit: int = MAX_STORED) -> None:
        self.limit = limit
        self._items: OrderedDict[str, tuple[list[dict] | None, dict]] = OrderedDict()

    def put(self, rid: str, messages: list[dict] | None, response: dict) -> None:
        self._items[rid] = (messages, response)
        if len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[list[dict] | None, dict] | None:
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
        self.runs = BackgroundRuns()

    def _conversation(self, body: dict) -> tuple[list[dict], list[dict], list[dict], Any]:
        """(the stored chain's messages, the body's input's, the instructions', the chain's
        session): what the body continues, checked."""
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
            if history is None:  # a background response that is running, failed or cancelled
                run = self.runs.get(prev_id)
                status = (run.response if run is not None else prev)["status"]
                raise InvalidInputError(
                    f"previous response {prev_id!r} is {status}, not completed",
                    "previous_response_id",
                )
            session = prev.get("_session")
        called = {c["id"] for m in history for c in m.get("tool_calls") or ()}
        new = input_messages(body.get("input", ""), called)
        return history, new, system_messages(body), session

    async def count_input_tokens(self, body: dict) -> int:
        """The tokens the body's conversation renders to (nothing runs)."""
        check_types(body)
        history, new, system, _ = self._conversation(body)
        req = chat_request({**body, "max_output_tokens": None}, system + history + new)
        prompt = await self.chat.prompt_of(req)
        return len(await self.chat.encode(prompt, add_special_tokens=False, whole=True))

    async def create(self, body: dict, request: Request):
        history, new, system, session = self._conversation(body)
        messages = system + history + new
        truncation = body.get("truncation") or "disabled"
        if truncation not in ("auto", "disabled"):
            raise InvalidInputError("truncation must be 'auto' or 'disabled'", "truncation")
        background = body.get("background") is True
        if background and body.get("store") is False:
            raise InvalidInputError(
                "a background response is kept to be read later: it needs store (drop "
                "store: false)",
                "background",
            )
        if background and self.runs.running() >= self.runs.max_running:
            msg = (f"{self.runs.max_running} background responses are running; wait for one "
                   "to end (or cancel one)")  # fmt: skip
            return JSONResponse(error_body(msg, "rate_limit_error"), status_code=429,
                                headers={"Retry-After": "1"})  # fmt: skip
        rid = f"resp_{uuid.uuid4().hex}"
        session = session or rid  # the chain's blocks outlive each turn for the session TTL
        while True:
            req = chat_request(body, messages)
            req.session_id = session
            try:
                streams, parsers, _ = await self.chat.prepare(rid, req, request)
                break
            except PromptTooLongError as exc:
                # "auto": OpenAI's, the oldest items go until the rest fits.
                shorter = truncated(messages, len(system)) if truncation == "auto" else None
                if shorter is None:  # the limit named as this body names it
                    message = str(exc).replace("max_tokens", "max_output_tokens")
                    raise PromptTooLongError(message, their_names("", exc.param)[1]) from None
                messages = shorter
        include = included(body)
        state = {"rid": rid, "body": body, "history": history + new, "session": session,
                 "input": input_items(body.get("input", "")),
                 "created_at": int(time.time()), "background": background,
                 "logprobs": (req.top_logprobs or 0) if req.logprobs else None,
                 "encrypt": "reasoning.encrypted_content" in include}  # fmt: skip
        items = OutputItems(state["encrypt"], logprobs=state["logprobs"] is not None)
        if background:
            return self._background(state, streams, parsers[0], items)
        if body.get("stream"):
            events = self._events(state, streams, parsers[0], items)
            return StreamingResponse(_sse(events), media_type="text/event-stream")
        return await self.chat.run_unless_disconnected(
            request, streams, self._collect(state, streams, parsers[0], items)
        )

    def _background(self, state: dict, streams, parser, items: OutputItems):
        queued = self._response(state, "queued", [])
        self.store.put(state["rid"], None, {**queued, **_kept(state)})
        run = BackgroundRun(state["rid"], queued, items, streams)

        def ended(r: BackgroundRun) -> None:
            if r.response["status"] in ("failed", "cancelled"):  # _finish stored the others
                self.store.put(r.rid, None, {**r.response, **_kept(state)})

        run.start(self._events(state, streams, parser, items), ended)
        self.runs.add(run)
        if state["body"].get("stream"):
            return StreamingResponse(_sse(run.follow(-1)), media_type="text/event-stream")
        return queued

    async def cancel(self, rid: str) -> dict:
        """Stop a background response; one that ended answers as it ended (idempotent)."""
        run = self.runs.get(rid)
        if run is not None:
            await run.cancel()
            return run.snapshot()
        found = self.store.get(rid)
        if found is not None and found[1].get("background"):  # ended, its events dropped
            return _public(found[1])
        raise InvalidInputError(f"response {rid!r} did not run in the background: only "
                                "background responses can be cancelled")  # fmt: skip

    async def delete(self, rid: str) -> bool:
        """Forget a response; a background one still running is stopped first (else its end
        would store it again)."""
        run = self.runs.pop(rid)
        if run is not None:
            await run.cancel()
        return self.store.delete(rid) or run is not None

    def _logprobs(self, state: dict, c, seen: int) -> list[dict] | None:
        """The step's new tokens' logprobs, as the chat route writes them (None: not asked)."""
        if state["logprobs"] is None:
            return None
        entries = c.logprobs[seen:]
        return self.chat.token_logprobs(c.token_ids[seen:], entries, state["logprobs"])["content"]

    async def _fed(self, state: dict, streams, streamer: Streamer, items: OutputItems):
        """Each engine output, fed to the parser and the items: (output, the item events)."""
        seen = 0
        async for _, out in merge(streams):
            c = out.outputs[0]
            lp = self._logprobs(state, c, seen)
            seen = len(c.token_ids)
            yield out, items.feed(*streamer.feed(c.text, c.finish_reason is not None), logprobs=lp)

    async def _collect(self, state: dict, streams, parser, items: OutputItems) -> dict:
        # Built as the stream is (same items for the same tokens), its events unsent.
        streamer, last = Streamer(parser), None
        async for out, _ in self._fed(state, streams, streamer, items):
            last = out
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
            "background": state["background"],
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
            self.store.put(state["rid"], [*state["history"], reply], {**response, **_kept(state)})
        return response

    async def _events(self, state: dict, streams, parser, items: OutputItems):
        """The response's stream events, as dicts (`_sse` writes them)."""
        seq = -1

        def event(kind: str, **data) -> dict:
            nonlocal seq
            seq += 1
            return {"type": kind, "sequence_number": seq, **data}

        def failure(exc: Exception) -> list[dict]:  # the API's way: an error, then failed
            failed = self._response(state, "failed", items.items)
            failed["error"] = {"code": "server_error", "message": str(exc)}
            return [event("error", message=str(exc), code="engine_error", param=None),
                    event("response.failed", response=failed)]  # fmt: skip

        # OpenAI's: a background response is created while queued, then in progress.
        created = "queued" if state["background"] else "in_progress"
        yield event("response.created", response=self._response(state, created, []))
        yield event("response.in_progress", response=self._response(state, "in_progress", []))
        streamer, last = Streamer(parser), None
        try:
            async for out, fed in self._fed(state, streams, streamer, items):
                last = out
                for kind, data in fed:
                    yield event(kind, **data)
        except Exception as exc:
            for e in failure(exc):
                yield e
            return
        finally:
            for s in streams:
                s.abort()
        try:
            if last is None:
                raise RuntimeError("the engine ended the request without an output")
            c = last.outputs[0]
            closing = items.finish(c.finish_reason == "length")
            response = self._finish(state, last, c, streamer, items.items)
        except Exception as exc:
            for e in failure(exc):
                yield e
            return
        for kind, data in closing:
            yield event(kind, **data)
        yield event(f"response.{response['status']}", response=response)


def install_responses_routes(app: FastAPI, serving: ResponsesServing, check_model) -> None:
    install_listing_routes(app, serving, check_model)

    @app.post("/v1/responses")
    async def create(request: Request):
        body = await json_object(request)
        check_types(body)
        return check_model(body.get("model")) or await serving.create(body, request)

    # Not in the OpenAPI spec: FastAPI would describe a 422 for the path parameter, which we
    # never send (an unknown id is a 404).
    @app.get("/v1/responses/{rid}", include_in_schema=False)
    async def get(rid: str, request: Request):
        found = serving.store.get(rid)
        run = serving.runs.get(rid)
        if found is None and run is None:
            return _not_found(rid)
        stream = request.query_params.get("stream", "false").lower()
        if stream not in ("true", "false"):
            raise InvalidInputError("stream must be true or false", "stream")
        if stream == "true":
            if run is None:
                raise InvalidInputError(
                    f"response {rid!r} has no events kept: only the newest background "
                    "responses can be streamed again; GET it without stream",
                    "stream",
                )
            after = _int_param(request, "starting_after", -1)
            return StreamingResponse(_sse(run.follow(after)), media_type="text/event-stream")
        if run is not None and (found is None or not run.ended):
            return run.snapshot()  # running, or ended and no longer in the store
        assert found is not None
        return _public(found[1])

    @app.post("/v1/responses/{rid}/cancel", include_in_schema=False)
    async def cancel(rid: str):
        if serving.store.get(rid) is None and serving.runs.get(rid) is None:
            return _not_found(rid)
        return await serving.cancel(rid)

    @app.delete("/v1/responses/{rid}", include_in_schema=False)
    async def delete(rid: str):
        if not await serving.delete(rid):
            return _not_found(rid)
        return {"id": rid, "object": "response", "deleted": True}

def _kept(state: dict) -> dict:
    """What the store keeps beside a response: its chain's session, its input items."""
    return {"_session": state["session"], "_input": state["input"]}


def _public(response: dict) -> dict:
    """A stored response without the store's own keys (`_session`)."""
    return {k: v for k, v in response.items() if not k.startswith("_")}


def _not_found(rid: str) -> JSONResponse:
    return JSONResponse(error_body(f"response {rid!r} not found", "not_found_error"),
                        status_code=404)  # fmt: skip


def _int_param(request: Request, name: str, default: int) -> int:
    value = request.query_params.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidInputError(f"{name} must be an integer, got {value!r}", name) from None


async def _sse(events):
    """Stream events (dicts) as server-sent events, each named by its type."""
    async for e in events:
        yield f"event: {e['type']}\ndata: {json.dumps(e, separators=(',', ':'))}\n\n"
