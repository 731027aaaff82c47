"""The pool master's state: nodes and their segments, objects and their replicas, eviction.

Pure bookkeeping (no sockets), serialized by the master's lock. Space moves through three states:
pending (allocated to a put in flight), live (an object's replica), and released (waiting for the
read leases on it to expire before it can be reused). Eviction is LRU between the watermarks and
skips leased and soft-pinned objects while others remain.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hetserve.store.allocator import ExtentAllocator, aligned
from hetserve.transfer.shm import HEADER_BYTES
from hetserve.transfer.tcp import RequestError

K = TypeVar("K")


@dataclass
class Replica:
    node: str
    segment: int
    offset: int


@dataclass
class Obj:
    key: str
    size: int
    replicas: list[Replica]
    pin_until: float = 0.0  # soft-pinned (evicted only when nothing else is left) until then
    digest: int | None = None  # known once the put commits
    lease_until: float = 0.0
    deadline: float = 0.0  # pending puts only: abandoned after this


@dataclass
class Node:
    node_id: str
    info: dict[str, Any]  # as clients need it: host, port, pid, host_id, segments
    allocs: list[ExtentAllocator]
    last_seen: float = field(default_factory=time.monotonic)


class PoolMetadata:
    def __init__(self, high: float = 0.9, low: float = 0.8, lease_s: float = 5.0) -> None:
        assert 0 < low <= high <= 1
        self.high, self.low, self.lease_s = high, low, lease_s
        self.nodes: dict[str, Node] = {}
        self.objects: OrderedDict[str, Obj] = OrderedDict()  # LRU first
        self.pending: dict[int, Obj] = {}
        self.released: list[tuple[float, list[Replica], int]] = []  # (reusable at, replicas, size)
        self.epoch = 0  # bumps when membership changes; clients refresh their node table
        self._ids = itertools.count(1)

    # -- membership -----------------------------------------------------------------------
    def add_node(self, node_id: str, info: dict[str, Any]) -> None:
        self.drop_node(node_id)  # a re-registering node starts empty
        sizes = [int(s["capacity"]) for s in info["segments"]]
        self.nodes[node_id] = Node(node_id, info, [ExtentAllocator(HEADER_BYTES, n) for n in sizes])
        self.epoch += 1

    def drop_node(self, node_id: str) -> None:
        """Forget a dead or departed node and every replica it held."""
        if self.nodes.pop(node_id, None) is None:
            return
        self.epoch += 1
        _drop_replicas(self.objects, node_id)
        _drop_replicas(self.pending, node_id)
        self.released = [
            (t, [r for r in reps if r.node != node_id], n) for t, reps, n in self.released
        ]

    def reap(self, node_timeout: float, now: float | None = None) -> list[str]:
        """Drop nodes silent for longer than `node_timeout`; free expired space."""
        now = time.monotonic() if now is None else now
        dead = [n.node_id for n in self.nodes.values() if now - n.last_seen > node_timeout]
        for node_id in dead:
            self.drop_node(node_id)
        self._collect(now)
        return dead

    # -- puts -----------------------------------------------------------------------------
    def put_start(
        self,
        key: str,
        size: int,
        replica_num: int,
        preferred: str | None,
        pin_s: float,
        now: float | None = None,
    ) -> tuple[int, Obj]:
        """Reserve room for a put; `pin_s` > 0 soft-pins the object that long (inf: for good)."""
        now = time.monotonic() if now is None else now
        if not self.nodes:
            raise RequestError("no store nodes are registered", "no_nodes")
        if size > max(a.capacity for n in self.nodes.values() for a in n.allocs):
            raise RequestError(f"value of {size} bytes exceeds every segment", "too_large")
        self._collect(now)
        want = min(replica_num, len(self.nodes))
        while (replicas := self._place(size, want, preferred)) is None:
            if not self._evict_one(now, allow_pinned=True):
                raise RequestError(f"no room for {size} bytes: the rest is leased", "capacity")
        put_id = next(self._ids)
        pin_until = now + pin_s if pin_s > 0 else 0.0
        self.pending[put_id] = Obj(key, size, replicas, pin_until, deadline=now + 60.0)
        self._evict_to_watermark(now)
        return put_id, self.pending[put_id]

    def _place(self, size: int, want: int, preferred: str | None) -> list[Replica] | None:
        """One replica on each of `want` distinct nodes, preferred first, then the emptiest."""
        order = sorted(self.nodes.values(), key=lambda n: (n.node_id != preferred, _used(n)))
        replicas: list[Replica] = []
        for node in order:
            for seg, alloc in enumerate(node.allocs):  # DRAM segments are listed first
                off = alloc.alloc(size)
                if off is not None:
                    replicas.append(Replica(node.node_id, seg, off))
                    break
            if len(replicas) == want:
                return replicas
        self._free(replicas, size)
        return None

    def put_end(self, put_id: int, digest: int, now: float | None = None) -> None:
        obj = self.pending.pop(put_id, None)
        if obj is None:
            raise RequestError("the put was abandoned or its nodes died", "lost")
        now = time.monotonic() if now is None else now
        old = self.objects.pop(obj.key, None)
        if old is not None:
            self._release(old, now)
        obj.digest = digest
        self.objects[obj.key] = obj

    def put_abort(self, put_id: int) -> None:
        obj = self.pending.pop(put_id, None)
        if obj is not None:
            self._free(obj.replicas, obj.size)

    # -- reads and removal ----------------------------------------------------------------
    def locate(self, key: str, now: float | None = None) -> Obj | None:
        """The object, leased for reading (its space is not reused until the lease ends)."""
        obj = self.objects.get(key)
        if obj is not None:
            now = time.monotonic() if now is None else now
            obj.lease_until = now + self.lease_s
            self.objects.move_to_end(key)
        return obj

    def remove(self, key: str, now: float | None = None) -> bool:
        obj = self.objects.pop(key, None)
        if obj is not None:
            self._release(obj, time.monotonic() if now is None else now)
        return obj is not None

    # -- space ----------------------------------------------------------------------------
    def usage(self) -> tuple[int, int]:
        used = sum(a.used for n in self.nodes.values() for a in n.allocs)
        return used, sum(a.capacity for n in self.nodes.values() for a in n.allocs)

    def _evict_one(self, now: float, allow_pinned: bool) -> bool:
        victim = next(
            (o for o in self.objects.values() if o.lease_until <= now and o.pin_until <= now),
            None,
        )
        if victim is None and allow_pinned:
            victim = next((o for o in self.objects.values() if o.lease_until <= now), None)
        if victim is None:
            return False
        del self.objects[victim.key]
        self._free(victim.replicas, victim.size)
        return True

    def _evict_to_watermark(self, now: float) -> None:
        used, cap = self.usage()
        if used <= self.high * cap:
            return
        while used > self.low * cap and self._evict_one(now, allow_pinned=False):
            used, cap = self.usage()

    def _release(self, obj: Obj, now: float) -> None:
        if obj.lease_until > now:  # a reader may be copying it right now
            self.released.append((obj.lease_until, obj.replicas, obj.size))
        else:
            self._free(obj.replicas, obj.size)

    def _collect(self, now: float) -> None:
        keep = []
        for t, reps, size in self.released:
            if t <= now:
                self._free(reps, size)
            else:
                keep.append((t, reps, size))
        self.released = keep
        for put_id in [i for i, o in self.pending.items() if o.deadline <= now]:
            self.put_abort(put_id)

    def _free(self, replicas: list[Replica], size: int) -> None:
        for r in replicas:
            node = self.nodes.get(r.node)
            if node is not None:
                node.allocs[r.segment].free(r.offset, size)

    def check_integrity(self) -> None:
        spans: dict[tuple[str, int], list[tuple[int, int]]] = {}
        holders = list(self.objects.values()) + list(self.pending.values())
        for obj in holders:
            assert len({r.node for r in obj.replicas}) == len(obj.replicas), "replicas share a node"
        entries = [(o.replicas, o.size) for o in holders] + [(r, n) for _, r, n in self.released]
        for replicas, size in entries:
            for r in replicas:
                assert r.node in self.nodes, f"replica on unknown node {r.node}"
                spans.setdefault((r.node, r.segment), []).append((r.offset, aligned(size)))
        for node in self.nodes.values():
            for seg, alloc in enumerate(node.allocs):
                alloc.check_integrity()
                mine = sorted(spans.get((node.node_id, seg), []))
                assert sum(n for _, n in mine) == alloc.used, "allocator and objects disagree"
                for (a, n), (b, _) in itertools.pairwise(mine):
                    assert a + n <= b, "two replicas overlap"


def _drop_replicas(table: MutableMapping[K, Obj], node_id: str) -> None:
    """Forget the replicas on `node_id`, and the objects left with none."""
    for k, obj in list(table.items()):
        obj.replicas = [r for r in obj.replicas if r.node != node_id]
        if not obj.replicas:
            del table[k]


def _used(node: Node) -> float:
    return sum(a.used for a in node.allocs) / max(1, sum(a.capacity for a in node.allocs))
