"""`hetserve bench conductor` at small settings: every policy timed, hashing beside it."""

import json
import subprocess
import sys


def test_conductor_bench_smoke(tmp_path):
    out = tmp_path / "c.json"
    cmd = [sys.executable, "-m", "hetserve.cli", "bench", "conductor", "--instances", "8",
           "--prompt-tokens", "4096", "--repeats", "5", "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())["decision"]
    assert {"kvcentric", "cache-aware", "tier-credit", "load", "hash"} <= set(data)
    assert all(v["p50_ms"] > 0 for k, v in data.items() if isinstance(v, dict))
    assert data["index_lookup_included"] is True  # the KV index's lookup is in the timing
    bad = subprocess.run([*cmd[:5], "--url", "http://x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--direct-url" in bad.stderr
