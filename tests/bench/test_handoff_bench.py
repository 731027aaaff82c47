"""`hetserve bench handoff` at its smallest: every path moves the bytes and the JSON says so."""

import json
import subprocess
import sys


def test_handoff_bench_smoke(tmp_path):
    out = tmp_path / "h.json"
    cmd = [sys.executable, "-m", "hetserve.cli", "bench", "handoff", "--blocks", "4",
           "--block-kb", "64", "--rounds", "1", "--links", "2", "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert {"direct-shm", "direct-tcp-1", "direct-tcp-n", "store-pool"} <= set(data["gbs"])
    assert set(data["gbs"]) | set(data["skipped"]) >= {"mooncake-te"}
    assert all(v > 0 for v in data["gbs"].values())
    assert data["vs_pool"]["store-pool"] == 1.0
    bad = subprocess.run([*cmd[:5], "--paths", "carrier-pigeon"], capture_output=True, text=True)
    assert bad.returncode == 2 and "paths" in bad.stderr and "Traceback" not in bad.stderr
