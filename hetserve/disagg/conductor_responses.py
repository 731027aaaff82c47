"""The Conductor's Responses API (`/v1/responses`): requests routed by where their state is.

Who calls it: the Conductor's app (server/conductor_app.py), when the entrypoint gave the
Conductor the Responses API (`Conductor.apis["/v1/responses"]`, whose `to_chat` is
`stateless_chat_body`). A request that continues no stored response is routed as the chat
request it means, like any other (cache-aware, disaggregated). One that continues a stored
response (`previous_response_id`) goes, colocated, to the instance that stored it: the
conversation lives there, and so does its cached prefix. Reading one (`GET`, with
`?stream=true` its events), cancelling or deleting one goes there too. Which instance holds a
response is asked of the decode-capable instances (`GET /v1/responses/{id}`) the first time and
remembered (the newest `limit`), so a Conductor started again finds them as well.

Failure contract: a response no instance holds answers as an instance would (404 for a read,
400 naming `previous_response_id` for a continuation); its holder down (or, not found while
some decode instance is down, perhaps its holder) is a 503 with `Retry-After`; an instance
failing mid-way is a 502; bodies in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hetserve.disagg.conductor import error_response

PATH = "/v1/responses"


class ResponsesRoutes:
    def __init__(self, conductor: Any, limit: int = 4096) -> None:
        self.c, self.limit = conductor, limit
        self.holders: OrderedDict[str, str] = OrderedDict()  # response id -> instance name

    async def create(self, raw: bytes, request: Request) -> Response:
        prev = _previous(raw)
        if prev is None:  # stateless (or malformed: the route says so)
            return await self.c.route(PATH, raw, request)
        name = await self.holder(prev)
        if name is None:
            if self._some_down():
                return _down("an instance that is down", prev)
            return _unknown_previous(prev)
        inst = self.c.cluster.instances.get(name)
        if inst is None or not inst.healthy:  # down, or removed while it was asked for
            return _down(name, prev)
        return await self.c.route(PATH, raw, request, pinned=name)

    async def count_tokens(self, raw: bytes, request: Request) -> Response:
        """POST /v1/responses/input_tokens: by the holder of the stored chain it continues,
        else by any instance."""
        prev = _previous(raw)
        if prev is None:
            return await self.c.forward_any(PATH + "/input_tokens", raw)
        return await self.read("POST", prev, "", request, path="/input_tokens", content=raw)

    async def read(
        self,
        method: str,
        rid: str,
        suffix: str,
        request: Request,
        path: str | None = None,
        content: bytes | None = None,
    ) -> Response:
        """GET /v1/responses/{rid} (and its input items), POST .../cancel, DELETE: answered
        by its holder; `path` (with a body, `content`): another route of the holder's."""
        name = await self.holder(rid)
        if name is None:
            if self._some_down():
                return _down("an instance that is down", rid)
            if path is not None:
                return _unknown_previous(rid)
            return error_response(404, f"response {rid!r} not found", "not_found_error")
        inst = self.c.cluster.instances.get(name)
        if inst is None or not inst.healthy:  # down, or removed while it was asked for
            return _down(name, rid)
        url = f"{inst.url}{PATH}{path or '/' + quote(rid, safe='')}{suffix}"
        http: httpx.AsyncClient = self.c.cluster.http
        req = http.build_request(method, url, params=request.query_params, content=content,
                                 headers={"content-type": "application/json"} if content else None,
                                 timeout=httpx.Timeout(10.0, read=None))  # fmt: skip
        try:
            resp = await http.send(req, stream=True)
        except httpx.HTTPError as exc:
            self.c.cluster.mark_down(name)
            return error_response(502, f"its instance failed: {exc}", "server_error")
        if method == "DELETE" and resp.status_code == 200:
            self.holders.pop(rid, None)
        kind = resp.headers.get("content-type", "")
        if "text/event-stream" not in kind:
            data = await resp.aread()
            await resp.aclose()
            return Response(data, status_code=resp.status_code, media_type=kind or None)

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:  # its instance died mid-stream: the API's way
                yield stream_error(f"its instance failed: {exc}")
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), status_code=resp.status_code, media_type=kind)

    def _some_down(self) -> bool:
        """Whether a decode-capable instance is down: it may hold what no other one does."""
        return any(not i.healthy and i.role.decodes for i in self.c.cluster.instances.values())

    async def holder(self, rid: str) -> str | None:
        """The instance that holds response `rid`, remembered or asked for (None: none)."""
        cluster = self.c.cluster
        name = self.holders.get(rid)
        if name is not None and name in cluster.instances:
            self.holders.move_to_end(rid)
            return name
        asked = [i for i in cluster.instances.values() if i.healthy and i.role.decodes]

        async def ask(inst: Any) -> str | None:
            try:
                r = await cluster.http.get(f"{inst.url}{PATH}/{quote(rid, safe='')}", timeout=10)
            except httpx.HTTPError:
                return None
            return str(inst.name) if r.status_code == 200 else None

        for found in await asyncio.gather(*(ask(i) for i in asked)):
            if found is not None:
                self.holders[rid] = found
                while len(self.holders) > self.limit:
                    self.holders.popitem(last=False)
                return found
        return None


def _previous(raw: bytes) -> str | None:
    """The stored response a body continues (`previous_response_id`); None: none, or a body
    that is no JSON object (the instance's route says so)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    prev = body.get("previous_response_id") if isinstance(body, dict) else None
    return prev if isinstance(prev, str) else None


def _unknown_previous(prev: str) -> JSONResponse:
    msg = f"previous response {prev!r} was not found (not stored, or evicted)"
    return error_response(400, msg, "invalid_request_error", param="previous_response_id")


def stream_error(message: str) -> bytes:
    """A Responses stream's error event, where the instance serving it fails mid-way."""
    err = {"type": "error", "code": "server_error", "message": message}
    return f"event: error\ndata: {json.dumps(err)}\n\n".encode()


def _down(name: str, rid: str) -> JSONResponse:
    msg = f"response {rid!r} is held by {name}; try again shortly"
    return error_response(503, msg, "service_unavailable", {"Retry-After": "2"})
