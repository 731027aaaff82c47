"""Two `hetserve serve` processes sharing one KV store: the second serves a prompt whose prefix
the first computed, prefilling only the tail, and says so in `usage.prompt_tokens_details`.

Each shared backend is started for real on 127.0.0.1 (the pool service, Redis, Mooncake where it
installs; a missing one skips with the reason). A killed pool node is a miss, never an error.
"""

import json
import sys
import time

import httpx
import pytest

from tests.store import servers

PROMPT = list(range(10, 110))  # 6 full blocks of 16 cacheable, the 7th recomputed
STARTERS = {
    "pool": servers.start_pool1,
    "redis": servers.start_redis,
    "mooncake": servers.start_mooncake,
}


class Serve:
    """`hetserve serve` on a free port, started by a test and stopped with it."""

    def __init__(self, request, model, spec: str, log_path) -> None:
        self.port = servers.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "hetserve.cli", "serve", "--model", str(model),
            "--port", str(self.port), "--kv-store", spec, "--kv-load", "always",
            "--max-model-len", "256",
        ]  # fmt: skip
        self.log = open(log_path, "w")  # noqa: SIM115 (closed by the finalizer)
        env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        self.proc = servers.spawn(cmd, request, env, self.log)
        request.addfinalizer(self.log.close)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, open(self.log.name).read()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError(f"server did not start: {open(self.log.name).read()}")

    def complete(self) -> dict:
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")

    def wait_saved(self, blocks: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (
                self.metric("hetserve_kv_tier_saved_blocks_total") >= blocks
                and self.metric("hetserve_kv_tier_pending_saves") == 0
            ):
                return
            time.sleep(0.05)
        counts = {
            m: self.metric(f"hetserve_kv_tier_{m}")
            for m in ("saved_blocks_total", "failed_saves_total", "pending_saves")
        }
        log = open(self.log.name).read()[-3000:]
        raise AssertionError(f"the prompt blocks were not saved: {counts}\n{log}")


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3-moe", lm_head_scale=4.0)


@pytest.mark.parametrize("backend", sorted(STARTERS))
def test_second_instance_reuses_what_the_first_computed(request, model, tmp_path, backend):
    spec = STARTERS[backend](request).spec
    first = Serve(request, model, spec, tmp_path / "first.log")
    second = Serve(request, model, spec, tmp_path / "second.log")
    first.wait_ready()
    second.wait_ready()
    cold = first.complete()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    first.wait_saved(blocks=6)  # written through at once: the store is shared
    warm = second.complete()
    details = warm["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == 96, details
    assert set(details["cached_tokens_by_tier"]) <= {"pool", "pool-shm", "redis", "mooncake"}
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert second.metric("hetserve_kv_tier_loads_total") == 1


def test_killed_pool_nodes_are_misses_and_the_request_completes(request, model, tmp_path):
    cluster = servers.PoolCluster(request, nodes=1, dram="64M", node_timeout=30.0)
    first = Serve(request, model, cluster.spec, tmp_path / "first.log")
    second = Serve(request, model, cluster.spec, tmp_path / "second.log")
    first.wait_ready()
    second.wait_ready()
    cold = first.complete()
    first.wait_saved(blocks=6)
    for node in cluster.nodes:  # the master still lists the objects: the reads fail
        servers.stop(node)
    warm = second.complete()
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Either the lookup already found nothing, or the read failed: no block was loaded.
    assert second.metric("hetserve_kv_tier_load_bytes_total") == 0
    assert httpx.get(second.url + "/health").status_code == 200
    assert json.loads(httpx.get(second.url + "/v1/models").text)["data"]
