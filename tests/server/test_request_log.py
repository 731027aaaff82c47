"""`serve --log-requests FILE`: every finished request is a line `hetserve sim` reads, with
the engine's own block hashes (the same prefix, the same ids) and what was measured."""

import subprocess
import sys
import time

import httpx

from hetserve.sim.trace import read_trace
from tests.store import servers

PROMPT = list(range(10, 80))  # 70 tokens: 4 full blocks of 16 and a partial one


def test_request_log_replays_in_the_simulator(request, tiny_model, tmp_path):
    port = servers.free_port()
    log = tmp_path / "requests.jsonl"
    cmd = [sys.executable, "-m", "hetserve.cli", "serve", "--model", str(tiny_model("qwen3")),
           "--port", str(port), "--max-model-len", "256", "--log-requests", str(log)]  # fmt: skip
    proc = servers.spawn(cmd, request)
    servers.wait_port(port, proc)
    url = f"http://127.0.0.1:{port}/v1/completions"
    # The caller's X-Request-Id is logged (a Conductor's: its log joins ours); a malformed
    # one is ignored, never refused.
    for tail, rid in (([1], "conductor-req-1"), ([2, 3], "bad id with spaces")):
        body = {"prompt": PROMPT + tail, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url, json=body, timeout=60, headers={"X-Request-Id": rid})
        assert r.status_code == 200
    deadline = time.monotonic() + 10
    while (
        not log.exists() or len(log.read_text().splitlines()) < 2
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    servers.stop(proc)
    first, second = read_trace(str(log))
    assert (first.input_length, first.output_length) == (71, 5)
    assert second.input_length == 72 and second.timestamp_ms >= first.timestamp_ms
    assert first.block_size == 16 and len(first.hash_ids) == 5
    assert first.hash_ids[:4] == second.hash_ids[:4]  # the shared prefix: the same ids
    assert first.hash_ids[4] != second.hash_ids[4]
    assert first.ttft_ms > 0 and second.cached_tokens == 64
    assert (first.request_id, second.request_id) == ("conductor-req-1", None)
    replay = [sys.executable, "-m", "hetserve.cli", "sim", "--trace", str(log), "--prefill", "1",
              "--decode", "1"]  # fmt: skip
    sim = subprocess.run(replay, capture_output=True, text=True)
    assert sim.returncode == 0, sim.stderr
