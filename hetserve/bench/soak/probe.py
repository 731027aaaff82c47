"""The server side of a soak: KV blocks, requests and memory read from its Prometheus /metrics.

Only what the server exports is reported; a missing metric is None ("n/a"), never zero.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import aiohttp

from hetserve.bench.server_info import (
    KV_BLOCKS_USED,
    KV_USAGE_FRACTION,
    RSS_BYTES,
    RUNNING,
    WAITING,
    first_of,
    metrics_url,
    parse_prometheus,
)


@dataclass
class ServerState:
    kv_blocks_used: float | None = None
    kv_usage: float | None = None  # fraction of the KV cache in use (vLLM's gauge)
    running: float | None = None
    waiting: float | None = None
    rss_bytes: float | None = None

    @classmethod
    def from_metrics(cls, values: dict[str, float] | None) -> ServerState:
        return cls(
            kv_blocks_used=first_of(values, KV_BLOCKS_USED),
            kv_usage=first_of(values, KV_USAGE_FRACTION),
            running=first_of(values, RUNNING),
            waiting=first_of(values, WAITING),
            rss_bytes=first_of(values, RSS_BYTES),
        )

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self)

    def idle_against(self, baseline: ServerState) -> bool | None:
        """No request running or waiting and no more KV blocks held than at the start.

        None when the server exports none of these: idleness cannot be seen from outside.
        """
        checks = [v == 0 for v in (self.running, self.waiting) if v is not None]
        if self.kv_blocks_used is not None and baseline.kv_blocks_used is not None:
            checks.append(self.kv_blocks_used <= baseline.kv_blocks_used)
        return all(checks) if checks else None


class MetricsProbe:
    """Reads /metrics with the soak's own HTTP session (never blocking the event loop)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]):
        self.url = metrics_url(base_url)
        self.session, self.headers = session, headers

    async def read(self) -> ServerState:
        try:
            timeout = aiohttp.ClientTimeout(total=5.0)
            async with self.session.get(self.url, headers=self.headers, timeout=timeout) as resp:
                if resp.status != 200:
                    return ServerState()
                values = parse_prometheus(await resp.text())
        except (aiohttp.ClientError, TimeoutError):
            return ServerState()  # a busy or unreachable /metrics is "n/a" for this sample
        return ServerState.from_metrics(values)

    async def wait_idle(
        self, baseline: ServerState, timeout_s: float, interval_s: float = 0.25
    ) -> tuple[bool | None, float, ServerState]:
        """Poll until the server is idle against `baseline`; (idle, seconds waited, last state)."""
        start = time.monotonic()
        while True:
            state = await self.read()
            idle = state.idle_against(baseline)
            waited = time.monotonic() - start
            if idle is None or idle or waited >= timeout_s:
                return idle, waited, state
            await asyncio.sleep(interval_s)
