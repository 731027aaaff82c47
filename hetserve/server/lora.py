"""Runtime LoRA adapter loading, as vLLM names it: POST /v1/load_lora_adapter and
POST /v1/unload_lora_adapter.

Off unless the server starts with `--enable-lora-runtime-updates`: loading makes the server read
a directory of its own file system that a client names, which is a decision for whoever runs it
(only trusted clients; the bearer token guards /v1/* as everywhere). While off, both answer 404
naming the flag, as vLLM's routes do not exist then. Success is vLLM's plain-text line; every
mistake is an OpenAI error body: 400 (bad body, bad adapter directory, name taken), 404 (off, or
unloading a name that is not loaded).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from hetserve.engine.async_llm import AsyncLLM
from hetserve.server.errors import error_response

FLAG = "--enable-lora-runtime-updates"


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body for POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="allow")  # vLLM clients may send load_inplace and the like

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body for POST /v1/unload_lora_adapter (its lora_int_id is accepted, unused)."""

    model_config = ConfigDict(extra="allow")

    lora_name: str = Field(min_length=1, max_length=256)

Body = TypeVar("Body", bound=BaseModel)
Handler = Callable[[Body], Awaitable[Response]]


def install_lora_routes(app: FastAPI, engine: AsyncLLM, model_name: str, enabled: bool) -> None:
    def route(path: str, body: type[Body]) -> Callable[[Handler[Body]], Handler[Body]]:
        """POST `path` runs the handler on the parsed body, or answers 404 while updates are
        off (before reading the body, as when vLLM has no such route)."""

        def install(handler: Handler[Body]) -> Handler[Body]:
            async def endpoint(request: Request) -> Response:
                if not enabled:
                    return error_response(
                        404,
                        f"runtime LoRA adapter loading is off; start the server with {FLAG} "
                        "to allow it",
                        "not_found_error",
                        code="lora_runtime_updates_disabled",
                    )
                return await handler(body.model_validate_json(await request.body()))

            # The handler's name keeps the OpenAPI operation ids and summaries.
            app.add_api_route(path, endpoint, methods=["POST"], name=handler.__name__)
            return handler

        return install

    @route("/v1/load_lora_adapter", LoadLoRAAdapterRequest)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        name = req.lora_name
        if name == model_name:
            return error_response(
                400,
                f"{name!r} is the base model's name; give the adapter another",
                param="lora_name",
            )
        if name in engine.lora_adapters():
            return error_response(
                400, f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        # Reading and checking the files takes a while: off the event loop.
        await asyncio.to_thread(engine.load_lora, name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @route("/v1/unload_lora_adapter", UnloadLoRAAdapterRequest)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        name = req.lora_name
        if name not in engine.lora_adapters():
            return error_response(
                404,
                f"The lora adapter '{name}' cannot be found.",
                "not_found_error",
                param="lora_name",
                code="lora_not_found",
            )
        engine.unload_lora(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
