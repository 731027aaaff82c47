"""Faults on a real pool: a node killed mid-read, a master restart, garbage on the wire, tokens."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from hetserve.errors import InvalidInputError
from hetserve.store import ReplicateConfig, StoreUnavailableError, open_store
from hetserve.store.pool import protocol as P
from hetserve.store.pool.node import PoolNode
from hetserve.transfer.framing import HEADER, MAGIC, VERSION

from .helpers import payload
from .servers import PoolCluster, free_port, hetserve_cmd, spawn, wait_port

KiB = 1024


def _frame(op: int, meta: bytes, data_len: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, len(meta), data_len) + meta


def _node_of(store, key: str) -> list[str]:
    return [r[0] for r in store._call(P.LOCATE, {"keys": [key]})["objects"][0]["replicas"]]


def test_node_killed_during_read_heavy_run(request):
    cluster = PoolCluster(request, 3, "32M", node_timeout=1.0, shm=False)
    store = open_store(cluster.spec)
    request.addfinalizer(store.close)
    two = [f"two-{i}" for i in range(24)]
    one = [f"one-{i}" for i in range(24)]
    for k in two:
        store.put(k, payload(64 * KiB, k), ReplicateConfig(replica_num=2))
    for k in one:
        store.put(k, payload(64 * KiB, k))
    pid_of = {nid: link.info["pid"] for nid, link in store._links.items()}
    victim_id = _node_of(store, one[0])[0]
    wrong, missing_two = [], []
    stop = threading.Event()

    def reader() -> None:
        client = open_store(cluster.spec)
        while not stop.is_set():
            for k in two + one:
                got = client.get(k)
                if got is not None and got != payload(64 * KiB, k):
                    wrong.append(k)
                if got is None and k in two:
                    missing_two.append(k)
        client.close()

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    os.kill(pid_of[victim_id], signal.SIGKILL)
    time.sleep(2.0)  # past the heartbeat timeout: the master has dropped the node
    stop.set()
    for t in threads:
        t.join(30)
    assert not wrong and not missing_two
    assert victim_id not in store.stats()["nodes"]
    for k in two:
        assert store.get(k) == payload(64 * KiB, k)
    located = store._call(P.LOCATE, {"keys": one})["objects"]
    assert all(o is None or victim_id not in [r[0] for r in o["replicas"]] for o in located)
    for k in one:  # single replicas on the dead node are clean misses, the rest read back
        got = store.get(k)
        assert got is None or got == payload(64 * KiB, k)
    assert sum(store.get(k) is None for k in one) >= 1
    # A node joins while serving and takes new objects.
    cluster.nodes.append(cluster.start_node())
    cluster.wait_nodes(3)
    store.put("after", b"x" * 1000, ReplicateConfig(replica_num=3))
    assert store.get("after") == b"x" * 1000 and len(_node_of(store, "after")) == 3


def test_master_restart(request):
    cluster = PoolCluster(request, 2, "16M")
    store = open_store(cluster.spec)
    request.addfinalizer(store.close)
    keys = [f"k{i}" for i in range(10)]
    for k in keys:
        store.put(k, payload(100 * KiB, k))
    cluster.master.send_signal(signal.SIGKILL)
    cluster.master.wait(5)
    cluster.master = cluster.start_master()
    cluster.wait_nodes(2)
    for k in keys:  # objects may be lost; nothing wrong is ever returned
        got = store.get(k)
        assert got is None or got == payload(100 * KiB, k)
    store.put("new", payload(MiB := 1 << 20, "new"))
    assert store.get("new") == payload(MiB, "new")
    store.stats()  # the master's invariants hold


def _raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _abuse(port: int) -> None:
    attacks = [
        os.urandom(64),  # garbage
        _frame(1, b'{"token": ""}')[:10],  # truncated header
        HEADER.pack(MAGIC, VERSION, 1, 50, 0) + b'{"tok',  # truncated metadata
        HEADER.pack(MAGIC, VERSION, 1, 1 << 30, 1 << 40),  # absurd lengths
        _frame(1, b"[1, 2]"),  # metadata that is not an object
        _frame(1, b"\xff\xfe"),  # not JSON
        _frame(1, b'{"token": ""}') + _frame(99, b"{}"),  # unknown op after a good hello
        _frame(1, b'{"token": ""}') + _frame(P.LOCATE, b'{"keys": 5}'),  # ill-typed request
        _frame(1, b'{"token": ""}') + _frame(P.READ, b'{"seg": 0, "off": 0, "len": 99999999}'),
        _frame(1, b'{"token": ""}') + _frame(P.WRITE, b'{"seg": 7, "off": 0, "len": 8}', 8),
    ]
    for raw in attacks:
        with _raw(port) as s:
            try:
                s.sendall(raw)
                s.shutdown(socket.SHUT_WR)  # EOF mid-frame: the truncated cases
                while s.recv(65536):
                    pass
            except OSError:
                pass


def test_garbage_and_truncated_frames_leave_services_serving(request):
    cluster = PoolCluster(request, 1, "16M")
    store = open_store(cluster.spec)
    request.addfinalizer(store.close)
    store.put("before", b"v" * 5000)
    node_port = next(iter(store._links.values())).info["port"]
    _abuse(cluster.port)
    _abuse(node_port)
    assert cluster.master.poll() is None and cluster.nodes[0].poll() is None
    assert store.get("before") == b"v" * 5000
    store.put("after", b"w" * 5000)
    assert store.get("after") == b"w" * 5000
    with _raw(cluster.port) as s:  # an ill-typed request is answered, the connection kept
        s.sendall(_frame(1, b'{"token": ""}') + _frame(P.LOCATE, b'{"keys": 5}'))
        s.sendall(_frame(P.NODES, b"{}"))
        time.sleep(0.3)
        replies = s.recv(65536)
        assert replies.count(MAGIC) == 3 and b"bad_request" in replies


def test_token_required_beyond_loopback_and_checked(request):
    refused = subprocess.run(
        hetserve_cmd("store", "master", "--host", "0.0.0.0"),
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "HETSERVE_STORE_TOKEN"},
    )
    assert refused.returncode == 2 and "refusing to bind 0.0.0.0" in refused.stderr
    with pytest.raises(InvalidInputError, match="without a shared token"):
        PoolNode(("127.0.0.1", 1), 4096, host="0.0.0.0")  # embedded services: the same rule
    port = free_port()
    proc = spawn(hetserve_cmd("store", "master", "--port", str(port), "--token", "s3cret"), request)
    wait_port(port, proc)
    with pytest.raises(StoreUnavailableError, match="token"):
        open_store(f"pool://127.0.0.1:{port}?token=wrong")
    open_store(f"pool://127.0.0.1:{port}?token=s3cret").close()


def _parts(key: str, n: int = 96, size: int = 2 * KiB) -> list[bytes]:
    return [payload(size, f"{key}/{i}") for i in range(n)]


def test_nodes_killed_or_frozen_during_batch_get_into_parts(request):
    """One node dies (SIGKILL) and one freezes (SIGSTOP) while a reader loops over
    batch_get_into_parts over TCP: its calls return misses for their objects, never wrong bytes,
    and none waits longer than the client's timeout."""
    cluster = PoolCluster(request, 3, "16M", node_timeout=1.0, shm=False)
    spec = cluster.spec + "&timeout=1"
    store = open_store(spec)
    request.addfinalizer(store.close)
    keys = [f"mp-{i}" for i in range(24)]
    store.batch_put_parts(keys, [_parts(k) for k in keys])
    on = {k: _node_of(store, k)[0] for k in keys}
    pid_of = {nid: link.info["pid"] for nid, link in store._links.items()}
    killed, frozen = sorted(set(on.values()))[:2]
    wrong: list[str] = []
    misses: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        client = open_store(spec)
        dests = [[bytearray(2 * KiB) for _ in range(96)] for _ in keys]
        while not stop.is_set():
            got = client.batch_get_into_parts(keys, dests)
            for k, n, dest in zip(keys, got, dests, strict=True):
                if n is None:
                    misses.append(k)
                elif [bytes(d) for d in dest] != _parts(k):
                    wrong.append(k)
        client.close()

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.3)
    os.kill(pid_of[killed], signal.SIGKILL)
    time.sleep(0.3)
    os.kill(pid_of[frozen], signal.SIGSTOP)
    request.addfinalizer(lambda: os.kill(pid_of[frozen], signal.SIGKILL))
    time.sleep(2.5)  # past the heartbeat timeout: the master drops both
    stop.set()
    thread.join(20)  # a call stuck on the frozen node would outlast this (the default is 30 s)
    assert not thread.is_alive() and not wrong
    assert {on[k] for k in misses} <= {killed, frozen} and misses
    dests = [[bytearray(2 * KiB) for _ in range(96)] for _ in keys]
    got = store.batch_get_into_parts(keys, dests)
    for k, n, dest in zip(keys, got, dests, strict=True):
        assert (n is None) == (on[k] in (killed, frozen))
        assert n is None or [bytes(d) for d in dest] == _parts(k)
