"""The pool master's bookkeeping in-process: placement, watermarks, leases, pins, node loss."""

from __future__ import annotations

import pytest

from hetserve.store.allocator import ExtentAllocator
from hetserve.store.pool.metadata import PoolMetadata
from hetserve.transfer.tcp import RequestError

KiB = 1024


def _meta(nodes: int = 2, capacity: int = 100 * KiB, **kw) -> PoolMetadata:
    meta = PoolMetadata(**kw)
    for i in range(nodes):
        meta.add_node(f"n{i}", {"segments": [{"capacity": capacity}]})
    return meta


def _put(
    meta: PoolMetadata,
    key: str,
    size: int = 10 * KiB,
    replicas: int = 1,
    pin: float = 0.0,
    now: float = 0.0,
):
    put_id, obj = meta.put_start(key, size, replicas, None, pin, now=now)
    meta.put_end(put_id, 123, now=now)
    meta.check_integrity()
    return obj


def test_allocator_coalesces():
    a = ExtentAllocator(0, 1024)
    offs = [a.alloc(100) for _ in range(8)]
    assert None not in offs and a.alloc(600) is None
    for off in offs:
        a.free(off, 100)
        a.check_integrity()
    assert a.used == 0 and a.largest_free() == 1024


def test_replicas_on_distinct_nodes_and_preferred_first():
    meta = _meta(3)
    obj = _put(meta, "k", replicas=3)
    assert sorted(r.node for r in obj.replicas) == ["n0", "n1", "n2"]
    put_id, obj = meta.put_start("p", 10, 1, "n2", 0.0, now=0)
    assert obj.replicas[0].node == "n2"
    assert len(_put(_meta(1), "k", replicas=2).replicas) == 1  # capped by the nodes there are


def test_watermark_eviction_is_lru_and_skips_pinned_and_leased():
    meta = _meta(1, high=0.9, low=0.5)
    _put(meta, "pinned", pin=float("inf"))
    for i in range(8):
        _put(meta, f"k{i}")
    meta.locate("k0", now=0.0)  # read: most recently used, and leased until 5.0
    _put(meta, "k8", now=1.0)  # 100 KiB: above the high mark -> evict down to the low mark
    used, cap = meta.usage()
    assert used <= 0.5 * cap
    assert "pinned" in meta.objects and "k0" in meta.objects and "k8" in meta.objects
    assert "k1" not in meta.objects


def test_full_of_leases_is_a_capacity_error_and_pins_go_last():
    meta = _meta(1, capacity=40 * KiB, high=1.0, low=1.0)
    for i in range(4):
        _put(meta, f"k{i}")
        meta.locate(f"k{i}", now=0.0)
    with pytest.raises(RequestError) as err:
        meta.put_start("x", 10 * KiB, 1, None, 0.0, now=1.0)
    assert err.value.code == "capacity"
    meta = _meta(1, capacity=40 * KiB, high=1.0, low=1.0)
    for i in range(4):
        _put(meta, f"k{i}", pin=float("inf"))
    _put(meta, "x", now=10.0)  # only pinned objects left: they are evicted rather than fail
    assert "x" in meta.objects and "k0" not in meta.objects


def test_too_large_and_no_nodes():
    with pytest.raises(RequestError, match="no store nodes"):
        PoolMetadata().put_start("k", 1, 1, None, 0.0)
    with pytest.raises(RequestError) as err:
        _meta(2).put_start("k", 200 * KiB, 1, None, 0.0)
    assert err.value.code == "too_large"


def test_dead_node_takes_its_replicas_and_leased_space_waits():
    meta = _meta(2)
    _put(meta, "one", replicas=1)
    _put(meta, "two", replicas=2)
    lost = meta.objects["one"].replicas[0].node
    meta.locate("two", now=0.0)
    assert meta.remove("two", now=1.0)  # leased: space is held until 5.0
    assert meta.released
    meta.drop_node(lost)
    meta.check_integrity()
    assert "one" not in meta.objects
    assert meta.reap(node_timeout=1e9, now=6.0) == [] and not meta.released
    meta.check_integrity()


def test_abandoned_put_is_freed():
    meta = _meta(1)
    meta.put_start("k", 10 * KiB, 1, None, 0.0, now=0.0)
    assert meta.usage()[0] > 0
    meta.reap(node_timeout=1e9, now=100.0)
    assert meta.usage()[0] == 0 and not meta.pending
    with pytest.raises(RequestError):
        meta.put_end(1, 0)


def test_a_soft_pin_with_a_ttl_protects_only_until_then():
    meta = _meta(1)
    _put(meta, "session", pin=5.0, now=0.0)
    _put(meta, "plain", now=0.0)
    # While the pin lasts the plain object goes first; after it, the pinned one is plain LRU.
    assert meta._evict_one(now=1.0, allow_pinned=False) and "session" in meta.objects
    _put(meta, "plain2", now=1.0)
    assert meta._evict_one(now=10.0, allow_pinned=False) and "session" not in meta.objects
    meta.check_integrity()
