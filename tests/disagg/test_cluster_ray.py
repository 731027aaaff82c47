"""`cluster up --launcher ray`: the cluster's parts as Ray actors on a real Ray cluster.

One node (a Ray instance the launcher starts here): the disaggregated answer equals one
engine's, every part listens on the node's address behind the cluster's key, a killed instance
is started again at its address, a runner that dies takes its process with it, and stop()
leaves nothing. Two hosts (network namespaces with their own addresses and hostnames, a Ray
head on one and a worker on the other, `cluster up` run on the head as a user would): the
decode instance placed on the second host by a custom resource, the KV handed off between the
hosts, the answer equal to one engine's, SIGTERM stopping every part on both."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hetserve import LLM, SamplingParams
from hetserve.disagg.cluster_spec import ClusterSpec
from hetserve.disagg.launch import free_port
from hetserve.testing.hosts import Hosts

ray = pytest.importorskip("ray")

ENGINE = ("--dtype", "float32", "--max-model-len", "256")
PROMPT = "The quick brown fox jumps over the lazy dog and runs into the forest to find friends"


@pytest.fixture(scope="module")
def want(tiny_model):
    model = str(tiny_model("qwen3-moe"))
    ref = LLM(model, dtype="float32", max_model_len=256)
    out = ref.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    return model, out[0].text


@pytest.fixture(scope="module")
def one_node(want, tmp_path_factory):
    from hetserve.disagg.ray_launch import RayLauncher

    model, _ = want
    spec = ClusterSpec(
        model=model, prefill=1, decode=1, store="pool", store_dram="64M", port=free_port(),
        instance_args=ENGINE, log_dir=str(tmp_path_factory.mktemp("ray-logs")), launcher="ray",
    )  # fmt: skip
    launcher = RayLauncher(ready_timeout_s=240)
    running = launcher.start(spec)
    pids = [p.proc.pid for p in running.parts]
    yield launcher, running
    launcher.stop()
    assert not ray.is_initialized()  # the Ray instance it started is gone too
    assert not [pid for pid in pids if _alive(pid)]  # nothing left behind


def complete(endpoint, key, **extra):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **extra}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(endpoint + "/completions", json=body, headers=headers, timeout=120)


def test_one_node_answers_as_one_engine_behind_the_key(want, one_node):
    launcher, running = one_node
    parts = {p.name: p for p in running.parts}
    assert set(parts) == {"store-master", "store-node", "prefill-0", "decode-0", "conductor"}
    node_ip = ray.util.get_node_ip_address()
    for name in ("store-master", "store-node", "prefill-0", "decode-0"):
        assert parts[name].host == node_ip  # the node's address, not loopback
    assert parts["conductor"].host == "127.0.0.1"  # where the user asked (the default)
    r = complete(running.endpoint, launcher.api_key)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want[1]
    assert complete(running.endpoint, None).status_code == 401
    # The instances beyond loopback ask for the key themselves.
    assert httpx.get(parts["decode-0"].url + "/v1/models", timeout=10).status_code == 401
    # Ray gives a runner that asks no CPUs OMP_NUM_THREADS=1: the instances must not inherit it
    # (their kernels would run on one thread).
    environ = Path(f"/proc/{parts['decode-0'].proc.pid}/environ").read_bytes().split(b"\0")
    assert not [v for v in environ if v.startswith(b"OMP_NUM_THREADS=")]
    assert b"HETSERVE_ADMIN_KEY=" + launcher.admin_key.encode() not in environ


def test_a_killed_instance_is_started_again_at_its_address(want, one_node):
    launcher, running = one_node
    victim = next(p for p in running.parts if p.name == "decode-0")
    url = victim.url
    victim.proc.send_signal(signal.SIGKILL)
    assert victim.proc.wait(30) == -signal.SIGKILL
    t = time.monotonic()
    assert launcher.supervise(t) == ["decode-0 was killed by SIGKILL; starting it again in 1 s"]
    said = launcher.supervise(t + 1.0)
    assert said == [f"decode-0 started again (restart 1, log {victim.log})"]
    launcher._wait(victim)
    assert victim.url == url
    deadline = time.monotonic() + 60  # the Conductor's health check sees it back
    while time.monotonic() < deadline:
        r = complete(running.endpoint, launcher.api_key)
        if r.status_code == 200:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want[1]


def test_a_lost_instance_is_placed_again_and_the_conductor_follows(want, one_node):
    """A runner gone (its node lost; here: the actor killed) must not leave its process behind.
    Its part is placed again where Ray finds room, on a new address; for an instance the
    Conductor drops the old address and adds the new one (it used to be said once and left
    down: a lost node's instances were gone for good)."""
    launcher, running = one_node
    parts = {p.name: p for p in running.parts}
    old = {name: parts[name].address for name in ("store-node", "decode-0")}
    restarts = parts["decode-0"].restarts
    for name in old:
        pid = parts[name].proc.pid
        ray.kill(launcher.actors[name])
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pid)
    host = parts["decode-0"].host
    said = launcher.supervise()
    assert said == [f"{name}: its Ray runner on {host} is gone; placing it again" for name in old]
    started: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(started) < 2:
        time.sleep(0.2)
        started += [s for s in launcher.supervise() if "started again on" in s]
    victim = parts["decode-0"]
    assert sorted(started) == [
        f"decode-0 started again on {victim.address} (restart {restarts + 1}, log {victim.log})",
        f"store-node started again on {parts['store-node'].address} (restart 1, log "
        f"{parts['store-node'].log})",
    ]
    assert all(parts[name].address != old[name] for name in old)
    assert {"store-node", "decode-0"} <= {p.name for p in running.parts}
    key = {"Authorization": f"Bearer {launcher.admin_key}"}  # changing instances: the admin's
    base = running.endpoint.removesuffix("/v1")
    deadline = time.monotonic() + 120  # it loads, then joins at the Conductor's next ask
    while time.monotonic() < deadline:
        launcher.supervise()  # it may exit once if it starts before the store node registers
        rows = httpx.get(base + "/internal/instances", headers=key, timeout=10).json()
        joined = {r["name"]: r for r in rows["instances"] if not r.get("joining")}
        if victim.address in joined:
            break
        time.sleep(0.5)
    assert victim.address in joined
    assert old["decode-0"] not in {r["name"] for r in rows["instances"]}
    r = complete(running.endpoint, launcher.api_key)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want[1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture
def hosts():
    why = Hosts.unavailable()
    if why:
        pytest.skip(f"two hosts on one machine: {why}")
    made = Hosts(2)
    yield made
    made.close()


def test_two_hosts_place_decode_on_the_second_and_hand_off_between_them(want, hosts, tmp_path):
    model, text = want
    raybin = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1"}
    head, other = hosts.addresses
    for i, extra in ((1, ["--head", "--port", "6379", "--include-dashboard", "false"]),
                     (2, ["--address", f"{head}:6379"])):  # fmt: skip
        node = [raybin, "start", *extra, "--node-ip-address", hosts.addresses[i - 1],
                "--num-cpus", "2", "--resources", json.dumps({f"host{i}": 1})]  # fmt: skip
        out = subprocess.run(hosts.command(i, node), env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
    port, logs = 8100, tmp_path / "logs"
    up = [sys.executable, "-m", "hetserve.cli", "cluster", "up", "--launcher", "ray",
          "--ray-address", f"{head}:6379", "--host", head, "--port", str(port),
          "--model", model, "--store", "pool", "--store-dram", "64M",
          "--ray-resources", "prefill=host1:1", "--ray-resources", "decode=host2:1",
          "--instance-args", " ".join(ENGINE), "--log-dir", str(logs)]  # fmt: skip
    proc = subprocess.Popen(hosts.command(1, up), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    printed = []
    try:
        for line in proc.stdout:
            printed.append(line)
            if line.startswith("cluster ready") or line.startswith("error"):
                break
        assert printed[-1].startswith(f"cluster ready: http://{head}:{port}/v1"), printed
        where = {}
        for line in proc.stdout:
            placed = re.match(r"  (\S+) +on (\S+):\d+$", line)
            if placed is None:
                break
            where[placed[1]] = placed[2]
        assert where["prefill-0"] == head and where["decode-0"] == other, where
        assert {where["store-node-0"], where["store-node-1"]} == {head, other}
        key = (logs / "api-key").read_text().strip()
        assert oct((logs / "api-key").stat().st_mode & 0o777) == "0o600"
        endpoint = f"http://{head}:{port}/v1"
        r = complete(endpoint, key)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text
        assert complete(endpoint, "wrong").status_code == 401
        health = httpx.get(f"http://{head}:{port}/health", timeout=10).json()
        decode = next(i for i in health["instances"] if i["role"] == "decode")
        assert decode["name"].startswith(f"{other}:")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for i in (1, 2):  # every part gone; only Ray's own processes remain on either host
            left = [_cmdline(pid) for pid in hosts.pids(i)]
            assert not [c for c in left if "hetserve.cli" in c or "hetserve.entrypoints" in c]
    finally:
        if proc.poll() is None:
            proc.kill()
        current = Path("/tmp/ray/ray_current_cluster")  # `ray start --head` names its head
        if current.exists() and head in current.read_text():
            current.unlink()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
