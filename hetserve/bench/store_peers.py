"""Local services for `hetserve bench store`: a pool cluster and a Mooncake Store on loopback,
started as child processes for the run and stopped after it."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Return once something listens on 127.0.0.1:`port`; raise if `proc` exits first or
    nothing listens within `timeout` seconds. (The store tests start their servers with it.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{proc.args[0]} exited with {proc.returncode} before listening on {port}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def redis_executable() -> str | None:
    return shutil.which("redis-server") or shutil.which("valkey-server")


def redis_command(exe: str, port: int, maxmemory: str) -> list[str]:
    """redis-server on loopback: no persistence, LRU eviction at `maxmemory`."""
    return [
        exe,
        *("--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"),
        *("--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"),
    ]


@contextlib.contextmanager
def _processes() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _spawn(procs: list, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    p = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})}
    )
    procs.append(p)
    return p


@contextlib.contextmanager
def local_pool(nodes: int = 1, dram: str = "1G") -> Iterator[str]:
    """A master and `nodes` nodes on loopback; yields the pool:// spec."""
    from hetserve.store import open_store

    with _processes() as procs:
        port = free_port()
        cli = [
            sys.executable,
            "-m",
            "hetserve.entrypoints.store",
        ]  # the services alone: a fast start
        wait_port(port, _spawn(procs, [*cli, "master", "--port", str(port)]))
        for _ in range(nodes):
            _spawn(procs, [*cli, "node", "--master", f"127.0.0.1:{port}", "--dram", dram])
        spec = f"pool://127.0.0.1:{port}"
        with open_store(spec) as client:
            deadline = time.monotonic() + 30
            while len(client.stats()["nodes"]) < nodes and time.monotonic() < deadline:
                time.sleep(0.05)
        yield spec


def mooncake_bin(name: str) -> str | None:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else shutil.which(name)


def master_command(exe: str, rpc: int, http: int, metrics: int, lease_ms: int) -> list[str]:
    """A Mooncake master on loopback with its HTTP metadata server (the benchmarks' and the
    tests' alike); `lease_ms`: how long a read leases an object before its room is reused."""
    return [
        exe,
        "--rpc_address=127.0.0.1",
        f"--rpc_port={rpc}",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={metrics}",
        f"--default_kv_lease_ttl={lease_ms}",
    ]


def holder_command(exe: str, port: int, segment: str, rpc: int, metadata: str) -> list[str]:
    """A Mooncake client that only lends `segment` of DRAM to the master at `rpc` (TCP)."""
    return [
        exe,
        "--host=127.0.0.1",
        f"--port={port}",
        f"--global_segment_size={segment}",
        f"--master_server_address=127.0.0.1:{rpc}",
        f"--metadata_server={metadata}",
        "--protocol=tcp",
    ]


@contextlib.contextmanager
def local_mooncake(segment: str = "2GB") -> Iterator[tuple[str, str] | None]:
    """Mooncake master (with its HTTP metadata server) and a segment holder on loopback;
    yields (master address, metadata URL), or None when Mooncake is not installed."""
    master, holder = mooncake_bin("mooncake_master"), mooncake_bin("mooncake_client")
    if master is None or holder is None:
        yield None
        return
    env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    with _processes() as procs:
        rpc, http, metrics, hport = (free_port() for _ in range(4))
        # Reads lease objects: 1 s, not 5, before their room is reused.
        m = _spawn(procs, master_command(master, rpc, http, metrics, lease_ms=1000), env)
        wait_port(rpc, m)
        wait_port(http, m)
        metadata = f"http://127.0.0.1:{http}/metadata"
        h = _spawn(procs, holder_command(holder, hport, segment, rpc, metadata), env)
        wait_port(hport, h)
        yield f"127.0.0.1:{rpc}", metadata


@contextlib.contextmanager
def local_redis(maxmemory: str = "2gb") -> Iterator[str | None]:
    """A redis-server on loopback (no persistence, LRU eviction); yields its redis:// spec, or
    None when redis-server is not installed."""
    exe = redis_executable()
    if exe is None:
        yield None
        return
    with _processes() as procs:
        port = free_port()
        wait_port(port, _spawn(procs, redis_command(exe, port, maxmemory)))
        yield f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def local_mooncake_spec(buffer: str = "256M") -> Iterator[str | None]:
    """hetserve's mooncake:// backend on a Mooncake Store started on loopback (None: not
    installed). The client contributes no memory: the segment holder has it all."""
    with local_mooncake() as addr:
        if addr is None:
            yield None
            return
        yield f"mooncake://{addr[0]}?metadata={addr[1]}&segment=0&buffer={buffer}"
