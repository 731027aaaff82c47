"""Routing on the KV cache, in a real cluster on 127.0.0.1: two prefill instances and one decode
instance behind the Conductor (`kvcentric`), KV events feeding its index.

The second request of a long shared prefix goes to the instance that holds it (its prefix-cache
hits count the prefix; the other instance sees nothing); a hot prefix sent many times at once
spreads to the other prefill instance, which keeps it; a Conductor started afresh (here with
`cache-aware`) rebuilds its index from the instances' snapshots and routes to the holder."""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from hetserve.bench.server_info import parse_prometheus
from hetserve.core.kv_events import MEDIUM_GPU
from hetserve.disagg.cluster_spec import ClusterSpec
from hetserve.disagg.costs import DecodeFit, InstanceProfile, PrefillFit, save_profile
from hetserve.disagg.launch import LocalLauncher, free_port
from hetserve.native.hash_chain import hash_prefix_digests
from hetserve.sim.trace import read_cluster_logs, read_trace

ENGINE = ("--dtype", "float32", "--max-model-len", "512")
PREFIX_TOKENS = 240  # 15 blocks of 16


def fixed_profile(model: str, path) -> str:
    """Every instance's cost profile, given rather than measured: three instances measuring
    their quick profiles at once on two cores fit noise (a prefill fit of c0 = 20 ms, c1 = 0
    with a relative error of 29 beside one of c0 = 0, c1 = 0.5 ms), and whether a hot prefix
    spreads then follows which instance drew which. ~10 ms a step and 0.1 ms a token: the tiny
    model's order of magnitude here."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4  # fp32 K, V
    fit = InstanceProfile("tiny qwen3-moe (fixed)", PrefillFit(0.01, 1e-4, 0.0),
                          DecodeFit(0.01, 1e-4, 0.0), kv_bytes_per_token=kv)  # fmt: skip
    save_profile(str(path), fit)
    return str(path)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    model = str(tiny_model("qwen3-moe"))
    logs = tmp_path_factory.mktemp("routing-logs")
    profile = fixed_profile(model, logs / "profile.json")
    spec = ClusterSpec(
        model=model, prefill=2, decode=1, port=free_port(), policy="kvcentric",
        instance_args=(*ENGINE, "--profile", profile), log_dir=str(logs),
        log_requests=str(logs / "requests"),
    )  # fmt: skip
    launcher = LocalLauncher(ready_timeout_s=240)
    running = launcher.start(spec)
    urls = {p.name: p.url for p in running.parts if p.url}
    yield model, running.endpoint, urls, logs / "requests"
    launcher.stop()


SENT: dict[str, int] = {}  # requests sent, per Conductor


def prefix(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 500, PREFIX_TOKENS).tolist()


def send(endpoint: str, ids: list[int]) -> None:
    SENT[endpoint] = SENT.get(endpoint, 0) + 1
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    r = httpx.post(endpoint + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


def counters(url: str) -> tuple[float, float]:
    """(prefix-cache queries, hits) of an instance, in tokens."""
    m = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)
    q, h = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
    return m.get(q + "_total", m.get(q, 0.0)), m.get(h + "_total", m.get(h, 0.0))


def blocks_held(url: str, ids: list[int]) -> int:
    """How many of the prompt's full blocks the instance holds, in any medium."""
    info = httpx.get(url + "/internal/info", timeout=10).json()
    want = hash_prefix_digests(ids, int(info["block_size"]), (), bytes.fromhex(info["hash_seed"]))
    snap = httpx.get(url + "/internal/kv_snapshot", timeout=10).json()
    held = {h for hs in snap["blocks"].values() for h in hs}
    return sum(h.digest.hex() in held for h in want)


