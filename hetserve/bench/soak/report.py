"""What `hetserve bench soak` reports: the summary document, the terminal table and the plot."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from hetserve.bench.common import print_table
from hetserve.bench.soak.client import (
    BAD_MISHANDLED,
    BUCKETS,
    ERROR_REPORTED,
    FAILED,
)
from hetserve.bench.soak.runner import SoakRun

_STATE_ROWS = (
    ("kv_blocks_used", "KV blocks in use", 1.0),
    ("kv_usage", "KV cache usage (fraction)", 1.0),
    ("running", "requests running", 1.0),
    ("waiting", "requests waiting", 1.0),
    ("rss_bytes", "server RSS (MiB)", 1.0 / (1 << 20)),
)


def summarize(run: SoakRun) -> dict[str, Any]:
    """Counts per case and bucket, the problems seen, the server before/after, the verdict."""
    by_case: dict[str, dict[str, Any]] = {}
    problems: dict[str, Counter[str]] = defaultdict(Counter)
    for o in run.outcomes:
        row = by_case.setdefault(o.case, {"group": o.group, "sent": 0, **dict.fromkeys(BUCKETS, 0)})
        row["sent"] += 1
        row[o.bucket] += 1
        if o.why:
            problems[o.bucket][f"{o.case}: {o.why}"] += 1
    totals = {b: sum(r[b] for r in by_case.values()) for b in BUCKETS}
    peaks = {
        key: max(
            (v for s in run.timeline if (v := getattr(s.server, key)) is not None), default=None
        )
        for key, _, _ in _STATE_ROWS
    }
    kv_before, kv_after = run.before.kv_blocks_used, run.after.kv_blocks_used
    kv_back = None if kv_before is None or kv_after is None else kv_after <= kv_before
    summary = {
        "sent": len(run.outcomes),
        "totals": totals,
        "by_case": by_case,
        "problems": {b: dict(c.most_common()) for b, c in problems.items()},
        "load_s": run.load_s,
        "server": {
            "before": run.before.as_dict(),
            "after": run.after.as_dict(),
            "peak": peaks,
            "idle": run.idle,
            "idle_wait_s": run.idle_wait_s,
            "kv_back_to_baseline": kv_back,
        },
        "timeline": [
            {"t_s": s.t_s, "in_flight": s.in_flight, **s.server.as_dict()} for s in run.timeline
        ],  # fmt: skip
    }
    summary["verdict"] = _verdict(summary)
    return summary


def _peak(run: SoakRun, key: str) -> float | None:
    seen = [v for s in run.timeline if (v := getattr(s.server, key)) is not None]
    return max(seen, default=None)


def _verdict(summary: dict[str, Any]) -> dict[str, Any]:
    totals, server = summary["totals"], summary["server"]
    reasons = []
    if totals[FAILED]:
        reasons.append(f"{totals[FAILED]} failed")
    if totals[BAD_MISHANDLED]:
        reasons.append(f"{totals[BAD_MISHANDLED]} bad requests not answered with a 4xx error JSON")
    if server["kv_back_to_baseline"] is False:
        before, after = server["before"]["kv_blocks_used"], server["after"]["kv_blocks_used"]
        reasons.append(
            f"KV blocks in use {after:.0f} > {before:.0f} before, "
            f"{server['idle_wait_s']:.0f} s after the load"
        )
    return {"ok": not reasons, "reasons": reasons}


def print_report(summary: dict[str, Any], header: dict[str, Any]) -> None:
    print(" ".join(f"{k}: {v}" for k, v in header.items()))
    rows = [
        [name, r["sent"], *(r[b] or "" for b in BUCKETS)] for name, r in summary["by_case"].items()
    ]
    rows.append(["total", summary["sent"], *summary["totals"].values()])
    print_table(["case", "sent", *BUCKETS], rows)
    for bucket in (FAILED, BAD_MISHANDLED, ERROR_REPORTED):
        seen = summary["problems"].get(bucket, {})
        if seen:
            print(f"\n{bucket}:")
            for why, n in list(seen.items())[:12]:
                print(f"  {n:>5} x {why}")
    server = summary["server"]
    print()
    print_table(
        ["server (/metrics)", "before", "after", "peak"],
        [
            [label, *(_scaled(server[w][key], scale) for w in ("before", "after", "peak"))]
            for key, label, scale in _STATE_ROWS
        ],
    )
    idle = {None: "n/a (no metrics)", True: "yes", False: "NO"}[server["idle"]]
    back = {None: "n/a", True: "yes", False: "NO"}[server["kv_back_to_baseline"]]
    print(f"\nidle after the load: {idle} ({server['idle_wait_s']:.1f} s); "
          f"KV blocks back to baseline: {back}")  # fmt: skip
    verdict = summary["verdict"]
    print("verdict: " + ("PASS" if verdict["ok"] else "FAIL: " + "; ".join(verdict["reasons"])))


def _scaled(value: float | None, scale: float) -> float | str:
    return "n/a" if value is None else value * scale


def write_plot(directory: str, summary: dict[str, Any]) -> str:
    """soak.png: open requests and server requests (top), KV blocks and RSS (bottom) over time."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rows = summary["timeline"]
    t = [r["t_s"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.step(t, [r["in_flight"] for r in rows], where="post", label="open (client)")
    for key in ("running", "waiting"):
        _series(top, t, rows, key, f"{key} (server)")
    top.set(ylabel="requests", title="Soak: load and server state")
    top.legend(loc="upper right")
    if not _series(bottom, t, rows, "kv_blocks_used", "KV blocks in use"):
        bottom.text(0.5, 0.5, "no KV metrics", ha="center", va="center", transform=bottom.transAxes)
    bottom.set(xlabel="time since start (s)", ylabel="KV blocks")
    if any(r["rss_bytes"] is not None for r in rows):
        rss = bottom.twinx()
        _series(rss, t, rows, "rss_bytes", "RSS", scale=1.0 / (1 << 20), color="tab:red")
        rss.set_ylabel("server RSS (MiB)")
    fig.tight_layout()
    path = out / "soak.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _series(ax: Any, t: list[float], rows: list[dict], key: str, label: str,
            scale: float = 1.0, color: str | None = None) -> bool:  # fmt: skip
    points = [(x, r[key] * scale) for x, r in zip(t, rows, strict=True) if r[key] is not None]
    if points:
        ax.step(*zip(*points, strict=True), where="post", label=label, color=color)
    return bool(points)
