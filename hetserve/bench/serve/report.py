"""What `hetserve bench serve` shows: the terminal table and the PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hetserve.bench.serve.client import RequestResult

_WIDTH = 60


def _row(label: str, value: Any, fmt: str = "{:.2f}") -> str:
    text = "n/a" if value is None else fmt.format(value) if isinstance(value, float) else str(value)
    return f"{label}{text:>{max(1, _WIDTH - len(label))}}"


def format_table(result: dict[str, Any]) -> str:
    """vLLM-style summary: counts, throughputs, latency percentiles, SLO, errors, notes."""
    m = result["metrics"]
    lines = [
        " Serving Benchmark Result ".center(_WIDTH, "="),
        _row("Dataset:", result["dataset"]),
        _row("Endpoint:", result["endpoint"]),
        _row("Arrivals:", result["arrivals"]),
        _row("Max concurrency:", result["max_concurrency"] or "unlimited"),
        _row("Successful requests:", m["completed"]),
        _row("Failed requests:", m["failed"]),
        _row("  of them rejected (429):", m.get("rejected", 0)),
        _row("Benchmark duration (s):", m["duration_s"]),
        _row("Total input tokens:", m["total_input_tokens"]),
        _row("Total generated tokens:", m["total_output_tokens"]),
        _row("Request throughput (req/s):", m["request_throughput"]),
        _row("Output token throughput (tok/s):", m["output_throughput"]),
        _row("Total token throughput (tok/s):", m["total_token_throughput"]),
    ]
    if "slo_ms" in m:
        limits = ",".join(f"{k}={v:g}" for k, v in m["slo_ms"].items())
        lines += [
            _row(f"SLO ({limits} ms) attainment:", f"{100 * m['slo_attainment']:.1f}%"),
            _row("Goodput (req/s):", m["goodput"]),
        ]
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st)"}
    names |= {"itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, title in names.items():
        stats = m[f"{key}_ms"]
        lines.append(f" {title} ".center(_WIDTH, "-"))
        for stat in ("mean", "median", "p90", "p99", "max"):
            lines.append(_row(f"{stat.capitalize()} {key.upper()} (ms):", stats[stat]))
    if "burst" in m:
        from hetserve.bench.serve.burst import table_lines

        lines.append(" Long prompts into running streams ".center(_WIDTH, "-"))
        lines += table_lines(m["burst"], _row)
    reuse = result.get("prefix_reuse")
    if reuse:
        lines.append(" Prefix reuse with a perfect cache ".center(_WIDTH, "-"))
        lines.append(_row("Block hits:", f"{reuse['blocks_hit']} / {reuse['blocks_total']}"))
        lines.append(_row("Block hit ratio:", f"{100 * reuse['block_hit_ratio']:.1f}%"))
        lines.append(_row("Prompt-token hit ratio:", f"{100 * reuse['token_hit_ratio']:.1f}%"))
    if m["errors"]:
        lines.append(" Errors ".center(_WIDTH, "-"))
        lines += [f"{n:>6} x {err}" for err, n in list(m["errors"].items())[:10]]
    cmp = result.get("structured")
    if cmp:
        lines.append(" Structured output vs the same load without ".center(_WIDTH, "-"))
        lines.append(_row("Baseline output throughput (tok/s):", cmp["baseline_output_throughput"]))
        lines.append(_row("Output throughput ratio (goal >= 0.9):", cmp["throughput_ratio"]))
        lines.append(_row("Schema requests' mean TTFT (ms):", cmp["schema_ttft_ms"]))
        lines.append(_row("Same requests without (ms):", cmp["schema_ttft_baseline_ms"]))
        lines.append(_row("TTFT ratio (goal <= 1.1):", cmp["ttft_ratio"]))
        lines.append(_row("Plain requests' TTFT ratio:", cmp["plain_ttft_ratio"]))
    lines.append("=" * _WIDTH)
    notes = list(result.get("notes", []))
    if m["usage_source"] and m["usage_source"] != "server":
        notes.append(f"output tokens: {m['usage_source']}")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def write_plots(directory: str, results: list[RequestResult], metrics: dict[str, Any]) -> list[str]:
    """ttft.png, tpot.png (histograms) and throughput.png (output tokens/s over time)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    done = [r for r in results if r.ok]
    series = {
        "ttft": ([1000 * r.ttft for r in done], "TTFT (ms)"),
        "tpot": ([1000 * t for r in done if (t := r.tpot) is not None], "TPOT (ms)"),
    }
    paths = []
    for name, (values, label) in series.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)))
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        limit = metrics.get("slo_ms", {}).get(name)
        if limit is not None:
            ax.axvline(limit, color="red", linestyle="--", label=f"SLO {limit:g} ms")
            ax.legend()
        ax.set(xlabel=label, ylabel="requests", title=f"{label} distribution (n={len(values)})")
        paths.append(_save(fig, out / f"{name}.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    rates = metrics["output_throughput_over_time"]
    bin_s = metrics["throughput_bin_s"]
    edges = [min(i * bin_s, metrics["duration_s"]) for i in range(len(rates) + 1)]
    ax.stairs(rates, edges)
    ax.set_ylim(bottom=0)
    ax.set(xlabel="time since start (s)", ylabel="output tokens/s", title="Output throughput")
    paths.append(_save(fig, out / "throughput.png"))
    return paths


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def structured_comparison(workload, results, baseline_results, baseline_metrics) -> dict:
    """The structured run against the same load without grammars (same requests, same
    arrival times): output throughput ratio, and the mean TTFT of the schema requests (and of
    the others) against the same requests in the baseline."""
    marked = [c[0].response_format is not None for c in workload.conversations]

    def ttfts(rs, want: bool) -> list[float]:
        ordered = sorted(rs, key=lambda r: r.send_s)  # single-turn: the workload's order
        return [r.ttft for r, m in zip(ordered, marked, strict=False) if m == want and r.ok]

    def mean_ms(xs: list[float]) -> float:
        return 1000 * sum(xs) / len(xs) if xs else float("nan")

    ok = [r for r in results if r.ok]
    span = max((r.end_s for r in ok), default=0) - min((r.send_s for r in results), default=0)
    out_tps = sum(r.output_tokens for r in ok) / span if span > 0 else 0.0
    base_tps = baseline_metrics["output_throughput"]
    s_ms, b_ms = mean_ms(ttfts(results, True)), mean_ms(ttfts(baseline_results, True))
    p_ms, pb_ms = mean_ms(ttfts(results, False)), mean_ms(ttfts(baseline_results, False))
    return {
        "baseline_output_throughput": round(base_tps, 2),
        "throughput_ratio": round(out_tps / base_tps, 3) if base_tps else None,
        "schema_ttft_ms": round(s_ms, 2),
        "schema_ttft_baseline_ms": round(b_ms, 2),
        "ttft_ratio": round(s_ms / b_ms, 3) if b_ms else None,
        "plain_ttft_ratio": round(p_ms / pb_ms, 3) if pb_ms else None,
    }
