"""`--plot DIR`: the simulator's figures as PNG files (matplotlib, files only).

- ttft_vs_rate.png: mean TTFT against the arrival rate (x the trace's), a line per policy,
  admission and cache mode;
- hit_rate_vs_cache.png: cache hit rate against the cache per instance, a line per policy and
  cache mode;
- hot_block_replicas.png: how many instances hold the blocks ranked 10th, 100th, 1000th and
  10,000th hottest, over time (the paper's Fig. 11), for each global-cache run that kept them.

Who calls it: the CLI. A figure whose axis would have a single point is skipped.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from hetserve.sim.run import Run


def write_plots(directory: str, runs: list[Run]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (
        ("ttft_vs_rate.png", _ttft_vs_rate),
        ("hit_rate_vs_cache.png", _hit_vs_cache),
        ("hot_block_replicas.png", _replicas),
    ):
        fig = draw(plt, runs)
        if fig is not None:
            fig.tight_layout()
            fig.savefig(out / name, dpi=100)
            plt.close(fig)
            written.append(str(out / name))
    return written


def _lines(
    runs: list[Run], x: str, y: Any, keys: tuple[str, ...]
) -> dict[str, list[tuple[Any, float]]]:
    lines: dict[str, list[tuple[Any, float]]] = defaultdict(list)
    for run in runs:
        value = y(run)
        if value is not None:
            label = " ".join(str(run.params[k]) for k in keys)
            lines[label].append((run.params[x], value))
    return {k: sorted(v) for k, v in lines.items() if len({p[0] for p in v}) > 1}


def _ttft_vs_rate(plt: Any, runs: list[Run]) -> Any:
    return _line_plot(
        plt, runs, "rate", lambda r: r.summary["ttft_s"]["mean"], ("policy", "admission", "cache"),
        xlabel="arrival rate (x the trace's)", ylabel="mean TTFT (s)", yscale="log",
        title="TTFT against load",
    )  # fmt: skip


def _hit_vs_cache(plt: Any, runs: list[Run]) -> Any:
    return _line_plot(
        plt, runs, "cache_tokens", lambda r: 100 * r.summary["cache_hit_rate"], ("policy", "cache"),
        xlabel="KV cache per prefill instance (tokens)", ylabel="cache hit rate (%)",
        xscale="log", title="Hit rate against cache size",
    )  # fmt: skip


def _line_plot(
    plt: Any, runs: list[Run], x: str, y: Any, keys: tuple[str, ...], **axes: str
) -> Any:
    """A line per `keys` of the runs' `y` against their parameter `x`; None without a line of
    two points or more."""
    lines = _lines(runs, x, y, keys)
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in lines.items():
        ax.plot(*zip(*points, strict=True), marker="o", label=label)
    ax.set(**axes)
    ax.legend(fontsize="small")
    return fig


def _replicas(plt: Any, runs: list[Run]) -> Any:
    kept = [r for r in runs if r.replicas and r.replicas["by_rank"]]
    if not kept:
        return None
    fig, axes = plt.subplots(1, len(kept), figsize=(5 * len(kept), 3.5), squeeze=False)
    for ax, run in zip(axes[0], kept, strict=True):
        assert run.replicas is not None
        every = run.replicas["every_s"]
        for rank, counts in run.replicas["by_rank"].items():
            ax.plot([i * every for i in range(len(counts))], counts, label=f"{rank}th")
        p = run.params
        ax.set(
            xlabel="time (s)",
            ylabel="replica count",
            title=f"{p['policy']} {p['admission']} x{p['rate']:g}",
        )
        ax.legend(fontsize="small")
    return fig