def index_blocks(base: str, instance_url: str) -> float:
    """The Conductor's index: device blocks it believes `instance_url` holds."""
    name = instance_url.removeprefix("http://")
    text = httpx.get(base + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("hetserve_conductor_index_blocks{") and f'"{name}"' in line:
            if f'medium="{MEDIUM_GPU}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def index_caught_up(base: str, instance_url: str) -> bool:
    """The Conductor's index holds as many device blocks of the instance as the instance says
    it has (its start-up probes cached some before any request)."""
    snap = httpx.get(instance_url + "/internal/kv_snapshot", timeout=10).json()
    return index_blocks(base, instance_url) == len(snap["blocks"].get(MEDIUM_GPU, []))


def wait_for(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_the_second_request_of_a_shared_prefix_goes_to_the_holder(cluster):
    _, endpoint, urls, _ = cluster
    base = endpoint.removesuffix("/v1")
    prefills = [urls["prefill-0"], urls["prefill-1"]]
    ids = prefix(1)
    before = {u: counters(u) for u in prefills}
    send(endpoint, ids + [7, 8, 9])
    served = [u for u in prefills if counters(u)[0] > before[u][0]]
    assert len(served) == 1
    holder, other = served[0], next(u for u in prefills if u != served[0])
    assert blocks_held(holder, ids) == PREFIX_TOKENS // 16
    wait_for(lambda: index_caught_up(base, holder))  # the events arrived
    mid = {u: counters(u) for u in prefills}
    send(endpoint, ids + [11, 12, 13, 14])
    after = {u: counters(u) for u in prefills}
    assert after[holder][1] - mid[holder][1] >= PREFIX_TOKENS  # cached_tokens: the prefix
    assert after[other] == mid[other]  # the other instance never saw it


def test_a_hot_prefix_spreads_under_load(cluster):
    _, endpoint, urls, _ = cluster
    prefills = [urls["prefill-0"], urls["prefill-1"]]
    ids = prefix(2)
    send(endpoint, ids + [5])  # one instance holds it
    assert sorted(blocks_held(u, ids) for u in prefills) == [0, PREFIX_TOKENS // 16]
    # Many at once: the holder's queue grows until recomputing the prefix elsewhere is
    # predicted faster; the instance that did so keeps the prefix.
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: send(endpoint, ids + [20 + k, 30 + k]), range(32)))
    assert [blocks_held(u, ids) for u in prefills] == [PREFIX_TOKENS // 16] * 2


def test_a_restarted_conductor_rebuilds_its_index_and_routes_to_the_holder(cluster, tmp_path):
    model, endpoint, urls, _ = cluster
    prefills = [urls["prefill-0"], urls["prefill-1"]]
    ids = prefix(3)
    send(endpoint, ids + [3])  # through the first Conductor
    holder = next(u for u in prefills if blocks_held(u, ids))
    other = next(u for u in prefills if u != holder)
    port = free_port()
    cmd = [sys.executable, "-m", "hetserve.cli", "conductor", "--model", model, "--port",
           str(port), "--prefill", *prefills, "--decode", urls["decode-0"],
           "--policy", "cache-aware"]  # fmt: skip
    log = open(tmp_path / "second.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "second.log").read_text()
            try:
                return httpx.get(base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 120)
        # Its index comes from the instances' snapshots: it knows the holder before any event.
        wait_for(lambda: index_caught_up(base, holder))
        mid = {u: counters(u) for u in prefills}
        send(base + "/v1", ids + [4, 4])
        after = {u: counters(u) for u in prefills}
        assert after[holder][1] - mid[holder][1] >= PREFIX_TOKENS
        assert after[other] == mid[other]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        log.close()


def test_every_part_logged_its_requests_for_the_simulator(cluster):
    _, endpoint, _, logs = cluster
    SENT[endpoint] = SENT.get(endpoint, 0) + 1  # one streamed: the Conductor times its TTFT
    body = {"prompt": prefix(77), "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", endpoint + "/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    sent = SENT[endpoint]

    def lines(name: str) -> int:
        path = logs / f"{name}.jsonl"
        return len(read_trace(str(path))) if path.exists() else 0

    # Written as requests finish, from each process's own thread.
    wait_for(lambda: lines("conductor") == sent and lines("decode-0") >= sent)
    assert lines("prefill-0") + lines("prefill-1") >= sent  # every request was prefilled there
    # Joined by the Conductor's request id: every request it sent, measured where it ran.
    joined = read_cluster_logs(str(logs))
    assert len(joined) == sent and all(r.request_id for r in joined)
    assert all(r.ttft_ms is not None and r.cached_tokens is not None for r in joined)
    assert sum(r.cached_tokens for r in joined) >= (sent - 3) * PREFIX_TOKENS // 2
    decoded = {r.request_id: r for r in read_trace(str(logs / "decode-0.jsonl"))}
    assert all(decoded[r.request_id].hash_ids == r.hash_ids for r in joined)
    # The streamed request's TTFT is the Conductor's (it waited for the instance's and more);
    # an unstreamed answer has no first token to time there.
    timed = [r for r in read_trace(str(logs / "conductor.jsonl")) if r.ttft_ms is not None]
    assert len(timed) == 1
    streamed = next(r for r in joined if r.request_id == timed[0].request_id)
    assert streamed.ttft_ms == timed[0].ttft_ms >= decoded[streamed.request_id].ttft_ms


def test_the_conductor_reports_its_own_routing_time(cluster):
    _, endpoint, _, _ = cluster
    text = httpx.get(endpoint.removesuffix("/v1") + "/metrics", timeout=10).text
    m = parse_prometheus(text)
    assert m["hetserve_conductor_routing_seconds_count"] == SENT[endpoint]
    p50, p99 = (float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("hetserve_conductor_routing_seconds{"))  # fmt: skip
    assert 0 < p50 <= p99 < 5.0  # parse, tokenize, hash, decide: far below a request's time
