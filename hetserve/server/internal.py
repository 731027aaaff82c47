"""Routes a cluster's Conductor reads from an instance (`/internal/*`, behind the same API key
as `/v1/*`): its facts and its load. Not for applications.

- `GET /internal/info`: role, hand-off address, KV block size and hash seed (the root of every
  block hash, so the Conductor hashes prompts as this engine does), context length, and the
  instance's cost profile: the one given with `--profile`, else measured once, quickly, on the
  engine thread at the first ask (`disagg/profiler.py`), then kept.
- `GET /internal/load`: queued prefill tokens and requests, running decodes and their context,
  free and total KV blocks, as of the engine's last step.
- `GET /internal/kv_info`: how the instance names and publishes its KV: block size, hash seed,
  the store's tiers, and where its KV events are (`kv_events`: PUB and replay addresses, topic,
  whether CURVE secures them; null while they are off).
- `GET /internal/kv_snapshot`: every block it holds per medium (hex digests) and the KV event
  batch this is current as of (`seq`, -1 before the first; `ts`, that batch's time stamp), for a
  subscriber that lost more than the replay buffer holds. 404 while KV events are off.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from hetserve.engine.async_llm import AsyncLLM
from hetserve.server.errors import error_body


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
            "kv_cache_dtype": core.kv_info()["kv_cache_dtype"],
            "handoff_paths": list(core.handoff.paths),
            "max_model_len": engine.max_model_len,
            "profile": await measured_profile(),
        }

    @app.get("/internal/load")
    async def load():
        return dataclasses.asdict(engine.stats().load)

    @app.get("/internal/kv_info")
    async def kv_info():
        return engine.kv_info()

    @app.get("/internal/kv_snapshot")
    async def kv_snapshot():
        snap = engine.kv_snapshot()
        if snap is None:
            msg = "KV events are off; start the server with --kv-events tcp://HOST:PORT"
            return JSONResponse(error_body(msg, "not_found_error"), status_code=404)
        seq, ts, media = snap
        blocks = await asyncio.to_thread(_hex, media)  # up to a pool's worth: off the loop
        return {"seq": seq, "ts": ts, "blocks": blocks}


def _hex(media: dict[str, list[bytes]]) -> dict[str, list[str]]:
    return {m: [h.hex() for h in hs] for m, hs in media.items()}


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
