"""A simulated prefill instance: one request at a time, first come first served, as Mooncake's
prefill nodes take them (each request's prompt chunked and pipelined inside the node).

A request's service is loading its cached prefix (its own DRAM at the host-to-device rate, the
rest pulled from the pool at the network rate), then computing the new tokens given the
cached context: the instance's `PrefillFit`, the same model the Conductor predicts with; its
TTFT adds the profile's delivery fit, which occupies no instance. What the simulator adds to
the prediction is the real queue (the policy sees only its linear part) and where the prefix
truly lies.

Who calls it: the event loop (`loop.py`), which owns the clock.
"""

from __future__ import annotations

from collections import deque

from hetserve.config import Role
from hetserve.disagg.policy import POOL, InstanceState
from hetserve.sim.hardware import Hardware
from hetserve.sim.jobs import Job


class PrefillInstance:
    def __init__(self, name: str, hw: Hardware, block_size: int) -> None:
        self.name, self.hw, self.block_size = name, hw, block_size
        self.queue: deque[Job] = deque()
        self.queued_tokens = 0  # new tokens of the queued (not yet running) requests
        self.running: Job | None = None
        self.busy_s = 0.0
        self._idle_state: InstanceState | None = None  # valid while idle with the same cache

    def enqueue(self, job: Job, now: float) -> float | None:
        """Queue `job`; the time it will finish if it starts now (None: it waits)."""
        if self.running is None:
            return self._start(job, now)
        self.queue.append(job)
        self.queued_tokens += job.new_tokens
        return None

    def finish(self, now: float) -> tuple[Job, float | None]:
        """The running request is done: it, and the finish time of the next (None: idle)."""
        job = self.running
        assert job is not None and job.prefill_start is not None
        job.prefill_end = now
        self.busy_s += now - job.prefill_start
        self.running = None
        if not self.queue:
            return job, None
        nxt = self.queue.popleft()
        self.queued_tokens -= nxt.new_tokens
        return job, self._start(nxt, now)

    def _start(self, job: Job, now: float) -> float:
        prof, bs = self.hw.profile, self.block_size
        load = prof.load_seconds("dram", job.local_blocks * bs) or 0.0
        if job.pool_blocks:
            load += prof.load_seconds(POOL, job.pool_blocks * bs) or 0.0
        job.load_s = load
        job.compute_s = prof.prefill.seconds(job.new_tokens, job.cached_tokens)
        job.delivery_s = prof.delivery_seconds(job.input_length)
        job.prefill_start = now
        self.running = job
        return now + load + job.compute_s

    def state(self, now: float, cache_free_blocks: int, cache_blocks: int) -> InstanceState:
        """What the Conductor hears from this instance: the queued new tokens, the running
        request's counted by the share of its service still ahead."""
        job = self.running
        if job is None:
            cached = self._idle_state
            if cached is None or cached.free_blocks != cache_free_blocks:
                cached = self._idle_state = self._state(0, 0, cache_free_blocks, cache_blocks)
            return cached
        tokens, requests = self.queued_tokens, len(self.queue)
        if job.prefill_start is not None:
            total = job.load_s + job.compute_s
            left = job.prefill_start + total - now
            share = left / total if total > 0 else 0.0
            tokens += round(job.new_tokens * min(max(share, 0.0), 1.0))
            requests += 1
        return self._state(tokens, requests, cache_free_blocks, cache_blocks)

    def _state(self, tokens: int, requests: int, free: int, blocks: int) -> InstanceState:
        return InstanceState(
            self.name,
            Role.PREFILL,
            self.hw.profile,
            queued_prefill_tokens=tokens,
            queued_requests=requests,
            free_blocks=free,
            total_blocks=blocks,
        )
