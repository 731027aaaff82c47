"""The Conductor's HTTP face: the FastAPI app `hetserve conductor` serves (`/v1/completions`
and `/v1/chat/completions` handed to `disagg.conductor.Conductor.route`, `/v1/models`,
`/health`, `/metrics`), behind the same guard as an instance (bearer key on /v1, body limit).
Where the entrypoint gives it the other APIs the instances serve, it routes them too
(Anthropic's /v1/messages, OpenAI's /v1/responses, Ollama's /api/chat and /api/generate; the
rest of Ollama's routes and vLLM's /tokenize and /detokenize answered by any instance). Its
instances change while it runs through `/internal/instances` (GET lists, POST {"url",
"role"} adds one that joins once it answers, DELETE .../NAME removes one) and SGLang router's
`/add_worker?url=`, `/remove_worker?url=` and `/list_workers`, all behind the admin key
(without one: callers on its machine only).

Who calls it: `entrypoints/conductor.py`. Failure contract: as the Conductor's (routes never
raise for a client's input); `/health` answers 503 while no healthy instance can prefill or
none can decode.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hetserve.config import Role
from hetserve.config_sections import is_loopback_host
from hetserve.disagg.conductor import Conductor
from hetserve.disagg.conductor_responses import ResponsesRoutes
from hetserve.disagg.instances import ClusterError
from hetserve.errors import InvalidInputError
from hetserve.server.app import Guard, bearer
from hetserve.server.errors import error_body

# Their routes check the admin key themselves (`refused`).
ADMIN_PATHS = ("/internal/instances", "/add_worker", "/remove_worker", "/list_workers")


def create_conductor_app(conductor: Conductor, model_name: str) -> FastAPI:
    app = FastAPI(title="hetserve conductor", docs_url=None, redoc_url=None)
    app.add_middleware(Guard, api_key=conductor.config.api_key, max_body_bytes=8 << 20,
                       exempt=ADMIN_PATHS)  # fmt: skip
    app.state.conductor = conductor
    cluster = conductor.cluster

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        """No such route, or not with this method: OpenAI's error shape, as an instance's."""
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = f"no route {request.method} {request.url.path} on this Conductor"
        else:
            message = str(exc.detail)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(message, kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))  # fmt: skip

    def refused(request: Request) -> JSONResponse | None:
        """Who may change the instances: a holder of the admin key; without one configured, a
        caller on this machine (with the clients' key, if there is one). A client's key alone
        must not: it could add an instance of its own and be sent others' prompts."""
        token = bearer(request.headers.get("authorization", ""))
        admin, client = conductor.config.admin_key, conductor.config.api_key
        if admin:
            if hmac.compare_digest(token.encode(), admin.encode()):
                return None
            body = error_body("changing the instances needs the Conductor's admin key "
                              "(--admin-key or HETSERVE_ADMIN_KEY)", "authentication_error")
            return JSONResponse(body, status_code=401)
        host = request.client.host if request.client else ""
        if not is_loopback_host(host):
            body = error_body("without an admin key the instances are changed only from the "
                              "Conductor's machine; start it with --admin-key",
                              "permission_error")  # fmt: skip
            return JSONResponse(body, status_code=403)
        if client and not hmac.compare_digest(token.encode(), client.encode()):
            body = error_body("missing or invalid API key", "authentication_error")
            return JSONResponse(body, status_code=401)
        return None

    def add(url: object, role: object) -> JSONResponse:
        try:
            name = cluster.add(_instance_url(url), None if role is None else _role(role))
        except (InvalidInputError, ClusterError) as exc:
            code = 409 if isinstance(exc, ClusterError) else 400
            return JSONResponse(error_body(str(exc), param="url"), status_code=code)
        return JSONResponse({"name": name, "joining": True}, status_code=202)

    def remove(name: str) -> JSONResponse:
        if not cluster.remove(name):
            body = error_body(f"no instance {name!r} in the cluster", "not_found_error")
            return JSONResponse(body, status_code=404)
        return JSONResponse({"name": name, "removed": True})

    @app.get("/internal/instances")
    async def instances(request: Request):
        return refused(request) or {"instances": cluster.status(urls=True)}

    @app.post("/internal/instances")
    async def add_instance(request: Request):
        if (no := refused(request)) is not None:
            return no
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse(error_body('send {"url": ..., "role": ...}'), status_code=400)
        return add(body.get("url"), body.get("role"))

    @app.delete("/internal/instances/{name}")
    async def remove_instance(name: str, request: Request):
        return refused(request) or remove(name)

    @app.post("/add_worker", include_in_schema=False)  # SGLang router's
    async def add_worker(request: Request, url: str | None = None, role: str | None = None):
        return refused(request) or add(url, role)

    @app.post("/remove_worker", include_in_schema=False)
    async def remove_worker(request: Request, url: str = ""):
        name = url.removeprefix("http://").removeprefix("https://").rstrip("/")
        return refused(request) or remove(name)

    @app.get("/list_workers", include_in_schema=False)
    async def list_workers(request: Request):
        return refused(request) or {"urls": [r["url"] for r in cluster.status(urls=True)]}

    @app.get("/health")
    async def health():
        rows = conductor.cluster.status()
        # Healthy while a request can be served: some instance can prefill it and some can
        # decode it (a prefill instance alone cannot answer anyone).
        up = [i.role for i in conductor.cluster.instances.values() if i.healthy]
        ok = any(r.prefills for r in up) and any(r.decodes for r in up)
        return JSONResponse({"status": "ok" if ok else "degraded", "instances": rows},
                            status_code=200 if ok else 503)  # fmt: skip

    @app.get("/v1/models")
    async def models():
        cards = await model_cards()
        return {"object": "list", "data": cards, "has_more": False, "first_id": model_name,
                "last_id": cards[-1]["id"]}  # fmt: skip

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        card = next((c for c in await model_cards() if c["id"] == model_id), None)
        if card is not None:
            return card
        body = error_body(f"model {model_id!r} does not exist", "not_found_error", "model",
                          "model_not_found")  # fmt: skip
        return JSONResponse(body, status_code=404)

    async def model_cards() -> list[dict]:
        card = {**conductor.cluster.model_card, "id": model_name, "object": "model",
                "created": int(time.time()), "owned_by": "hetserve"}  # fmt: skip
        card.pop("root", None)  # an instance's path means nothing to the Conductor's clients
        if "display_name" in card:  # Anthropic's field, for the name the Conductor lists
            card["display_name"] = model_name
        cards = [card] + [{**a, "parent": model_name} for a in await adapters()]
        for c in cards[1:]:
            c.pop("root", None)
        return cards

    async def adapters() -> list[dict]:
        """The LoRA adapters the instances serve, as one of them lists them."""
        return [{k: v for k, v in c.items() if k != "lora_id"}
                for c in await conductor.adapters.refresh()]  # fmt: skip

    @app.post("/v1/load_lora_adapter", include_in_schema=False)
    @app.post("/v1/unload_lora_adapter", include_in_schema=False)
    async def lora(request: Request):
        """vLLM's runtime adapter routes, to every instance: a cluster serves an adapter
        wherever a request for it lands."""
        raw, path = await request.body(), request.url.path
        targets = [i for i in cluster.instances.values() if i.healthy]
        if not targets:
            return JSONResponse(error_body("no healthy instance", "service_unavailable"),
                                status_code=503)  # fmt: skip

        async def send(inst) -> tuple[str, int, bytes]:
            try:
                r = await cluster.http.post(inst.url + path, content=raw, timeout=300,
                                            headers={"content-type": "application/json"})
            except httpx.HTTPError as exc:
                return inst.name, 502, str(exc).encode()
            return inst.name, r.status_code, r.content

        answers = await asyncio.gather(*(send(i) for i in targets))
        conductor.adapters.record(path, raw, any(code < 300 for _, code, _ in answers))
        await conductor.adapters.refresh()  # their content ids, for hashing their requests
        failed = [(name, code, body) for name, code, body in answers if code >= 300]
        if not failed:
            return PlainTextResponse(f"{answers[0][2].decode(errors='replace')} (on "
                                     f"{len(answers)} instances)")  # fmt: skip
        name, code, body = failed[0]
        done = len(answers) - len(failed)
        try:
            detail = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            detail = body.decode(errors="replace")[:300]
        msg = f"{len(failed)} of {len(answers)} instances refused ({name}: {detail})"
        if done:
            msg += f"; {done} did it"
        return JSONResponse(error_body(msg, "invalid_request_error" if code < 500 else
                                       "server_error"), status_code=code)  # fmt: skip

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(render_metrics(conductor))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await conductor.route("/v1/completions", await request.body(), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await conductor.route("/v1/chat/completions", await request.body(), request)

    if "/v1/responses" in conductor.apis:  # where the entrypoint gave it
        responses = ResponsesRoutes(conductor)

        @app.post("/v1/responses")
        async def create_response(request: Request):
            return await responses.create(await request.body(), request)

        @app.post("/v1/responses/input_tokens", include_in_schema=False)
        async def count_response_tokens(request: Request):
            return await responses.count_tokens(await request.body(), request)

        @app.get("/v1/responses/{rid}", include_in_schema=False)
        async def get_response(rid: str, request: Request):
            return await responses.read("GET", rid, "", request)

        @app.get("/v1/responses/{rid}/input_items", include_in_schema=False)
        async def list_input_items(rid: str, request: Request):
            return await responses.read("GET", rid, "/input_items", request)

        @app.post("/v1/responses/{rid}/cancel", include_in_schema=False)
        async def cancel_response(rid: str, request: Request):
            return await responses.read("POST", rid, "/cancel", request)

        @app.delete("/v1/responses/{rid}", include_in_schema=False)
        async def delete_response(rid: str, request: Request):
            return await responses.read("DELETE", rid, "", request)

    if "/api/chat" in conductor.apis:  # Ollama's, where the entrypoint gave it
        ollama = conductor.apis["/api/chat"]

        @app.post("/api/chat", include_in_schema=False)
        @app.post("/api/generate", include_in_schema=False)
        async def ollama_generate(request: Request):
            return await conductor.route(request.url.path, await request.body(), request)

        @app.get("/api/version", include_in_schema=False)
        @app.get("/api/tags", include_in_schema=False)
        @app.get("/api/ps", include_in_schema=False)
        async def ollama_lists(request: Request):
            return await conductor.forward_any(request.url.path, method="GET", api=ollama)

        @app.post("/api/show", include_in_schema=False)
        @app.post("/api/embed", include_in_schema=False)
        @app.post("/api/embeddings", include_in_schema=False)
        async def ollama_other(request: Request):
            raw = await request.body()
            return await conductor.forward_any(request.url.path, raw, api=ollama)

    @app.post("/tokenize", include_in_schema=False)  # vLLM's: any instance tokenizes alike
    @app.post("/detokenize", include_in_schema=False)
    async def tokenize(request: Request):
        return await conductor.forward_any(request.url.path, await request.body())

    @app.post("/v1/messages", include_in_schema=False)  # where the entrypoint gave it
    async def messages(request: Request):
        if "/v1/messages" not in conductor.apis:
            body = error_body("this Conductor serves no /v1/messages", "not_found_error")
            return JSONResponse(body, status_code=404)
        return await conductor.route("/v1/messages", await request.body(), request)

    @app.post("/v1/messages/count_tokens", include_in_schema=False)
    async def count_tokens(request: Request):
        if "/v1/messages" not in conductor.apis:
            body = error_body("this Conductor serves no /v1/messages", "not_found_error")
            return JSONResponse(body, status_code=404)
        return await conductor.forward_any("/v1/messages/count_tokens", await request.body())

    return app


def _instance_url(url: object) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise InvalidInputError(f"url: want http://HOST:PORT of an instance, got {url!r}")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.path.strip("/") or parts.query:
        raise InvalidInputError(f"url: want http://HOST:PORT of an instance, got {url!r}")
    return url.rstrip("/")


def _role(role: object) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise InvalidInputError(f"role: one of prefill, decode, both; got {role!r}") from None


def render_metrics(c: Conductor) -> str:
    lines = ["# TYPE hetserve_conductor_requests_total counter"]
    for what, n in sorted(c.counts.items()):
        lines.append(f'hetserve_conductor_requests_total{{outcome="{what}"}} {n}')
    if c.ttft:
        err = sum(abs(m - p) / m for p, m in c.ttft if m > 0) / len(c.ttft)
        lines += [
            "# TYPE hetserve_conductor_ttft_prediction_error gauge",
            f"hetserve_conductor_ttft_prediction_error {err:.6f}",
        ]
    if c.routing:
        done = sorted(c.routing)
        lines.append("# TYPE hetserve_conductor_routing_seconds summary")
        for q in (0.5, 0.99):
            v = done[min(len(done) - 1, int(q * len(done)))]
            lines.append(f'hetserve_conductor_routing_seconds{{quantile="{q}"}} {v:.6f}')
        lines.append(f"hetserve_conductor_routing_seconds_count {len(done)}")
    if c.index_blocks is not None:
        lines.append("# TYPE hetserve_conductor_index_blocks gauge")
        for name, media in sorted(c.index_blocks().items()):
            for medium, n in sorted(media.items()):
                lines.append(f'hetserve_conductor_index_blocks{{instance="{name}",'
                             f'medium="{medium}"}} {n}')  # fmt: skip
    for row in c.cluster.status():
        lines.append(f'hetserve_conductor_instance_up{{instance="{row["name"]}",'
                     f'role="{row["role"]}"}} {int(row["healthy"])}')  # fmt: skip
    return "\n".join(lines) + "\n"
