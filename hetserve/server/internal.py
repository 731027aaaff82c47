"""Routes a cluster's Conductor reads from an instance (`/internal/*`, behind the same API key
as `/v1/*`): its facts and its load. Not for applications.

- `GET /internal/info`: role, hand-off address, KV block size and hash seed (the root of every
  block hash, so the Conductor hashes prompts as this engine does), context length, and the
  instance's cost profile: the one given with `--profile`, else measured once, quickly, on the
  engine thread at the first ask (`disagg/profiler.py`), then kept.
- `GET /internal/load`: queued prefill tokens and requests, running decodes and their context,
  free and total KV blocks, as of the engine's last step.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import FastAPI

from hetserve.engine.async_llm import AsyncLLM


def install_internal_routes(app: FastAPI, engine: AsyncLLM, profile: dict[str, Any] | None) -> None:
    lock = asyncio.Lock()
    known: dict[str, Any] = {"profile": profile}

    async def measured_profile() -> dict[str, Any]:
        async with lock:  # one measurement, however many ask at once
            if known["profile"] is None:
                known["profile"] = await engine.call(_quick_profile)
        return known["profile"]  # type: ignore[no-any-return]

    @app.get("/internal/info")
    async def info():
        core = engine.engine
        return {
            "role": core.config.disagg.role.value,
            "handoff_address": engine.handoff_address,
            "block_size": core.kv.block_size,
            "hash_seed": core.kv.hash_seed.hex(),
            "max_model_len": engine.max_model_len,
            "profile": await measured_profile(),
        }

    @app.get("/internal/load")
    async def load():
        return dataclasses.asdict(engine.stats().load)


def _quick_profile(core: Any) -> dict[str, Any]:
    from hetserve.disagg.costs import profile_to_dict
    from hetserve.disagg.profiler import Plan, capacity, measure
    from hetserve.errors import HetserveError

    if core.has_unfinished():  # the profiler steps the engine: it would eat their outputs
        raise HetserveError(
            "this instance is serving and has no profile yet; start it with --profile FILE "
            "(from `hetserve profile`)"
        )
    profile, _ = measure(core, Plan.quick())
    return profile_to_dict(profile, capacity=capacity(core, profile))
