"""A simulated decode instance: continuous batching, stepped analytically.

A decode step of a batch of B requests holding C context tokens lasts the instance's
`DecodeFit.seconds(B, C)`; every step adds one token per request, so between two changes of
the batch (a request joins or leaves) step j lasts a + j * s with a = seconds(B, C) and
s = d2 * B, and k steps last k a + s k (k - 1) / 2. The instance is therefore advanced from one
change to the next in one event instead of one event per step: the segments between changes
are kept, and a request's token intervals are read from the segments it lived through.

A request whose KV has arrived joins at the next step boundary, if its whole context (prompt
and every output token) fits the KV room left (`Hardware.device_kv_tokens`); otherwise it
waits, first come first served, for requests to leave: capacity is never exceeded and nothing
is preempted. With a TBT SLO, an instance refuses a request whose joining would make its step
longer than the SLO (the paper's baseline: rejected after its prefill).

Who calls it: the event loop (`loop.py`), with the times it scheduled.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from hetserve.config import Role
from hetserve.disagg.policy import InstanceState
from hetserve.sim.hardware import Hardware
from hetserve.sim.jobs import Job


class DecodeInstance:
    def __init__(self, name: str, hw: Hardware, block_size: int) -> None:
        self.name, self.hw, self.block_size = name, hw, block_size
        self.fit = hw.profile.decode
        self.capacity = hw.device_kv_tokens
        self.steps = 0  # steps done up to `at`
        self.at = 0.0  # time of the last boundary the instance was advanced to
        self.batch = 0
        self.context = 0  # tokens of KV the batch holds at `at`
        self.reserved = 0  # context reserved by running and pending requests
        self.finishing: list[tuple[int, int, Job]] = []  # (step it finishes at, idx, job)
        self.pending: list[Job] = []  # room reserved, joining at the next boundary
        self.waiting: deque[Job] = deque()  # no room yet
        self.next_k: int | None = None  # steps from `at` to the boundary scheduled
        self.version = 0  # events of older versions are stale
        # Segments between batch changes: first step, its duration, the growth per step.
        self.seg_step: list[int] = []
        self.seg_a: list[float] = []
        self.seg_s: list[float] = []
        self.peak_reserved = 0

    # ---- time -----------------------------------------------------------------------------
    def _a_s(self) -> tuple[float, float]:
        return self.fit.seconds(self.batch, self.context), self.fit.d2 * self.batch

    def time_at(self, k: int) -> float:
        a, s = self._a_s()
        return self.at + k * a + s * k * (k - 1) / 2

    def steps_until(self, t: float) -> int:
        """The fewest steps from `at` that end at or after `t`."""
        a, s = self._a_s()
        dt = t - self.at
        if dt <= 0:
            return 0
        half = a - s / 2
        k = (
            math.ceil(dt / a)
            if s == 0
            else math.ceil((-half + math.sqrt(half * half + 2 * s * dt)) / s)
        )
        while self.time_at(k) < t:
            k += 1
        while k > 0 and self.time_at(k - 1) >= t:
            k -= 1
        return k

    # ---- arrivals -------------------------------------------------------------------------
    def arrive(self, job: Job, now: float, slo_tbt_s: float | None) -> tuple[bool, float | None]:
        """`job`'s KV has arrived: (accepted, the time of a boundary event to schedule)."""
        need = job.decode_tokens
        if need > self.capacity:
            return False, None
        if slo_tbt_s is not None:
            k = self.steps_until(now) if self.batch else 0
            batch = self.batch + len(self.pending) + len(self.waiting) + 1
            context = self.context + self.batch * k + job.input_length
            context += sum(j.input_length for j in (*self.pending, *self.waiting))
            if self.fit.seconds(batch, context) > slo_tbt_s:
                return False, None
        job.kv_arrival = now
        if not self.waiting and self.reserved + need <= self.capacity:
            self._reserve(job)
            self.pending.append(job)
        else:
            self.waiting.append(job)
            return True, None
        if self.batch == 0:
            self.at, self.next_k = now, 0  # idle: the batch starts now
            return True, now
        k = self.steps_until(now)
        if self.next_k is None or k < self.next_k:
            self.next_k = k
            self.version += 1
            return True, self.time_at(k)
        return True, None

    def _reserve(self, job: Job) -> None:
        self.reserved += job.decode_tokens
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    # ---- boundaries -----------------------------------------------------------------------
    def boundary(self, now: float) -> tuple[list[Job], float | None]:
        """Advance to the scheduled boundary (`now`): requests that finished, and the time of
        the next boundary event (None: idle)."""
        k = self.next_k or 0
        self.steps += k
        self.context += self.batch * k
        self.at = now
        done = []
        while self.finishing and self.finishing[0][0] <= self.steps:
            _, _, job = heapq.heappop(self.finishing)
            self.batch -= 1
            self.context -= job.input_length + job.output_length - 1
            self.reserved -= job.decode_tokens
            job.finish = now
            job.tbt = self._tbt(job)
            done.append(job)
        while self.waiting and self.reserved + self.waiting[0].decode_tokens <= self.capacity:
            job = self.waiting.popleft()
            self._reserve(job)
            self.pending.append(job)
        for job in self.pending:
            self._join(job, now)
        self.pending.clear()
        self.version += 1
        if self.batch == 0:
            self.next_k = None
            return done, None
        a, s = self._a_s()
        self.seg_step.append(self.steps)
        self.seg_a.append(a)
        self.seg_s.append(s)
        self.next_k = self.finishing[0][0] - self.steps
        return done, self.time_at(self.next_k)

    def _join(self, job: Job, now: float) -> None:
        job.decode_join = now
        job.join_step = self.steps
        job.join_segment = len(self.seg_step)  # the segment this boundary opens
        self.batch += 1
        self.context += job.input_length
        last = self.steps + job.output_length - 1  # the prefill gave the first token
        heapq.heappush(self.finishing, (last, job.idx, job))

    def _tbt(self, job: Job) -> float | None:
        """Mean of the longest 10% of `job`'s token intervals: the first from its prefill's
        end to its first decode step's end, then one per step (a segment's steps at their mean
        length: within a segment they differ by d2 x batch per step, microseconds)."""
        steps = job.output_length - 1
        if steps <= 0 or job.prefill_end is None or job.decode_join is None:
            return None
        first, end = job.join_step, job.join_step + steps
        runs: list[tuple[float, int]] = []
        for i in range(job.join_segment, len(self.seg_step)):
            lo = max(self.seg_step[i], first)
            hi = min(self.seg_step[i + 1] if i + 1 < len(self.seg_step) else end, end)
            if hi <= lo:
                continue
            a, s, start = self.seg_a[i], self.seg_s[i], self.seg_step[i]
            if lo == first:  # the first interval also waited for the hand-off
                runs.append((job.decode_join - job.prefill_end + a + s * (lo - start), 1))
                lo += 1
            if hi > lo:
                runs.append((a + s * ((lo + hi - 1) / 2 - start), hi - lo))
        want = max(1, math.ceil(steps / 10))
        total, taken = 0.0, 0
        for value, count in sorted(runs, reverse=True):
            n = min(count, want - taken)
            total, taken = total + value * n, taken + n
            if taken == want:
                break
        return total / taken if taken else None

    # ---- what the Conductor sees ----------------------------------------------------------
    def state(self, forecast: list[tuple[float, int, int]] | None) -> InstanceState:
        queued = (*self.pending, *self.waiting)
        return InstanceState(
            self.name,
            Role.DECODE,
            self.hw.profile,
            running_decodes=self.batch + len(queued),
            decode_context_tokens=self.context + sum(j.input_length for j in queued),
            free_blocks=max(self.capacity - self.reserved, 0) // self.block_size,
            total_blocks=min(self.capacity, 1 << 40) // self.block_size,
            decode_changes=tuple(forecast) if forecast else (),
        )

    def finish_forecast(self) -> list[tuple[float, int, int]]:
        """When each running request is predicted to leave, at today's step length."""
        a, s = self._a_s()
        out = []
        for step, _, job in self.finishing:
            k = step - self.steps
            out.append((self.at + k * a + s * k * (k - 1) / 2, -1, -(job.decode_tokens - 1)))
        return out

    def check_integrity(self) -> None:
        assert self.reserved <= self.capacity, (self.name, self.reserved, self.capacity)
        assert self.batch == len(self.finishing) >= 0
        running = sum(j.decode_tokens for _, _, j in self.finishing)
        assert self.reserved == running + sum(j.decode_tokens for j in self.pending)
