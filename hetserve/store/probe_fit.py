"""A tier's read cost fitted from timed probe reads: pure (samples in, figures out; no clock).

The start-up probe (`selfcheck.py`) reads batches of several sizes (1, 8 and 32 block-sized
objects, in one batched call each, as the engine loads them) a few times each, and hands the
timings here. A single size cannot tell a read's fixed cost from its per-byte cost: on a fast
machine the two-point probe of one block against 1 KiB was mostly noise (the same SSD probed at
0.5 GB/s in one run and 19 GB/s in the next). So:

- each size's figure is the median of its reads (a stray slow read moves nothing);
- `latency_s + bytes / bandwidth` is a least-squares line through the medians;
- bounds a real tier cannot break: never faster than this machine's memory copy (a read ends in
  a copy into the caller's buffers), and never a negative latency;
- what is too noisy to trust is flagged (`unsteady`: reads of one size scatter, or a larger
  read was faster than a smaller one; `flat`: no per-byte cost visible above the noise; `slow`:
  a memory tier far below the copy rate), so the prober measures it again and the start-up
  line says so.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Reads of one size whose median absolute deviation exceeds this share of their median scatter
# too much for their median to stand for them.
MAX_SPREAD = 0.25
# A memory tier (a copy and a checksum per read) below this share of the copy rate was
# disturbed while probed: no real DRAM or shared-memory read is that slow.
MEMORY_FLOOR = 0.05
UNSTEADY, FLAT, CAPPED, SLOW, ONE_SIZE = "unsteady", "flat", "capped at copy", "slow", "one size"


@dataclass(frozen=True)
class TierFit:
    latency_s: float  # the fixed cost of one batched read
    bandwidth: float  # bytes per second beyond it
    points: tuple[tuple[int, float], ...]  # (bytes per batched read, median seconds)
    flags: tuple[str, ...] = ()

    def load_time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


def medians(samples: Mapping[int, Sequence[float]]) -> list[tuple[int, float]]:
    """(bytes, median seconds) per size with samples, smallest first."""
    return sorted((n, statistics.median(ts)) for n, ts in samples.items() if ts)


def unsteady(samples: Mapping[int, Sequence[float]]) -> bool:
    """The reads of some size scatter, or a larger read took less time than a smaller one."""
    for ts in samples.values():
        if len(ts) >= 3:
            mid = statistics.median(ts)
            spread = statistics.median(abs(t - mid) for t in ts)
            if mid <= 0 or spread > MAX_SPREAD * mid:
                return True
    times = [t for _, t in medians(samples)]
    return any(b < a for a, b in zip(times, times[1:], strict=False))


def fit_tier(
    samples: Mapping[int, Sequence[float]], copy_bandwidth: float | None, memory: bool = False
) -> TierFit:
    """Latency and bandwidth through the medians of `samples` (bytes per read -> seconds of
    each read), bounded by `copy_bandwidth`; `memory`: the tier is a copy from memory (DRAM,
    shared memory), held to a floor. Needs at least one sample."""
    points = medians(samples)
    if not points:
        raise ValueError("fit_tier needs at least one timed read")
    flags = [UNSTEADY] if unsteady(samples) else []
    latency, bandwidth = _line(points, copy_bandwidth, flags)
    if copy_bandwidth is not None and bandwidth > copy_bandwidth:
        flags.append(CAPPED)
        bandwidth = copy_bandwidth
        # The best fixed cost for that slope: the mean of what it leaves unexplained.
        latency = max(0.0, statistics.fmean(t - n / bandwidth for n, t in points))
    if memory and copy_bandwidth is not None and bandwidth < MEMORY_FLOOR * copy_bandwidth:
        flags.append(SLOW)
    return TierFit(latency, bandwidth, tuple(points), tuple(flags))


def _line(
    points: list[tuple[int, float]], copy_bandwidth: float | None, flags: list[str]
) -> tuple[float, float]:
    xs = [float(n) for n, _ in points]
    ys = [t for _, t in points]
    x_max, y_max = xs[-1], ys[-1]
    if len(points) < 2:
        flags.append(ONE_SIZE)  # nothing to split by: charge it all to bandwidth
        return 0.0, x_max / max(y_max, 1e-12)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    if slope <= 0:
        flags.append(FLAT)
        if copy_bandwidth is None:  # the conservative reading: every second is per byte
            return 0.0, x_max / max(y_max, 1e-12)
        # Bytes cost nothing visible: a fixed cost, and the bytes at (at most) copy speed.
        rest = statistics.fmean(t - n / copy_bandwidth for n, t in points)
        return max(0.0, rest), copy_bandwidth
    intercept = my - slope * mx
    if intercept >= 0:
        return intercept, 1 / slope
    # A negative fixed cost is impossible: the line through the origin instead.
    slope0 = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return 0.0, 1 / max(slope0, 1e-30)
