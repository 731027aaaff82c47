"""The FastAPI app: routes, the ASGI guard (auth, body limit, arrival time), errors as JSON."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hetserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineRequestError
from hetserve.errors import HetserveError, InvalidInputError
from hetserve.server.access_log import AccessLog
from hetserve.server.anthropic import AnthropicServing, anthropic_error, install_anthropic_routes
from hetserve.server.chat import ChatServing
from hetserve.server.completions import CompletionServing
from hetserve.server.errors import BodyTooLargeError, error_body, exception_status
from hetserve.server.internal import install_internal_routes
from hetserve.server.lora import install_lora_routes
from hetserve.server.metrics import ServerMetrics
from hetserve.server.ollama import OllamaServing, install_ollama_routes
from hetserve.server.openapi import install_openapi
from hetserve.server.protocol import ChatCompletionRequest
from hetserve.server.protocol_completion import parse_completion
from hetserve.server.responses import ResponsesServing, install_responses_routes
from hetserve.server.tokenize import install_tokenize_routes
from hetserve.server.validation import UnsupportedFieldError

MAX_BODY_BYTES = 8 << 20
SERVED_APIS = (
    "this server serves OpenAI's API (POST /v1/chat/completions, /v1/completions, "
    "/v1/responses; GET /v1/models, /v1/models/ID), Anthropic's (POST /v1/messages), "
    "Ollama's (POST /api/chat, /api/generate, /api/show; GET /api/tags, /api/ps, "
    "/api/version), vLLM's POST "
    "/tokenize and /detokenize, GET /health and GET /metrics"
)
PARSE_OFF_LOOP = 256 << 10  # bodies larger than this are parsed off the event loop
GUARDED_TOP = ("/tokenize", "/detokenize")  # behind the API key beside /v1/*, /api/*, ...
T = TypeVar("T")


class Guard:
    """Pure ASGI middleware (a BaseHTTPMiddleware would hide client disconnects from the
    routes): stamps the arrival time, checks the bearer token on /v1/*, /api/* (Ollama's
    routes), /internal/* and vLLM's /tokenize and /detokenize, and enforces the body limit
    while the body is read, chunked bodies included, so an oversized one is never read whole.
    It also answers for the routes what nothing else caught: an error JSON while no response
    started (Starlette's outermost handler would send it too, but then re-raise, and uvicorn
    drops the client's keep-alive connection: one bad request would fail that client's next
    one), and writes the access line of every answer, its own and abandoned streams' (499)
    included."""

    def __init__(
        self, app, api_key: str | None, max_body_bytes: int, access=None, exempt=()
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.exempt = tuple(exempt)  # path prefixes whose routes check their own key
        self.limit = max_body_bytes
        self.access = access  # an AccessLog, or None: no line per request

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope["hetserve.arrival"] = time.monotonic()
        path = scope["path"]
        # Probes and the Conductor's load poll (10 a second per instance) get no line.
        logged = self.access is not None and path not in ("/health", "/metrics", "/internal/load")
        status: int | None = None  # set once the response starts
        ended = False

        async def answer(message) -> None:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
                message = _with_request_id(message, scope)
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
                if logged:
                    self.access.write(scope, status or 500)

        try:
            await self._serve(scope, receive, answer)
        except asyncio.CancelledError:
            # The server is stopping without waiting (a second Ctrl-C): a client whose answer
            # has not started gets a 503 in its API's shape, not uvicorn's traceback and 500.
            if status is not None:
                raise
            body = error_body("the server is shutting down; retry elsewhere or later",
                              "service_unavailable")  # fmt: skip
            await _send_json(answer, 503, _shaped(path, body))
        except Exception as exc:
            if status is not None:
                raise  # a stream broke after its start: nothing to answer, the connection ends
            code, body = exception_status(exc)
            await _send_json(answer, code, _shaped(path, body))
        finally:
            if logged and not ended:
                self.access.write(scope, 499)  # nginx's "client closed request"

    async def _serve(self, scope, receive, send) -> None:
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            body = error_body(str(BodyTooLargeError(self.limit)))
            return await _send_json(send, 413, _shaped(scope["path"], body))
        path = scope["path"]
        guarded = path.startswith(("/v1/", "/api/", "/internal/")) or path in GUARDED_TOP
        guarded = guarded and not (self.exempt and path.startswith(self.exempt))
        if self.api_key and guarded and not self._authorized(headers):
            body = error_body("missing or invalid API key", "authentication_error")
            body["error"]["code"] = "invalid_api_key"
            return await _send_json(send, 401, _shaped(scope["path"], body))
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLargeError(self.limit)
            return message

        await self.app(scope, limited_receive, send)

    def _authorized(self, headers: dict) -> bool:
        token = bearer(headers.get(b"authorization", b"").decode("latin-1"))
        if not token:  # Anthropic's SDKs send the key as x-api-key
            token = headers.get(b"x-api-key", b"").decode("latin-1")
        return hmac.compare_digest(token.encode(), self.api_key.encode())


def bearer(authorization: str) -> str:
    """The token of an `Authorization: Bearer TOKEN` header's value ("" if none)."""
    return authorization[7:] if authorization.lower().startswith("bearer ") else ""


def _shaped(path: str, body: dict) -> dict:
    """An error body in the shape of the API `path` belongs to: Ollama's routes answer
    `{"error": message}`, Anthropic's `{"type": "error", "error": {type, message}}`, the
    others OpenAI's object."""
    if path.startswith("/api/"):
        return {"error": body["error"]["message"]}
    if path.startswith("/v1/messages"):
        return anthropic_error(body)
    return body


def _with_request_id(start: dict, scope: dict) -> dict:
    """The response's start with the request's id as its SDK reads it (OpenAI's
    `x-request-id`, Anthropic's `request-id`), where the route started one."""
    base = scope.get("hetserve.base")
    headers = list(start.get("headers") or [])
    name = b"request-id" if scope["path"].startswith("/v1/messages") else b"x-request-id"
    if not base or any(k.lower() == name for k, _ in headers):
        return start
    return {**start, "headers": [*headers, (name, base.encode())]}


async def _send_json(send, status: int, body: dict) -> None:
    response = JSONResponse(body, status_code=status)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


async def parse_body(request: Request, parse: Callable[[bytes], T]) -> T:
    """The request's body through `parse`; a big body on a worker thread, which lets go of the
    GIL every few ms (on the event loop a maximal token-id prompt, ~2M ids, held every other
    request ~80 ms)."""
    body = await request.body()
    if len(body) > PARSE_OFF_LOOP:
        return await asyncio.to_thread(parse, body)
    return parse(body)


def create_app(
    engine: AsyncLLM,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    lora_runtime_updates: bool = False,
    profile: dict | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    log_requests: bool = False,
    trust_request_chat_template: bool = False,
) -> FastAPI:
    """`lora_runtime_updates`: allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    (clients then make the server read directories they name; see server/lora.py). `profile`:
    the instance's cost profile for a Conductor (JSON form; None: measured when first asked).
    `tool_call_parser`, `reasoning_parser`: override the ones the chat template implies.
    `log_requests`: an access line per request (server/access_log.py).
    `trust_request_chat_template`: render a chat request's own `chat_template` (sandboxed)."""
    app = FastAPI(title="hetserve", docs_url=None, redoc_url=None)
    completions = CompletionServing(engine, model_name)
    chat = ChatServing(engine, model_name, tool_call_parser, reasoning_parser,
                       trust_request_chat_template)  # fmt: skip
    metrics = ServerMetrics(engine, model_name)
    app.state.engine, app.state.metrics = engine, metrics
    access = AccessLog(engine) if log_requests else None
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, access=access)

    async def on_error(request: Request, exc: Exception):
        status, body = exception_status(exc)
        return JSONResponse(_shaped(request.url.path, body), status_code=status)

    # Each expected type by name, answered where it was raised; anything else (our bugs: its
    # traceback is logged) is answered by the Guard, `Exception` here only for what escapes it.
    for exc_type in (
        ValidationError,
        UnsupportedFieldError,
        HetserveError,
        BodyTooLargeError,
        EngineRequestError,
        EngineDeadError,
        Exception,
    ):
        app.add_exception_handler(exc_type, on_error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404 and exc.detail == "Not Found":  # no such route
            message = f"no route {request.method} {request.url.path}; {SERVED_APIS}"
            body = error_body(message, "not_found_error")
            return JSONResponse(_shaped(request.url.path, body), status_code=404)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = error_body(str(exc.detail), kind)
        return JSONResponse(_shaped(request.url.path, body), status_code=exc.status_code)

    def check_model(name: object) -> JSONResponse | None:
        """None when `name` is served: the base model or a loaded LoRA adapter."""
        if name is None or name == model_name:
            return None
        if not isinstance(name, str):
            raise InvalidInputError("model: must be a string, the served model's name", "model")
        adapters = engine.lora_adapters()
        if name in adapters:
            return None
        also = f" and LoRA adapters {sorted(adapters)}" if adapters else ""
        body = error_body(
            f"model {name!r} does not exist; this server serves {model_name!r}{also}",
            "not_found_error",
            "model",
            "model_not_found",
        )
        return JSONResponse(body, status_code=404)

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            body = error_body("the engine has stopped", "server_error", code="engine_dead")
            return JSONResponse(body, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def model_cards() -> list[dict]:
        # As vLLM lists them: the base model, then each adapter with its parent and path.
        now = time.time()

        def card(name: str, root: str, parent: str | None) -> dict:
            return {
                "id": name,
                "object": "model",
                "created": int(now),
                "owned_by": "hetserve",
                "root": root,
                "parent": parent,
                "max_model_len": engine.max_model_len,
                "vocab_size": engine.vocab_size,
                # Anthropic's fields beside OpenAI's: its SDKs list models from the same route.
                "type": "model",
                "display_name": name,
                "created_at": datetime.fromtimestamp(now, UTC).isoformat(),
            }

        cards = [card(model_name, str(engine.model_dir), None)]
        ids = engine.lora_ids()  # hetserve's: the content id its requests' blocks are hashed by
        cards += [card(n, path, model_name) | {"lora_id": ids.get(n)}
                  for n, path in engine.lora_adapters().items()]  # fmt: skip
        return cards

    @app.get("/v1/models")
    async def models():
        cards = model_cards()
        return {"object": "list", "data": cards, "has_more": False,
                "first_id": cards[0]["id"], "last_id": cards[-1]["id"]}  # fmt: skip

    # Not in the OpenAPI spec: FastAPI would describe a 422 for the path parameter, which we
    # never send (an unknown model is a 404).
    @app.get("/v1/models/{model_id:path}", include_in_schema=False)
    async def retrieve_model(model_id: str, request: Request):
        """OpenAI's and Anthropic's model retrieval (their SDKs' `models.retrieve`)."""
        card = next((c for c in model_cards() if c["id"] == model_id), None)
        if card is not None:
            return card
        missing = check_model(model_id)
        assert missing is not None
        if "anthropic-version" in request.headers:  # Anthropic's SDK: its error shape
            return JSONResponse(anthropic_error(json.loads(missing.body)), status_code=404)
        return missing

    @app.post("/v1/completions")
    async def create_completion(request: Request):
        req = await parse_body(request, parse_completion)
        return check_model(req.model) or await completions.create(req, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        req = await parse_body(request, ChatCompletionRequest.model_validate_json)
        return check_model(req.model) or await chat.create(req, request)

    install_ollama_routes(app, OllamaServing(chat, model_name), engine, check_model)
    app.state.responses = ResponsesServing(chat)
    install_responses_routes(app, app.state.responses, check_model)
    install_tokenize_routes(app, chat, check_model)
    install_anthropic_routes(app, AnthropicServing(chat), check_model)
    install_lora_routes(app, engine, model_name, lora_runtime_updates)
    install_internal_routes(app, engine, profile)
    install_openapi(app)
    return app
