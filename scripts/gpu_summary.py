"""One summary table for scripts/gpu_suite.sh and gpu_bench_long.sh: each step's status, time
and headline figures (from its JSON), also written to RESULTS_DIR/summary.json.

    python scripts/gpu_summary.py RESULTS_DIR
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.3g}{unit}"


def _pytest(results: Path, name: str = "pytest-gpu", step: str = "pytest-gpu") -> str:
    try:
        root = ET.parse(results / f"{name}.xml").getroot()
    except (OSError, ET.ParseError):
        return "no junit xml"
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return "no testsuite"
    n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    if n == 0:  # --collect-only (a dry run): the count is in the log
        log = (results / f"{step}.log").read_text(errors="replace").strip().splitlines()
        return log[-1] if log else "nothing collected"
    return f"{n - f - e - s} passed, {f} failed, {e} errors, {s} skipped of {n}"


def _hybrid(report: dict) -> str:
    parts = []
    for r in report.get("decode", []):
        name, b = r["system"], r["batch"]
        if name == "hybrid":
            parts.append(f"b{b} {_fmt(r['tokens_per_s'], ' tok/s')}")
        elif name == "hybrid eager" and r.get("vs_hybrid"):
            parts.append(f"b{b} graphs {1 / r['vs_hybrid']:.2f}x eager")
        elif " d=" in name:  # deferral runs eagerly: its base is the eager row
            parts.append(f"b{b} {name.removeprefix('hybrid ')} {_fmt(r.get('vs_eager'), 'x')}")
        else:
            parts.append(f"b{b} {name.removeprefix('hybrid ')} {_fmt(r.get('vs_hybrid'), 'x')}")
    frac = report.get("experts_bandwidth_fraction_batch1")
    parts.append(f"experts {_fmt(frac)} of CPU read BW")
    if report.get("process_threads_after_decode"):  # hundreds: a team per layer or thread
        parts.append(f"{report['process_threads_after_decode']} threads on "
                     f"{report.get('usable_cpus')} CPUs")  # fmt: skip
    parts += [f"prefill {p['prompt_len']}: {_fmt(p['tokens_per_s'], ' tok/s')}"
              for p in report.get("prefill", [])]  # fmt: skip
    peer = report.get("offload_peer", {})
    if "tokens_per_s" in peer:
        parts.append(f"offload peer {_fmt(peer['tokens_per_s'], ' tok/s')}"
                     + (f" ({peer['reason']})" if peer.get("reason") else ""))  # fmt: skip
    return "; ".join(parts)


def _finetune(report: dict) -> str:
    """hetserve's training rate against the peer's, and each one's peak GPU memory."""
    best = report.get("best", {})
    parts = []
    for name in ("hetserve", "transformers+peft"):
        b = best.get(name)
        if b is None:
            parts.append(f"{name} failed")
            continue
        gpu = f", GPU {b['peak_gpu_mib'] / 1024:.1f} GiB" if "peak_gpu_mib" in b else ""
        parts.append(f"{name} {_fmt(b['tokens_per_s'], ' tok/s')}{gpu}")
    if len(best) == 2:
        ratio = best["hetserve"]["tokens_per_s"] / best["transformers+peft"]["tokens_per_s"]
        parts.append(f"{ratio:.2f}x the peer")
    return "; ".join(parts)


def _moe_kernel(report: dict) -> str:
    """Each backend's median ms per layer call at each token count (AMX: int16 vs W8A8)."""
    return "; ".join(f"{r['backend']} T={r['tokens']} {r['median_us'] / 1e3:.1f} ms"
                     for r in report.get("results", []))  # fmt: skip


def headline(results: Path, step: str) -> str:
    if step == "pytest-gpu":
        return _pytest(results)
    if step == "amx-tests":
        return _pytest(results, "pytest-amx", "amx-tests")
    if step == "amx-kernel":
        return _moe_kernel(_load(results / "amx-moe-kernel.json") or {})
    if step == "env":
        env = _load(results / "env.json") or {}
        return (
            f"{env.get('gpu') or 'no GPU'}; {env.get('cpu', '?')}; {env.get('cpu_threads')} threads"
        )
    report = _load(results / f"{step}.json")
    if report is None:
        return ""
    if report.get("benchmark") == "hybrid":
        return _hybrid(report)
    if "best" in report and "settings" in report:  # bench finetune
        return _finetune(report)
    keys = [k for k, v in report.items() if isinstance(v, (int, float)) and k != "machine"]
    return ", ".join(f"{k}={_fmt(float(report[k]))}" for k in keys[:4])


def main(results: Path) -> int:
    rows = []
    for line in (results / "steps.tsv").read_text().splitlines():
        name, status, seconds = line.split("\t")
        rows.append({"step": name, "status": status, "seconds": int(seconds),
                     "headline": headline(results, name)})  # fmt: skip
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in ("step", "status", "seconds")]
    print("\nsummary")
    print(
        "  ".join(h.ljust(w) for h, w in zip(("step", "status", "seconds"), widths, strict=True))
        + "  headline"
    )
    for r in rows:
        cells = [
            str(r[h]).ljust(w) for h, w in zip(("step", "status", "seconds"), widths, strict=True)
        ]
        print("  ".join(cells) + "  " + r["headline"])
    (results / "summary.json").write_text(json.dumps(rows, indent=2))
    failed = [r["step"] for r in rows if r["status"] not in ("0", "reused")]
    print(
        f"{len(rows) - len(failed)} of {len(rows)} steps ok"
        + (f"; not ok: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: gpu_summary.py RESULTS_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(Path(sys.argv[1])))
