"""OpenAI-style error bodies, and which exception becomes which HTTP status.

Every error the server sends, from any route, middleware or stream, is built here, so a client
always gets `{"error": {"message", "type", "param", "code"}}` JSON (in a stream: one
`data: {"error": ...}` event, then `data: [DONE]`), never plain text.
"""

from __future__ import annotations

import json
import logging

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from hetserve.engine.async_llm import EngineDeadError, EngineRequestError
from hetserve.errors import HetserveError, InvalidInputError
from hetserve.server.validation import UnsupportedFieldError

log = logging.getLogger(__name__)


class BodyTooLargeError(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body over {limit} bytes; send a shorter prompt")


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", **kw):
    return JSONResponse(error_body(message, type_, **kw), status_code=status)


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """One line naming the first offending field, and that field (OpenAI's `param`)."""
    errors = exc.errors(include_url=False)
    err = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if err.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    cause = (err.get("ctx") or {}).get("error")
    loc = [str(x) for x in err.get("loc", ()) if not _is_union_branch(x)]
    param = ".".join(loc) or None
    if isinstance(cause, InvalidInputError) and cause.param:
        # A rule of ours (server/validation.py) names its field relative to where it ran (a
        # message's "content"); the message then says which one ("messages.2.content: ...").
        if param is None or param.endswith(cause.param):
            param = param or cause.param
        else:
            param = f"{param}.{cause.param}"
        return (str(cause) if param == cause.param else f"{param}: {cause}"), param
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def _is_union_branch(part) -> bool:
    # pydantic names the union member it tried ("list[int]", "str", "function-after[...]").
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def exception_status(exc: BaseException) -> tuple[int, dict]:
    """HTTP status and error body for an exception raised while serving a request."""
    if isinstance(exc, ValidationError):
        message, param = validation_message(exc)
        return 400, error_body(message, param=param)
    if isinstance(exc, UnsupportedFieldError):
        return 400, error_body(str(exc), param=exc.param, code="unsupported")
    if isinstance(exc, InvalidInputError):
        return 400, error_body(str(exc), param=exc.param)
    if isinstance(exc, BodyTooLargeError):
        return 413, error_body(str(exc))
    if isinstance(exc, HetserveError):
        return 400, error_body(str(exc))
    if isinstance(exc, EngineRequestError):
        return 500, error_body(str(exc), "server_error", code="engine_error")
    if isinstance(exc, EngineDeadError):
        return 503, error_body(str(exc), "server_error", code="engine_dead")
    log.error("internal error while serving a request", exc_info=exc)
    return 500, error_body(f"internal server error ({type(exc).__name__})", "server_error")


def sse_error(exc: BaseException) -> str:
    _, body = exception_status(exc)
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
