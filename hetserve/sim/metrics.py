"""What a run is worth: per-run figures out of the simulated requests.

- cache hit rate: prompt tokens served from a cache (own DRAM or the pool) / prompt tokens, over
  the requests the Conductor admitted;
- prefill compute time: mean seconds of GPU work per admitted request (loads excluded);
- TTFT and TBT: mean, p50, p90, p99 (TBT as the Mooncake paper defines it: a request's mean of
  its longest 10% of token intervals);
- effective requests: finished, TTFT and TBT both within the SLOs (a missing SLO does not
  bind), as a count and a share of every request in the trace (the paper's "effective request
  capacity");
- rejected: by the Conductor's admission, and by decode instances after the prefill;
- goodput: effective requests per simulated second; per dollar: effective requests / the
  cluster's cost over the run (prices per hour summed over every instance);
- the run's own cost: wall seconds, events per second, and the share of the wall time spent
  inside the policy's `decide` (the part no simulator of this policy can avoid).

Who calls it: `run.py` (tables, JSON), `search.py`. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hetserve.core.trace_record import TraceRecord
from hetserve.sim.jobs import Job
from hetserve.sim.loop import SimResult


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(values)
    return {"mean": sum(xs) / len(xs), **{f"p{q}": _pct(xs, q) for q in (50, 90, 99)}}


def _pct(xs: list[float], q: int) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def effective(job: Job, slo_ttft_s: float | None, slo_tbt_s: float | None) -> bool:
    if job.rejected is not None or job.finish is None or job.ttft is None:
        return False
    if slo_ttft_s is not None and job.ttft > slo_ttft_s:
        return False
    return not (slo_tbt_s is not None and job.tbt is not None and job.tbt > slo_tbt_s)


def summarize(res: SimResult) -> dict[str, Any]:
    cfg = res.config
    slo_ttft, slo_tbt = cfg.router.slo_ttft_s, cfg.router.slo_tbt_s
    jobs = res.jobs
    admitted = [j for j in jobs if j.rejected != "admission"]
    prompt = sum(j.input_length for j in admitted)
    cached = sum(j.cached_tokens for j in admitted)
    pooled = sum(j.pool_blocks for j in admitted) * cfg.block_tokens
    good = sum(1 for j in jobs if effective(j, slo_ttft, slo_tbt))
    first = min((j.arrival for j in jobs), default=0.0)
    duration = max(res.end - first, 1e-9)
    price = sum(hw.price_per_hour for hw in (*cfg.prefill, *cfg.decode))
    price += sum(n.price_per_hour for n in cfg.cache_nodes) if cfg.cache == "global" else 0
    dollars = price * duration / 3600
    return {
        "requests": len(jobs),
        "finished": sum(1 for j in jobs if j.finish is not None and j.rejected is None),
        "rejected_admission": sum(1 for j in jobs if j.rejected == "admission"),
        "rejected_decode": sum(1 for j in jobs if j.rejected == "decode"),
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "pool_hit_rate": pooled / prompt if prompt else 0.0,
        "prefill_compute_s": _mean([j.compute_s for j in admitted]),
        "ttft_s": percentiles([t for j in admitted if (t := j.ttft) is not None]),
        "tbt_s": percentiles([j.tbt for j in jobs if j.tbt is not None and j.rejected is None]),
        "effective": good,
        "effective_ratio": good / len(jobs) if jobs else 0.0,
        "duration_s": duration,
        "goodput_rps": good / duration,
        "price_per_hour": price,
        "goodput_per_dollar": good / dollars if dollars > 0 else None,
        "prefill_utilization": _mean([p.busy_s / duration for p in res.prefill]),
        "evictions": res.caches.evictions,
        "events": res.events,
        "wall_s": res.wall_s,
        "events_per_s": res.events / res.wall_s if res.wall_s > 0 else None,
        "policy_s": res.policy_s,
        "policy_share": res.policy_s / res.wall_s if res.wall_s > 0 else None,
    }


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def twin(records: Sequence[TraceRecord], res: SimResult) -> dict[str, Any] | None:
    """Predicted against measured, where the trace is a request log with measurements: mean
    TTFT (error relative to the measured one) and prefix reuse (difference in percentage
    points), over the requests the live server did not reject."""
    pairs = [(r, j) for r, j in zip(records, res.jobs, strict=True) if not r.rejected]
    measured = [(r.ttft_ms / 1000, j.ttft) for r, j in pairs if r.ttft_ms is not None]
    reuse = [(r, j) for r, j in pairs if r.cached_tokens is not None]
    if not measured and not reuse:
        return None
    out: dict[str, Any] = {"requests": len(pairs)}
    sim = [p for _, p in measured if p is not None]
    if measured and sim:
        m_mean = sum(m for m, _ in measured) / len(measured)
        p_mean = sum(sim) / len(sim)
        out |= {
            "ttft_measured_s": m_mean,
            "ttft_predicted_s": p_mean,
            "ttft_error": (p_mean - m_mean) / m_mean if m_mean > 0 else None,
        }
    if reuse:
        tokens = sum(r.input_length for r, _ in reuse)
        m = sum(r.cached_tokens or 0 for r, _ in reuse) / tokens
        p = sum(j.cached_tokens for _, j in reuse) / tokens
        out |= {"reuse_measured": m, "reuse_predicted": p, "reuse_diff_pp": 100 * (p - m)}
    return out
