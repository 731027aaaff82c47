"""`hetserve profile`: measure what an instance's work costs, for the Conductor and the simulator.

Who calls it: `hetserve profile --out profile.json` (entrypoints/profile.py), and an instance at
start-up when it is given no profile (a quick measurement, `quick=True`). It runs the engine
it is handed on synthetic prompts, times prefills of `new` tokens after `cached` tokens already
in the prefix cache and decode steps of `batch` sequences holding `context` tokens, fits
`costs.PrefillFit` / `costs.DecodeFit` to them with the error on held-out samples, and reads the
KV tiers' probed read costs. The result is `costs.InstanceProfile` (JSON: `costs.save_profile`).

Failure contract: a model whose context is too short to measure anything is an
`InvalidInputError` naming the minimum; nothing else here depends on user input.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hetserve.core.request import NewRequest
from hetserve.core.sampling import SamplingParams
from hetserve.disagg.costs import (
    DecodeSample,
    InstanceProfile,
    PrefillSample,
    fit_decode,
    fit_prefill,
    held_out,
)
from hetserve.disagg.policy import LOCAL_TIERS, POOL
from hetserve.errors import InvalidInputError
from hetserve.kv.tier_policy import TierCost

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@dataclass
class Plan:
    """Which points to measure (token counts are capped by the context)."""

    new: tuple[int, ...] = (32, 128, 512, 1024, 2048)
    cached: tuple[int, ...] = (0, 512, 2048)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    contexts: tuple[int, ...] = (128, 1024)
    decode_steps: int = 8
    repeats: int = 2

    @classmethod
    def quick(cls) -> Plan:
        return cls((32, 128, 512), (0, 256), (1, 2, 4), (64, 256), 4, 1)


@dataclass
class Measured:
    prefill: list[PrefillSample] = field(default_factory=list)
    decode: list[DecodeSample] = field(default_factory=list)


class Profiler:
    def __init__(self, engine: Any, seed: int = 0) -> None:
        self.engine = engine  # an EngineCore, stepped here on this thread only
        self._rng = random.Random(seed)
        self._ids = 0
        vocab = engine.vocab_size
        self._tokens = (10, max(11, min(vocab, 400)))  # low ids: real tokens in tiny vocabs

    def _prompt(self, n: int) -> list[int]:
        lo, hi = self._tokens
        return [self._rng.randrange(lo, hi) for _ in range(n)]

    def _rid(self) -> str:
        self._ids += 1
        return f"profile-{self._ids}"

    def _run(self, prompts: list[list[int]], params: SamplingParams) -> None:
        for p in prompts:
            self.engine.submit(NewRequest(self._rid(), p, params), stream=False)
        while self.engine.has_unfinished():
            self.engine.step()

    def prefill(self, new: int, cached: int) -> float:
        """Seconds to prefill `new` tokens after `cached` cached ones (the prefix computed
        first, then the prompt that extends it, timed from submit to its first token)."""
        prefix = self._prompt(cached)
        if cached:
            self._run([prefix + self._prompt(1)], ONE_TOKEN)  # caches the prefix's blocks
        prompt = prefix + self._prompt(new)
        t0 = time.perf_counter()
        self._run([prompt], ONE_TOKEN)
        return time.perf_counter() - t0

    def decode(self, batch: int, context: int, steps: int) -> tuple[int, float] | None:
        """(sequences, median seconds) of the decode-only steps of `batch` sequences of
        `context` tokens each, at the largest batch such a step held; None if none ran."""
        params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        for _ in range(batch):
            self.engine.submit(NewRequest(self._rid(), self._prompt(context), params), False)
        seen: list[tuple[int, float]] = []
        before = self.engine.stats().prompt_tokens_computed
        while self.engine.has_unfinished():
            t0 = time.perf_counter()
            self.engine.step()
            dt = time.perf_counter() - t0
            now = self.engine.stats()
            if now.prompt_tokens_computed == before and now.num_running:
                seen.append((now.num_running, dt))  # a step of decodes only
            before = now.prompt_tokens_computed
        if not seen:
            return None
        top = max(n for n, _ in seen)
        times = sorted(dt for n, dt in seen if n == top)
        return top, times[len(times) // 2]


def measure(
    engine: Any, plan: Plan, progress: Callable[[str], None] | None = None
) -> tuple[InstanceProfile, Measured]:
    """Profile `engine` (an `EngineCore`) along `plan`."""
    limit = engine.max_model_len - 2
    bs = engine.kv.block_size
    if limit < 64:
        raise InvalidInputError(f"profiling needs a context of at least 66 tokens, got {limit + 2}")
    prof = Profiler(engine)
    out = Measured()
    prof.prefill(32, 0)  # one-off costs (allocations, kernel builds) out of the samples
    for new, cached in _prefill_points(plan, limit, bs):
        for _ in range(plan.repeats):
            out.prefill.append((new, cached, prof.prefill(new, cached)))
        if progress:
            progress(f"prefill {new} new after {cached} cached")
    for batch, ctx in _decode_points(plan, limit, engine.config.scheduler.max_num_seqs):
        got = prof.decode(batch, ctx, plan.decode_steps)
        if got is not None:
            n, seconds = got
            out.decode.append((n, n * (ctx + plan.decode_steps // 2), seconds))
        if progress:
            progress(f"decode batch {batch} at {ctx} tokens")
    pre, pre_err = held_out(out.prefill, fit_prefill)
    dec, dec_err = held_out(out.decode, fit_decode)
    tiers = policy_tiers(engine.tiers) if engine.tiers is not None else {}
    kv_per_token = _kv_bytes_per_block(engine) // bs
    state = engine.runner.state  # linear-attention layers' per-sequence state (None: none)
    profile = InstanceProfile(
        engine.model_dir.name, pre, dec, kv_per_token, tiers, pre_err, dec_err,
        state_bytes_per_request=0 if state is None else state.nbytes() // state.num_slots,
    )  # fmt: skip
    return profile, out


def capacity(engine: Any, profile: InstanceProfile) -> dict[str, int]:
    """KV capacity in tokens (the profile's optional `capacity` section, which the simulator
    sizes its caches by): the device pool, and host tiers that are this instance's own."""
    out = {"device_kv_tokens": engine.kv.pool.num_usable * engine.kv.block_size}
    if engine.tiers is not None and profile.kv_bytes_per_token:
        own = [t.capacity for t in engine.tiers.store.tiers() if not t.shared and t.capacity]
        if own:
            out["host_kv_tokens"] = sum(own) // profile.kv_bytes_per_token
    return out


