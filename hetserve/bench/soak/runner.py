"""The soak loop: `concurrency` clients, each sending one case after another until the deadline,
while a sampler reads the server's /metrics; then a wait for the server to go idle."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from tqdm import tqdm

from hetserve.bench.server_info import api_url, auth_headers
from hetserve.bench.soak.cases import Case, Context
from hetserve.bench.soak.client import (
    BAD_MISHANDLED,
    BAD_REJECTED,
    COMPLETED,
    FAILED,
    judge,
    perform,
)
from hetserve.bench.soak.probe import MetricsProbe, ServerState


@dataclass(frozen=True)
class SoakConfig:
    base_url: str
    concurrency: int
    duration_s: float
    cases: tuple[Case, ...]
    api_key: str | None = None
    request_timeout_s: float = 60.0
    idle_timeout_s: float = 60.0
    sample_interval_s: float = 1.0
    seed: int = 0
    progress: bool = True


@dataclass
class Outcome:
    case: str
    group: str
    bucket: str
    why: str
    start_s: float  # seconds since the soak started
    end_s: float


@dataclass
class Sample:
    t_s: float
    in_flight: int  # requests this soak has open
    server: ServerState


@dataclass
class SoakRun:
    outcomes: list[Outcome] = field(default_factory=list)
    timeline: list[Sample] = field(default_factory=list)
    before: ServerState = field(default_factory=ServerState)
    after: ServerState = field(default_factory=ServerState)
    load_s: float = 0.0  # first request to last answer
    idle: bool | None = None  # the server went idle after the load (None: cannot tell)
    idle_wait_s: float = 0.0


class _Deck:
    """One of every case first (so even a short soak sends each), then shuffled decks of
    `weight` copies each."""

    def __init__(self, cases: tuple[Case, ...], rng: np.random.Generator) -> None:
        self.cases, self.rng = cases, rng
        self.deck: list[Case] = list(cases)
        rng.shuffle(self.deck)
        self.first_round_left = len(self.deck)
        self.size = sum(c.weight for c in cases)

    def draw(self, busy: Counter[str]) -> Case | None:
        """The next case whose in-flight cap allows another; None when none does now."""
        for _ in range(2 * max(self.size, len(self.deck))):
            if not self.deck:
                self.deck = [c for c in self.cases for _ in range(c.weight)]
                self.rng.shuffle(self.deck)
            case = self.deck.pop()
            if case.max_in_flight is None or busy[case.name] < case.max_in_flight:
                self.first_round_left = max(0, self.first_round_left - 1)
                return case
            self.deck.insert(0, case)  # capped now: later in this deck, not dropped
        return None


class _Soak:
    def __init__(self, cfg: SoakConfig, ctx: Context, session: aiohttp.ClientSession) -> None:
        self.cfg, self.ctx, self.session = cfg, ctx, session
        self.headers = {**auth_headers(cfg.api_key), "Content-Type": "application/json"}
        self.rng = np.random.default_rng(cfg.seed)
        self.deck = _Deck(cfg.cases, self.rng)
        self.busy: Counter[str] = Counter()
        self.run = SoakRun()
        self.counts: Counter[str] = Counter()
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def client(self, deadline: float) -> None:
        while self.now() < deadline or self.deck.first_round_left:
            case = self.deck.draw(self.busy)
            if case is None:
                await asyncio.sleep(0.05)
                continue
            attempt = case.make(self.ctx, self.rng)
            self.busy[case.name] += 1
            start = self.now()
            try:
                url = api_url(self.cfg.base_url, attempt.endpoint)
                ans = await perform(
                    self.session, url, self.headers, attempt, self.cfg.request_timeout_s
                )
            finally:
                self.busy[case.name] -= 1
            bucket, why = judge(case.group, attempt, ans)
            self.counts[bucket] += 1
            self.run.outcomes.append(Outcome(case.name, case.group, bucket, why, start, self.now()))

    async def sampler(self, probe: MetricsProbe, bar: tqdm) -> None:
        while True:
            state = await probe.read()
            t = self.now()
            self.run.timeline.append(Sample(t, sum(self.busy.values()), state))
            bar.n = min(bar.total, int(t))
            bar.set_postfix(
                ok=self.counts[COMPLETED],
                failed=self.counts[FAILED],
                bad_4xx=self.counts[BAD_REJECTED],
                bad_other=self.counts[BAD_MISHANDLED],
                open=sum(self.busy.values()),
                kv=_fmt(state.kv_blocks_used),
                refresh=True,
            )
            await asyncio.sleep(self.cfg.sample_interval_s)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


async def run_soak(cfg: SoakConfig, ctx: Context) -> SoakRun:
    """Load for `duration_s`, let open requests finish, then wait for the server to go idle."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        soak = _Soak(cfg, ctx, session)
        probe = MetricsProbe(session, cfg.base_url, auth_headers(cfg.api_key))
        soak.run.before = await probe.read()
        soak.t0 = time.monotonic()
        with tqdm(
            total=max(1, round(cfg.duration_s)),
            disable=not cfg.progress,
            desc="soak",
            bar_format="{desc}: {bar:20} {n_fmt}/{total_fmt} s{postfix}",  # seconds, no rate
        ) as bar:
            sampler = asyncio.create_task(soak.sampler(probe, bar))
            try:
                await asyncio.gather(*(soak.client(cfg.duration_s) for _ in range(cfg.concurrency)))
                soak.run.load_s = soak.now()
                idle, waited, after = await probe.wait_idle(soak.run.before, cfg.idle_timeout_s)
            finally:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
        soak.run.idle, soak.run.idle_wait_s, soak.run.after = idle, waited, after
        soak.run.timeline.append(Sample(soak.now(), 0, after))
        return soak.run
