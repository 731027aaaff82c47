"""The Responses API's side routes: a stored response's input items, and counting a request's
input tokens without running it.

Who calls it: `server/responses.py` installs the routes beside its own. `input_items` turns a
checked body's `input` into the items OpenAI lists (each with an id); the store keeps them with
the response (`_input`), so `GET /v1/responses/{id}/input_items` pages through what that
response was given (newest first by default, as OpenAI's). `POST /v1/responses/input_tokens`
renders the conversation the body means (a `previous_response_id` chain included) with the
model's chat template and counts its tokens. Failure: an unknown response is a 404, bad query
parameters and bodies 400s naming the field; nothing is queued.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hetserve.errors import InvalidInputError
from hetserve.server.errors import error_body
from hetserve.server.validation import json_object

MAX_LIMIT = 100


def input_items(value: Any) -> list[dict]:
    """A checked body's `input` as OpenAI lists it: each item an object with an id; a string
    is one user message of input text."""
    items = [{"role": "user", "content": value}] if isinstance(value, str) else list(value)
    out = []
    for it in items:
        it = {"type": "message", **it}
        if it["type"] == "message":
            content = it.get("content")
            kind = "output_text" if it.get("role") == "assistant" else "input_text"
            if isinstance(content, str):
                it["content"] = [{"type": kind, "text": content}]
            it.setdefault("status", "completed")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
        it.setdefault("id", f"{prefix.get(it['type'], 'item')}_{uuid.uuid4().hex}")
        out.append(it)
    return out


def install_listing_routes(app: FastAPI, serving: Any, check_model: Any) -> None:
    @app.get("/v1/responses/{rid}/input_items", include_in_schema=False)
    async def list_input_items(rid: str, request: Request):
        found = serving.store.get(rid)
        if found is None:
            return JSONResponse(error_body(f"response {rid!r} not found", "not_found_error"),
                                status_code=404)  # fmt: skip
        items = list(found[1].get("_input") or [])
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidInputError("order must be 'asc' or 'desc'", "order")
        try:
            limit = int(q.get("limit", "20"))
        except ValueError:
            raise InvalidInputError("limit must be an integer", "limit") from None
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidInputError(f"limit must be 1..{MAX_LIMIT}", "limit")
        if order == "desc":
            items.reverse()
        after = q.get("after")
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise InvalidInputError(f"after names no input item of {rid!r}", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {"object": "list", "data": page, "has_more": len(items) > limit,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None}  # fmt: skip

    @app.post("/v1/responses/input_tokens", include_in_schema=False)
    async def count_input_tokens(request: Request):
        body = await json_object(request)
        missing = check_model(body.get("model"))
        if missing is not None:
            return missing
        return {"object": "response.input_tokens",
                "input_tokens": await serving.count_input_tokens(body)}  # fmt: skip
