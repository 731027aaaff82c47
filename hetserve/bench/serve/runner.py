"""The asyncio load generator: arrival schedule, concurrency cap, conversations, progress bar."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import numpy as np
from tqdm import tqdm

from hetserve.bench.serve.client import Clock, RequestResult, build_payload, send_request
from hetserve.bench.serve.workload import BenchRequest, Workload
from hetserve.bench.server_info import api_url


@dataclass(frozen=True)
class RunConfig:
    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    request_rate: float | None = None  # None: the trace's recorded times, else send all at once
    seed: int = 0
    max_concurrency: int | None = None
    time_scale: float = 1.0
    ignore_eos: bool | None = None  # None: the workload's default
    request_timeout_s: float = 6 * 3600.0
    progress: bool = True
    session_ids: bool = False  # each conversation sends its own session_id (agentic traffic)
    continuous_usage: bool = False  # ask for usage in every chunk (tokens per chunk; `--burst`)

    @property
    def url(self) -> str:
        return api_url(self.base_url, self.endpoint)


def arrival_offsets(
    workload: Workload, rate: float | None, seed: int, time_scale: float
) -> tuple[list[float], str]:
    """Seconds after the start at which each conversation begins, and how they were made."""
    n = len(workload.conversations)
    recorded = [c[0].arrival_s for c in workload.conversations]
    if rate is None and n and all(t is not None for t in recorded):
        first = recorded[0]
        return [(t - first) * time_scale for t in recorded], f"trace timestamps x{time_scale:g}"
    if rate is None or math.isinf(rate):
        return [0.0] * n, "all at once (rate inf)"
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    # The first request goes at once; the gap after each one is exponential (Poisson arrivals).
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist(), f"Poisson {rate:g} req/s"


class _Runner:
    """One benchmark run: a shared HTTP session, the concurrency cap and the collected results."""

    def __init__(
        self,
        workload: Workload,
        cfg: RunConfig,
        session: aiohttp.ClientSession,
        bar: tqdm,
        clock: Clock,
    ) -> None:
        self.workload, self.cfg, self.session, self.bar, self.clock = (
            workload,
            cfg,
            session,
            bar,
            clock,
        )
        self.ignore_eos = workload.ignore_eos if cfg.ignore_eos is None else cfg.ignore_eos
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self.results: list[RequestResult] = []

    async def send(
        self, req: BenchRequest, history: list[dict[str, str]] | None, session: str | None = None
    ) -> RequestResult:
        if self.limit is None:
            return await self._send(req, history, session)
        async with self.limit:
            return await self._send(req, history, session)

    async def _send(
        self, req: BenchRequest, history: list[dict[str, str]] | None, session: str | None
    ) -> RequestResult:
        # Built only once a slot is free: a long trace prompt is megabytes as a list of ints.
        cfg = self.cfg
        payload = build_payload(
            cfg.endpoint, cfg.model, req, history, self.workload, self.ignore_eos
        )
        if session is not None:
            payload["session_id"] = session
        if cfg.continuous_usage:
            payload["stream_options"]["continuous_usage_stats"] = True
        result = await send_request(
            self.session, cfg.url, self.headers, payload, req.prompt_len, self.clock
        )
        result.role = req.role
        return result

    async def conversation(self, turns: list[BenchRequest], index: int = 0) -> None:
        """Turns one after the other, each resending the history with the server's replies."""
        history: list[dict[str, str]] | None = [] if len(turns) > 1 else None
        session = f"conv-{index}" if self.cfg.session_ids and history is not None else None
        for i, req in enumerate(turns):
            result = await self.send(req, history, session)
            self.results.append(result)
            self.bar.update(1)
            if not result.ok:  # later turns need this reply; count them as not sent
                self.bar.update(len(turns) - i - 1)
                return
            if history is not None:
                history += [
                    {"role": "user", "content": req.text or ""},
                    {"role": "assistant", "content": result.text},
                ]


async def run_benchmark(
    workload: Workload,
    cfg: RunConfig,
    clock: Clock = time.perf_counter,
    extra: Sequence[tuple[float, BenchRequest]] = (),
) -> tuple[list[RequestResult], float, float]:
    """Send the workload, and `extra` requests each at its offset in seconds (`--burst`);
    returns every result and the start and end times on `clock`."""
    offsets, _ = arrival_offsets(workload, cfg.request_rate, cfg.seed, cfg.time_scale)
    # One schedule in time order (sorted is stable: the workload's order among equal times);
    # each conversation keeps its index (its session id).
    convs = [*workload.conversations, *([r] for _, r in extra)]
    times = [*offsets, *(t for t, _ in extra)]
    plan = sorted(zip(times, range(len(convs)), convs, strict=True), key=lambda item: item[0])
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    total = workload.num_requests + len(extra)
    with tqdm(total=total, disable=not cfg.progress, unit="req") as bar:
        async with aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
        ) as session:
            runner = _Runner(workload, cfg, session, bar, clock)
            start = clock()
            tasks = []
            for offset, index, turns in plan:
                delay = start + offset - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(runner.conversation(turns, index)))
            await asyncio.gather(*tasks)
            end = clock()
    return runner.results, start, end
