"""The FastAPI app: routes, OpenAI-style errors, bearer auth, request size limit, disconnects."""

from __future__ import annotations

import asyncio
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hetserve.engine.async_llm import AsyncLLM
from hetserve.errors import HetserveError
from hetserve.server.metrics import ServerMetrics
from hetserve.server.protocol import ChatCompletionRequest, CompletionRequest
from hetserve.server.serving import OpenAIServing

MAX_BODY_BYTES = 8 << 20


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    param = ".".join(loc) or None
    return (f"{param}: {err['msg']}" if param else err["msg"]), param


def create_app(
    engine: AsyncLLM,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    app = FastAPI(title="hetserve", docs_url=None, redoc_url=None)
    serving = OpenAIServing(engine, model_name)
    metrics = ServerMetrics(engine)
    app.state.engine, app.state.metrics = engine, metrics

    @app.middleware("http")
    async def guard(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            return error_response(413, f"request body over {max_body_bytes} bytes")
        if api_key and request.url.path.startswith("/v1/"):
            auth = request.headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                return error_response(
                    401,
                    "missing or invalid API key",
                    "authentication_error",
                    code="invalid_api_key",
                )
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(HetserveError)
    async def on_user_error(_, exc: HetserveError):
        return error_response(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_, exc: StarletteHTTPException):
        return error_response(
            exc.status_code,
            str(exc.detail),
            "not_found_error" if exc.status_code == 404 else "invalid_request_error",
        )

    def check_model(name: str | None):
        if name is not None and name != model_name:
            return error_response(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r}",
                "not_found_error",
                "model",
                "model_not_found",
            )
        return None

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "hetserve",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if (err := check_model(body.model)) is not None:
            return err
        base, gens = serving.start_completion(body)
        if body.stream:
            return StreamingResponse(
                serving.completion_stream(body, base, gens), media_type="text/event-stream"
            )
        return await _unless_disconnected(request, serving.completion(body, base, gens))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        if (err := check_model(body.model)) is not None:
            return err
        base, gen = serving.start_chat(body)
        if body.stream:
            return StreamingResponse(
                serving.chat_stream(body, base, gen), media_type="text/event-stream"
            )
        return await _unless_disconnected(request, serving.chat(body, base, gen))

    return app


async def _unless_disconnected(request: Request, coro):
    """Run a non-streaming handler; if the client goes away first, cancel it (which aborts the
    engine requests and frees their blocks)."""
    task = asyncio.ensure_future(coro)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            return Response(status_code=499)
    return task.result()
