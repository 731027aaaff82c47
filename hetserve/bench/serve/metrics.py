"""Serving metrics from per-request timings, with vLLM benchmark_serving's definitions.

TTFT: first content chunk - send. ITL: gaps between successive content chunks. TPOT: (E2E - TTFT)
/ (output tokens - 1), for requests with more than one output token. E2E: end of stream - send.
Throughputs divide by the benchmark duration (first send to last finish). Goodput counts the
completed requests that meet every SLO limit.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from hetserve.bench.serve.client import RequestResult
from hetserve.errors import InvalidInputError

SLO_KEYS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=200,tpot=50` -> {"ttft": 200.0, "tpot": 50.0}, limits in milliseconds."""
    if not text:
        return {}
    limits: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or key not in SLO_KEYS or not math.isfinite(ms) or ms <= 0:
            raise InvalidInputError(
                f"--slo: bad limit {part.strip()!r}; expected KEY=MS with KEY in "
                f"{', '.join(SLO_KEYS)} and MS > 0, e.g. --slo ttft=200,tpot=50"
            )
        limits[key] = ms
    return limits


def meets_slo(r: RequestResult, limits: dict[str, float]) -> bool:
    """A request counts only if it completed and meets every limit (one-token TPOT counts as 0)."""
    if not r.ok:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
    return all(values[k] * 1000.0 <= ms for k, ms in limits.items())


def summarize(values_s: list[float]) -> dict[str, float | None]:
    """mean / median / p90 / p99 / max in milliseconds; None when there is nothing to summarize."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None, "max": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
    return {"mean": float(ms.mean()), "median": p50, "p90": p90, "p99": p99, "max": float(ms.max())}


def pick_bin(duration_s: float, max_bins: int = 200) -> float:
    """The finest round bin width that keeps the throughput series under `max_bins` points."""
    for width in (0.1, 1.0, 10.0, 60.0):
        if duration_s / width <= max_bins:
            return width
    return 600.0


def throughput_over_time(
    results: list[RequestResult], start_s: float, duration_s: float, bin_s: float
) -> list[float]:
    """Output tokens per second in consecutive bins of `bin_s` from the benchmark start."""
    nbins = max(1, math.ceil(duration_s / bin_s - 1e-9))
    counts = np.zeros(nbins, dtype=np.float64)
    for r in results:
        if not r.ok or not r.token_s:
            continue
        # With server usage a chunk may hold several tokens; spread the total over the chunks.
        weight = r.output_tokens / len(r.token_s)
        idx = np.minimum(((np.asarray(r.token_s) - start_s) / bin_s).astype(int), nbins - 1)
        np.add.at(counts, np.maximum(idx, 0), weight)
    # The last bin ends with the run: divide by its real width, or the tail looks like a drop.
    widths = np.minimum(bin_s, duration_s - bin_s * np.arange(nbins))
    return (counts / np.maximum(widths, 1e-9)).tolist()


def _usage_source(done: list[RequestResult]) -> str:
    from_server = sum(r.usage_from_server for r in done)
    if from_server == len(done):
        return "server"
    if from_server == 0:
        return "counted from stream (server sent no usage)"
    return f"server for {from_server} of {len(done)}, counted from stream for the rest"


def compute_metrics(
    results: list[RequestResult],
    start_s: float,
    end_s: float,
    slo: dict[str, float] | None = None,
    bin_s: float | None = None,
) -> dict[str, Any]:
    """Everything the table, the JSON file and the plots show, from raw results."""
    slo = slo or {}
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    duration = max(end_s - start_s, 1e-9)
    bin_s = bin_s or pick_bin(duration)
    in_tokens = sum(r.prompt_len for r in done)
    out_tokens = sum(r.output_tokens for r in done)
    metrics: dict[str, Any] = {
        "duration_s": duration,
        "requests": len(results),
        "completed": len(done),
        "failed": len(failed),
        # Refused at admission (429: a router's or a Conductor's early rejection), among failed.
        "rejected": sum(1 for r in failed if (r.error or "").startswith("HTTP 429")),
        "errors": dict(Counter(r.error for r in failed).most_common()),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "usage_source": _usage_source(done) if done else None,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": summarize([r.ttft for r in done]),
        "tpot_ms": summarize([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": summarize([g for r in done for g in r.itls]),
        "e2el_ms": summarize([r.e2e for r in done]),
        "throughput_bin_s": bin_s,
        "output_throughput_over_time": throughput_over_time(done, start_s, duration, bin_s),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in results)
        metrics["slo_ms"] = dict(slo)
        metrics["slo_good_requests"] = good
        # Attainment is over every request sent: a failed request missed its SLO too.
        metrics["slo_attainment"] = good / len(results) if results else 0.0
        metrics["goodput"] = good / duration
    return metrics
