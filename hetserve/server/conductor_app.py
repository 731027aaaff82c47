"""The Conductor's HTTP face: the FastAPI app `hetserve conductor` serves (`/v1/completions`
and `/v1/chat/completions` handed to `disagg.conductor.Conductor.route`, `/v1/models`,
`/health`, `/metrics`), behind the same guard as an instance (bearer key on /v1, body limit).

Who calls it: `entrypoints/conductor.py`. Failure contract: as the Conductor's (routes never
raise for a client's input); `/health` answers 503 while no healthy instance can prefill or
none can decode.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from hetserve.disagg.conductor import Conductor
from hetserve.server.app import Guard
from hetserve.server.errors import error_body


def create_conductor_app(conductor: Conductor, model_name: str) -> FastAPI:
    app = FastAPI(title="hetserve conductor", docs_url=None, redoc_url=None)
    app.add_middleware(Guard, api_key=conductor.config.api_key, max_body_bytes=8 << 20)
    app.state.conductor = conductor

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
        card = {**conductor.cluster.model_card, "id": model_name, "object": "model",
                "created": int(time.time()), "owned_by": "hetserve"}  # fmt: skip
        card.pop("root", None)  # an instance's path means nothing to the Conductor's clients
        if "display_name" in card:  # Anthropic's field, for the name the Conductor lists
            card["display_name"] = model_name
        return {"object": "list", "data": [card], "has_more": False, "first_id": model_name,
                "last_id": model_name}  # fmt: skip

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(render_metrics(conductor))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await conductor.route("/v1/completions", await request.body(), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await conductor.route("/v1/chat/completions", await request.body(), request)

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
