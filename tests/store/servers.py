"""Start the store services the tests need as real processes on 127.0.0.1; stop them after."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

import pytest

from hetserve.bench import store_peers as peers
from hetserve.bench.store_peers import free_port, mooncake_bin, redis_command, redis_executable

from .helpers import Backend, MiB

# the store tests wait up to 20 s for a server to listen
wait_port = functools.partial(peers.wait_port, timeout=20.0)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def spawn(cmd: list[str], request, env: dict | None = None, log=None) -> subprocess.Popen:
    proc = subprocess.Popen(
        cmd,
        stdout=log or subprocess.DEVNULL,
        stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        start_new_session=True,  # a Ctrl-C of pytest must not reach servers mid-teardown
    )
    request.addfinalizer(lambda: stop(proc))
    return proc


# -- hetserve pool ----------------------------------------------------------------------------
def hetserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetserve.cli", *args]


def store_cmd(*args: str) -> list[str]:
    """`hetserve store ARGS` without the rest of the CLI (no torch import: a fast start)."""
    assert args[0] == "store"
    return [sys.executable, "-m", "hetserve.entrypoints.store", *args[1:]]


class PoolCluster:
    """A master and nodes as real processes; tests kill and restart them by PID."""

    def __init__(
        self, request, nodes: int, dram: str, node_timeout: float = 2.0, shm: bool = True
    ) -> None:
        self.request, self.dram, self.node_timeout = request, dram, node_timeout
        self.shm = shm
        self.port = free_port()
        self.master = self.start_master()
        self.nodes = [self.start_node() for _ in range(nodes)]
        self.wait_nodes(nodes)

    @property
    def spec(self) -> str:
        shm = "" if self.shm else "&shm=0"
        return f"pool://127.0.0.1:{self.port}?max_value=96M&reconnect=10{shm}"

    def start_master(self) -> subprocess.Popen:
        cmd = store_cmd(
            "store",
            "master",
            "--port",
            str(self.port),
            "--node-timeout",
            str(self.node_timeout),
            "--max-value",
            "96M",
        )
        proc = spawn(cmd, self.request)
        wait_port(self.port, proc)
        return proc

    def start_node(self, *extra: str) -> subprocess.Popen:
        port = free_port()
        cmd = store_cmd(
            "store",
            "node",
            "--master",
            f"127.0.0.1:{self.port}",
            "--dram",
            self.dram,
            "--port",
            str(port),
            *extra,
        )
        proc = spawn(cmd, self.request)
        wait_port(port, proc)
        return proc

    def wait_nodes(self, n: int, timeout: float = 20.0) -> None:
        from hetserve.store import open_store

        deadline = time.monotonic() + timeout
        with open_store(self.spec) as client:
            while len(client.stats()["nodes"]) != n:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pool has {client.stats()['nodes']} nodes, wanted {n}")
                time.sleep(0.05)


def corrupt_pool(store, key: str) -> None:
    from hetserve.store.pool import protocol as P
    from hetserve.store.pool.links import Transfer

    obj = store._call(P.LOCATE, {"keys": [key]})["objects"][0]
    garbage = memoryview(os.urandom(obj["size"]))
    for node, seg, off in obj["replicas"]:
        assert store._links[node].write([Transfer(0, seg, off, obj["size"], [garbage])]) == [True]


def start_pool1(request) -> Backend:
    cluster = PoolCluster(request, 1, "96M")
    return Backend("pool1", cluster.spec, 96 * MiB, corrupt_pool)


def start_pool3(request) -> Backend:
    # Over TCP (shm=0), so the suite covers both data paths; pool1 uses shared memory.
    cluster = PoolCluster(request, 3, "72M", shm=False)
    return Backend("pool3", cluster.spec, 3 * 72 * MiB, corrupt_pool)


# -- redis ------------------------------------------------------------------------------------
def start_redis(request) -> Backend:
    exe = redis_executable()
    if exe is None:
        pytest.skip("redis: redis-server is not installed (make system-deps installs it)")
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("redis: the redis Python package is not installed (pip install -e .[dev])")
    port = free_port()
    cmd = redis_command(exe, port, "256mb")
    wait_port(port, spawn(cmd, request))
    return Backend("redis", f"redis://127.0.0.1:{port}/0", 256 * MiB, corrupt_redis)


def corrupt_redis(store, key: str) -> None:
    from hetserve.store.checksum import HEADER

    # Flip the byte rather than write a fixed one: a fixed byte equals the payload's own byte
    # there one time in 256 (random keys give random payloads), and then nothing is corrupted.
    name, at = store.prefix + key, HEADER.size + 10
    byte = store._r.getrange(name, at, at)
    assert len(byte) == 1
    assert store._r.setrange(name, at, bytes([byte[0] ^ 0xFF]))


# -- mooncake ---------------------------------------------------------------------------------
def start_mooncake(request) -> Backend:
    master, holder = mooncake_bin("mooncake_master"), mooncake_bin("mooncake_client")
    if master is None or holder is None:
        pytest.skip("mooncake: pip install mooncake-transfer-engine-non-cuda (make test does)")
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:  # e.g. libibverbs1 missing
        pytest.skip(f"mooncake: its client does not load here ({exc}); make system-deps")
    env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    rpc, http, metrics, hport = free_port(), free_port(), free_port(), free_port()
    proc = spawn(peers.master_command(master, rpc, http, metrics, lease_ms=2000), request, env)
    wait_port(rpc, proc)
    wait_port(http, proc)
    metadata = f"http://127.0.0.1:{http}/metadata"
    # A segment holder that outlives the test's clients (a client's own segment leaves with it).
    holder_proc = spawn(peers.holder_command(holder, hport, "160MB", rpc, metadata), request, env)
    wait_port(hport, holder_proc)
    spec = f"mooncake://127.0.0.1:{rpc}?metadata={metadata}&segment=0&buffer=100M&max_value=96M"
    return Backend("mooncake", spec, 160 * MiB, corrupt_mooncake, keep_client=True)


def start_mooncake_direct(request) -> Backend:
    """The same service, moved through Mooncake's multi-buffer calls (the RDMA path) over TCP."""
    backend = start_mooncake(request)
    spec = backend.spec + "&gather=direct"
    return Backend("mooncake-direct", spec, 160 * MiB, corrupt_mooncake, keep_client=True)


def corrupt_mooncake(store, key: str) -> None:
    blob = bytearray(store._store.get(key))
    blob[-1] ^= 0xFF
    assert store._store.upsert(key, bytes(blob)) == 0
