"""scripts/gpu_suite.sh --dry-run: every step of the GPU half hour rehearsed on the CPU (tiny
checkpoint, device cpu, GPU tests collected but not run), so a typo fails here, not there."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["env", "pytest-gpu", "model", "calibrate", "hybrid", "kv-tiers"]


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = ["bash", str(ROOT / "scripts" / "gpu_suite.sh"), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_gpu_suite_dry_run_rehearses_every_step(tmp_path):
    out = tmp_path / "results"
    proc = _run(str(out), "--dry-run", "--python", sys.executable)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    assert [r[0] for r in rows] == STEPS and all(r[1] == "0" for r in rows), rows
    env = json.loads((out / "env.json").read_text())
    assert env["dry_run"] is True and env["gpu"] is None
    hybrid = json.loads((out / "hybrid.json").read_text())
    systems = {r["system"] for r in hybrid["decode"]}
    assert {"hybrid", "hybrid d=1", "hybrid d=2", "hybrid gpu-experts 2"} <= systems
    assert {r["batch"] for r in hybrid["decode"]} == {1, 8}
    assert hybrid["experts_bandwidth_fraction_batch1"] > 0
    br = hybrid["decode_breakdown_batch1"]  # the routed experts' share of a decode step
    assert 0 < br["experts_kernels_ms"] <= br["experts_host_calls_ms"] <= br["step_ms"]
    assert br["kernels_gbps"] > 0
    assert all(r["vs_eager"] > 0 for r in hybrid["decode"])
    assert "needs CUDA" not in json.dumps(hybrid["offload_peer"])  # --skip-peer in this script
    # The GPU tests were collected (imports and fixtures resolve) without running.
    assert "tests collected" in (out / "pytest-gpu.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in summary] == STEPS
    assert "summary" in proc.stdout and "6 of 6 steps ok" in proc.stdout


def test_gpu_suite_usage_errors_exit_2(tmp_path):
    assert _run().returncode == 2
    bad = _run(str(tmp_path), "--budget", "ten")
    assert bad.returncode == 2 and "integers" in bad.stderr
    assert _run(str(tmp_path), "--python", "/nonexistent/python").returncode == 2
