"""Pool behaviour beyond the contract: the SSD segment, placement hints, graceful leave."""

from __future__ import annotations

import signal
import time

import pytest

from hetserve.store import ReplicateConfig, ValueTooLargeError, open_store
from hetserve.store.pool import protocol as P

from .helpers import MiB, payload
from .servers import PoolCluster


def _replicas(store, key: str) -> list[list]:
    return store._call(P.LOCATE, {"keys": [key]})["objects"][0]["replicas"]


def test_ssd_segment_takes_objects_when_dram_is_full(request, tmp_path):
    cluster = PoolCluster(request, 0, "4M")
    cluster.nodes.append(cluster.start_node("--ssd-dir", str(tmp_path), "--ssd", "16M"))
    cluster.wait_nodes(1)
    for shm in ("", "&shm=0"):  # the file-backed segment by mapping and over TCP
        store = open_store(cluster.spec + shm)
        keys = [f"k{shm}{i}" for i in range(6)]
        for k in keys:
            store.put(k, payload(MiB, k))
        segments = {_replicas(store, k)[0][1] for k in keys}
        # DRAM first, then the SSD segment (the second pass may find DRAM still held by the
        # first pass's removed but read-leased objects).
        assert 1 in segments and (shm or segments == {0, 1})
        for k in keys:
            assert store.get(k) == payload(MiB, k)
        for k in keys:
            store.remove(k)
        store.close()


def test_preferred_node_soft_pin_and_graceful_leave(request):
    cluster = PoolCluster(request, 2, "8M")
    store = open_store(cluster.spec)
    request.addfinalizer(store.close)
    nodes = store.stats()["nodes"]
    for target in nodes:
        store.put(f"on-{target}", b"x" * 100, ReplicateConfig(preferred_segment=target))
        assert _replicas(store, f"on-{target}")[0][0] == target
    store.put("pinned", payload(MiB, "pinned"), ReplicateConfig(soft_pin=True))
    for i in range(40):  # 40 MiB through 16 MiB of pool: LRU eviction, the pinned one stays
        store.put(f"fill{i}", payload(MiB, f"fill{i}"))
    assert store.get("pinned") == payload(MiB, "pinned")
    assert store.get("fill0") is None and store.get("fill39") == payload(MiB, "fill39")
    # A node that leaves cleanly unregisters at once (no heartbeat timeout to wait for).
    leaving = next(p for p in cluster.nodes)
    leaving.send_signal(signal.SIGTERM)
    leaving.wait(10)
    assert len(store.stats()["nodes"]) == 1
    for i in range(30, 40):
        got = store.get(f"fill{i}")
        assert got is None or got == payload(MiB, f"fill{i}")


def test_master_enforces_its_value_limit(request):
    cluster = PoolCluster(request, 1, "8M")
    store = open_store(cluster.spec.replace("max_value=96M", "max_value=1G"))
    request.addfinalizer(store.close)
    with pytest.raises(ValueTooLargeError):
        store.put("huge", bytes(97 * MiB))  # the master's --max-value is 96M
    with pytest.raises(ValueTooLargeError):
        store.put("big", bytes(9 * MiB))  # larger than every segment
    store.put("ok", b"fine")
    assert store.get("ok") == b"fine"


def test_silent_node_is_dropped_by_heartbeat_and_rejoins(request):
    cluster = PoolCluster(request, 1, "8M", node_timeout=1.0)
    store = open_store(cluster.spec)
    request.addfinalizer(store.close)
    store.put("k", b"v" * 1000)
    node = cluster.nodes[0]
    node.send_signal(signal.SIGSTOP)  # alive but silent: only the heartbeat timeout notices
    request.addfinalizer(lambda: node.send_signal(signal.SIGCONT))
    deadline = time.monotonic() + 10
    while store.stats()["nodes"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.stats()["nodes"] == []
    assert store.get("k") is None  # its metadata is gone: a clean miss, no hang
    node.send_signal(signal.SIGCONT)
    cluster.wait_nodes(1)
    store.put("k2", b"w" * 1000)
    assert store.get("k2") == b"w" * 1000


def test_locate_and_tiers_name_the_shared_memory_path(request):
    cluster = PoolCluster(request, 1, "8M")
    mapped, remote = open_store(cluster.spec), open_store(cluster.spec + "&shm=0")
    request.addfinalizer(mapped.close)
    request.addfinalizer(remote.close)
    mapped.put_parts("blk", [payload(4096, "a"), payload(4096, "b")])
    assert mapped.batch_locate(["blk", "none"]) == ["pool-shm", None]
    assert remote.batch_locate(["blk"]) == ["pool"]  # the same object, seen over TCP
    [shm_tier] = mapped.tiers()
    [tcp_tier] = remote.tiers()
    assert (shm_tier.name, tcp_tier.name) == ("pool-shm", "pool")
    assert shm_tier.capacity == tcp_tier.capacity == 8 * MiB
    assert shm_tier.used == tcp_tier.used > 0 and shm_tier.shared
    assert remote.remove("blk") and mapped.batch_locate(["blk"]) == [None]