def _prefill_points(plan: Plan, limit: int, bs: int) -> list[tuple[int, int]]:
    """The plan's (new, cached) points that fit the context; on a short context, points at
    fractions of it instead (a fit needs at least 3, with two cached sizes for its c2)."""
    points = [(n, c // bs * bs) for n in plan.new for c in plan.cached if n + c <= limit]
    if len(points) < 4:
        quarter = max(bs, limit // 4 // bs * bs)
        points = [(n, c) for n in (limit // 8, limit // 4, limit // 2) for c in (0, quarter)]
    return points


def _decode_points(plan: Plan, limit: int, seqs: int) -> list[tuple[int, int]]:
    room = limit - plan.decode_steps - 1
    points = [(b, c) for b in plan.batches for c in plan.contexts if b <= seqs and c <= room]
    if len(points) < 4:
        batches = sorted({b for b in (1, 2, 4) if b <= seqs})
        points = [(b, c) for b in batches for c in (room // 4, room // 2)]
    return points


def policy_tiers(tiers: Any) -> dict[str, TierCost]:
    """The KV tiers' probed read costs under the policy's tier names: the local store's "dram"
    and "ssd" as they are, any shared store ("pool", "pool-shm", "mooncake", "redis") as
    "pool", at the cheapest of its rows (a block is read from the nearest replica)."""
    shared = {t.name for t in tiers.store.tiers() if t.shared}
    out: dict[str, TierCost] = {}
    for name, cost in tiers.cost.tiers.items():
        key = POOL if name in shared else name
        if key not in LOCAL_TIERS and key != POOL:
            continue  # the victim cache ("staged") is the engine's own business
        old = out.get(key)
        if old is None or cost.load_time(1 << 20) < old.load_time(1 << 20):
            out[key] = cost
    return out


def _kv_bytes_per_block(engine: Any) -> int:
    from hetserve.kv.paged import PagedKVCache

    # The KV dtype, not the model's (layer 0 of a linear-attention model has no KV tensors).
    dtype = engine.runner.kv.dtype
    return PagedKVCache.bytes_per_block(engine.model.kv_cache_spec(), engine.kv.block_size, dtype)
