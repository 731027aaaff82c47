"""`pool://host:port?token=..&shm=1&timeout=30&reconnect=5`: the client of hetserve's pool.

Metadata goes to the master (one round trip per batch); bytes go directly to and from the nodes
holding the replicas, one pipelined batch per node and nodes in parallel. A read tries another
replica when one fails (dead node, digest mismatch); a put whose node dies mid-write is retried
once on fresh space. Master calls retry for `reconnect` seconds (a restarting master), then raise
StoreUnavailableError.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from hetserve.store.api import (
    DEFAULT_MAX_VALUE,
    Buffer,
    BufferTooSmallError,
    InvalidInputError,
    InvalidKeyError,
    Key,
    KVStore,
    ReplicateConfig,
    StoreCapacityError,
    StoreUnavailableError,
    ValueTooLargeError,
    as_memoryview,
    normalize_key,
)
from hetserve.store.pool import protocol as P
from hetserve.store.pool.links import TRANSPORT_ERRORS, ConnPool, NodeLink, Transfer
from hetserve.store.registry import StoreSpec, register_backend
from hetserve.transfer.tcp import FrameClient, RemoteError

_ERRORS = {
    "capacity": StoreCapacityError,
    "too_large": ValueTooLargeError,
    "bad_key": InvalidKeyError,
    "no_nodes": StoreUnavailableError,
}


@register_backend("pool")
class PoolStore(KVStore):
    def __init__(self, spec: StoreSpec) -> None:
        self.addr = (spec.host or "127.0.0.1", spec.port or P.DEFAULT_PORT)
        self.token = spec.token()
        self.use_shm = spec.params.get("shm", "1") != "0"
        self.timeout = spec.number("timeout", 30.0)
        self.reconnect = spec.number("reconnect", 5.0)
        self.max_value = spec.size("max_value", DEFAULT_MAX_VALUE)
        self._master = ConnPool(lambda: FrameClient(*self.addr, self.token, self.timeout))
        self._links: dict[str, NodeLink] = {}
        self._epoch = -1
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="pool-io")
        self._call(P.NODES, {})  # fail fast on a wrong address or token

    # -- master ---------------------------------------------------------------------------
    def _call(self, op: int, meta: dict) -> dict:
        deadline = time.monotonic() + self.reconnect
        while True:
            try:
                conn = self._master.take()
            except RemoteError as exc:
                raise StoreUnavailableError(f"the pool master refused us: {exc}") from None
            except TRANSPORT_ERRORS as exc:
                if time.monotonic() > deadline:
                    msg = f"pool master {self.addr} unreachable: {exc}"
                    raise StoreUnavailableError(msg) from None
                time.sleep(0.1)
                continue
            try:
                reply, _ = conn.call(op, meta)
            except RemoteError as exc:  # an answer: the connection stays good
                self._master.give(conn)
                raise _ERRORS.get(exc.code, StoreUnavailableError)(str(exc)) from exc
            except TRANSPORT_ERRORS:
                conn.close()  # a restarting master: reconnect and ask again
                if time.monotonic() > deadline:
                    raise StoreUnavailableError(f"pool master {self.addr} unreachable") from None
                continue
            self._master.give(conn)
            return reply

    def _links_for(self, infos: dict[str, dict], epoch: int | None = None) -> None:
        with self._lock:
            for node_id, info in infos.items():
                link = self._links.get(node_id)
                if link is None or link.info != info:  # new, or re-registered elsewhere
                    if link is not None:
                        link.close()
                    self._links[node_id] = NodeLink(info, self.token, self.use_shm, self.timeout)
            stale_epoch = epoch is not None and epoch != self._epoch
        if stale_epoch:  # membership changed: unmap nodes that are gone
            alive = set(self._call(P.NODES, {})["nodes"])
            with self._lock:
                for node_id in [n for n in self._links if n not in alive]:
                    self._links.pop(node_id).close()
                self._epoch = epoch

    def _run_per_node(self, fn_name: str, groups: dict[str, list[Transfer]]) -> dict[int, bool]:
        """Run link.read or link.write on each node's batch, nodes in parallel; the result maps
        id(transfer) -> success."""

        def one(node_id: str) -> list[tuple[int, bool]]:
            link = self._links.get(node_id)
            items = groups[node_id]
            done = getattr(link, fn_name)(items) if link is not None else [False] * len(items)
            return [(id(t), ok) for t, ok in zip(items, done, strict=True)]

        if len(groups) == 1:
            results = [one(next(iter(groups)))]
        else:
            results = list(self._pool.map(one, list(groups)))
        return {i: ok for batch in results for i, ok in batch}

    # -- writes ---------------------------------------------------------------------------
    def put_from(self, key: Key, buffer: Buffer, config: ReplicateConfig | None = None) -> None:
        self.batch_put_from([key], [buffer], config)

    def batch_put_from(
        self, keys: Sequence[Key], buffers: Sequence[Buffer], config: ReplicateConfig | None = None
    ) -> None:
        if len(keys) != len(buffers):
            raise InvalidInputError(f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return
        names = [normalize_key(k) for k in keys]
        views = [as_memoryview(b) for b in buffers]
        for v in views:
            if len(v) > self.max_value:
                raise ValueTooLargeError(f"value of {len(v)} B exceeds max_value={self.max_value}")
        failed = self._put_once(names, views, config or ReplicateConfig())
        if failed:  # a node died under the write: once more, on fresh space
            failed = self._put_once(
                [names[i] for i in failed], [views[i] for i in failed], config or ReplicateConfig()
            )
            if failed:
                raise StoreUnavailableError(f"{len(failed)} puts failed: their nodes died")

    def _put_once(self, names: list[str], views: list[memoryview], cfg: ReplicateConfig):
        reply = self._call(
            P.PUT_START,
            {
                "puts": [{"key": k, "size": len(v)} for k, v in zip(names, views, strict=True)],
                "replica_num": cfg.replica_num,
                "preferred": cfg.preferred_segment,
                "soft_pin": cfg.soft_pin,
            },
        )
        self._links_for(reply["nodes"])
        groups: dict[str, list[Transfer]] = defaultdict(list)
        per_put: list[list[Transfer]] = []
        error = None
        for i, put in enumerate(reply["puts"]):
            if "error" in put:
                error = error or _ERRORS.get(put["code"], StoreUnavailableError)(put["error"])
                per_put.append([])
                continue
            ts = [Transfer(i, seg, off, len(views[i]), views[i]) for _, seg, off in put["replicas"]]
            for (node, _, _), t in zip(put["replicas"], ts, strict=True):
                groups[node].append(t)
            per_put.append(ts)
        ok = self._run_per_node("write", groups) if groups else {}
        ends, end_index, aborts, failed = [], [], [], []
        for i, (put, ts) in enumerate(zip(reply["puts"], per_put, strict=True)):
            if not ts:
                continue
            if all(ok.get(id(t)) for t in ts) and len({t.digest for t in ts}) == 1:
                ends.append({"id": put["id"], "digest": ts[0].digest})
                end_index.append(i)
            else:
                aborts.append(put["id"])
                failed.append(i)
        if aborts:
            self._call(P.PUT_ABORT, {"ids": aborts})
        if ends:
            results = self._call(P.PUT_END, {"puts": ends})["results"]
            failed += [i for i, r in zip(end_index, results, strict=True) if r is not None]
        if error is not None:
            raise error
        return failed

    # -- reads ----------------------------------------------------------------------------
    def get_into(self, key: Key, buffer: Buffer) -> int | None:
        return self.batch_get_into([key], [buffer])[0]

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Buffer]) -> list[int | None]:
        if len(keys) != len(buffers):
            raise InvalidInputError(f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        names = [normalize_key(k) for k in keys]
        views = [as_memoryview(b, writable=True) for b in buffers]
        reply = self._call(P.LOCATE, {"keys": names})
        for obj, view in zip(reply["objects"], views, strict=True):
            if obj is not None and obj["size"] > len(view):
                raise BufferTooSmallError(f"buffer of {len(view)} B < value of {obj['size']} B")
        return self._read(reply, views)

    def _read(self, reply: dict, views: list[memoryview]) -> list[int | None]:
        """Fetch located objects into `views`, trying the next replica where one fails."""
        self._links_for(reply["nodes"], reply["epoch"])
        objects = reply["objects"]
        result: list[int | None] = [None] * len(objects)
        todo = [i for i, o in enumerate(objects) if o is not None]
        for attempt in range(max((len(o["replicas"]) for o in objects if o), default=0)):
            groups: dict[str, list[Transfer]] = defaultdict(list)
            for i in todo:
                reps = self._replica_order(objects[i]["replicas"])
                if attempt < len(reps):
                    node, seg, off = reps[attempt]
                    t = Transfer(i, seg, off, objects[i]["size"], views[i], objects[i]["digest"])
                    groups[node].append(t)
            if not groups:
                break
            ok = self._run_per_node("read", groups)
            for ts in groups.values():
                for t in ts:
                    if ok[id(t)]:
                        result[t.index] = t.size
            todo = [i for i in todo if result[i] is None]
        return result

    def _replica_order(self, replicas: list[list]) -> list[list]:
        """Replicas this host can map first: a memcpy beats any socket."""
        return sorted(
            replicas, key=lambda r: self._links.get(r[0]) is None or self._links[r[0]].views is None
        )

    def get(self, key: Key) -> bytes | None:
        reply = self._call(P.LOCATE, {"keys": [normalize_key(key)]})
        obj = reply["objects"][0]
        if obj is None:
            return None
        out = bytearray(obj["size"])
        return bytes(out) if self._read(reply, [memoryview(out)])[0] is not None else None

    # -- the rest -------------------------------------------------------------------------
    def exists(self, key: Key) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: Sequence[Key]) -> int:
        if not keys:
            return 0
        return self._call(P.EXISTS, {"keys": [normalize_key(k) for k in keys]})["prefix"]

    def remove(self, key: Key) -> bool:
        return self._call(P.REMOVE, {"key": normalize_key(key)})["removed"]

    def stats(self) -> dict:
        """Usage and membership; the master checks its invariants while answering."""
        return self._call(P.STATS, {})

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._master.close()
        with self._lock:
            for link in self._links.values():
                link.close()
            self._links.clear()
