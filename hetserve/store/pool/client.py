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
from typing import Any

from hetserve.store.api import (
    DEFAULT_MAX_VALUE,
    TIER_POOL,
    TIER_POOL_SHM,
    InvalidKeyError,
    Key,
    KVStore,
    Parts,
    ReplicateConfig,
    StoreCapacityError,
    StoreError,
    StoreUnavailableError,
    TierInfo,
    ValueTooLargeError,
    fit_parts,
    normalize_key,
)
from hetserve.store.pool import protocol as P
from hetserve.store.pool.links import TRANSPORT_ERRORS, ConnPool, NodeLink, Transfer
from hetserve.store.registry import StoreSpec, register_backend
from hetserve.transfer.tcp import FrameClient, Meta, RemoteError

Replica = list[Any]  # [node id, segment, offset] as the master sends it
_ERRORS: dict[str, type[StoreError]] = {
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
    def _call(self, op: int, meta: Meta) -> Meta:
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

    def _links_for(self, infos: dict[str, Meta], epoch: int | None = None) -> None:
        with self._lock:
            for node_id, info in infos.items():
                link = self._links.get(node_id)
                if link is None or link.info != info:  # new, or re-registered elsewhere
                    if link is not None:
                        link.close()
                    self._links[node_id] = NodeLink(info, self.token, self.use_shm, self.timeout)
            stale = epoch != self._epoch
        if epoch is not None and stale:  # membership changed: unmap nodes that are gone
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
    def _put(self, names: list[str], values: list[Parts], config: ReplicateConfig) -> None:
        sizes = [sum(p.nbytes for p in parts) for parts in values]
        for n in sizes:
            if n > self.max_value:
                raise ValueTooLargeError(f"value of {n} B exceeds max_value={self.max_value}")
        failed = self._put_once(names, values, sizes, config)
        if failed:  # a node died under the write: once more, on fresh space
            failed = self._put_once(
                [names[i] for i in failed],
                [values[i] for i in failed],
                [sizes[i] for i in failed],
                config,
            )
            if failed:
                raise StoreUnavailableError(f"{len(failed)} puts failed: their nodes died")

    def _put_once(
        self, names: list[str], values: list[Parts], sizes: list[int], cfg: ReplicateConfig
    ) -> list[int]:
        """One attempt at the batch; the indices of puts whose node died under them."""
        reply = self._call(
            P.PUT_START,
            {
                "puts": [{"key": k, "size": n} for k, n in zip(names, sizes, strict=True)],
                "replica_num": cfg.replica_num,
                "preferred": cfg.preferred_segment,
                "soft_pin": cfg.soft_pin,
                "pin_ttl": cfg.soft_pin_ttl_s,
            },
        )
        self._links_for(reply["nodes"])
        groups: dict[str, list[Transfer]] = defaultdict(list)
        per_put: list[list[Transfer]] = []
        error: StoreError | None = None
        for i, put in enumerate(reply["puts"]):
            if "error" in put:
                error = error or _ERRORS.get(put["code"], StoreUnavailableError)(put["error"])
                per_put.append([])
                continue
            ts = [Transfer(i, seg, off, sizes[i], values[i]) for _, seg, off in put["replicas"]]
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
    def _get_into(self, names: list[str], dests: list[Parts], exact: bool) -> list[int | None]:
        reply = self._call(P.LOCATE, {"keys": names})
        # Cut every destination before reading any: a caller's size error leaves nothing half
        # read.
        cut = [
            None if obj is None else fit_parts(dest, obj["size"], exact, name)
            for obj, dest, name in zip(reply["objects"], dests, names, strict=True)
        ]
        return self._read(reply, cut)

    def _read(self, reply: Meta, dests: list[Parts | None]) -> list[int | None]:
        """Fetch located objects into `dests`, trying the next replica where one fails."""
        self._links_for(reply["nodes"], reply["epoch"])
        objects = reply["objects"]
        result: list[int | None] = [None] * len(objects)
        todo = [i for i, o in enumerate(objects) if o is not None]
        for attempt in range(max((len(o["replicas"]) for o in objects if o), default=0)):
            groups: dict[str, list[Transfer]] = defaultdict(list)
            for i in todo:
                reps = self._replica_order(objects[i]["replicas"])
                dest = dests[i]
                if attempt < len(reps) and dest is not None:
                    node, seg, off = reps[attempt]
                    size, value_digest = objects[i]["size"], objects[i]["digest"]
                    groups[node].append(Transfer(i, seg, off, size, dest, value_digest))
            if not groups:
                break
            ok = self._run_per_node("read", groups)
            for ts in groups.values():
                for t in ts:
                    if ok[id(t)]:
                        result[t.index] = t.size
            todo = [i for i in todo if result[i] is None]
        return result

    def _mapped(self, node_id: str) -> bool:
        link = self._links.get(node_id)
        return link is not None and link.shm

    def _replica_order(self, replicas: list[Replica]) -> list[Replica]:
        """Replicas this host can map first: a memcpy beats any socket."""
        return sorted(replicas, key=lambda r: not self._mapped(r[0]))

    def get(self, key: Key) -> bytes | None:
        reply = self._call(P.LOCATE, {"keys": [normalize_key(key)]})
        obj = reply["objects"][0]
        if obj is None:
            return None
        out = bytearray(obj["size"])
        got = self._read(reply, [[memoryview(out)]])[0]
        return bytes(out) if got is not None else None

    # -- the rest -------------------------------------------------------------------------
    def exists(self, key: Key) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: Sequence[Key]) -> int:
        if not keys:
            return 0
        return int(self._call(P.EXISTS, {"keys": [normalize_key(k) for k in keys]})["prefix"])

    def remove(self, key: Key) -> bool:
        return bool(self._call(P.REMOVE, {"key": normalize_key(key)})["removed"])

    def batch_locate(self, keys: Sequence[Key]) -> list[str | None]:
        names = [normalize_key(k) for k in keys]
        if not names:
            return []
        reply = self._call(P.EXISTS, {"keys": names, "where": True})
        self._links_for(reply["nodes"])
        tiers: list[str | None] = [
            TIER_POOL_SHM if any(self._mapped(n) for n in nodes) else TIER_POOL
            for nodes in reply["where"]
        ]
        return tiers + [None] * (len(names) - len(tiers))

    def tiers(self) -> list[TierInfo]:
        """ "pool-shm": the nodes this host maps; "pool": the others (with no node at all,
        "pool" alone, empty)."""
        stats = self.stats()
        self._links_for(stats["node_infos"])
        usage: dict[str, list[int]] = {}
        for node_id, (used, capacity) in stats["per_node"].items():
            row = usage.setdefault(TIER_POOL_SHM if self._mapped(node_id) else TIER_POOL, [0, 0])
            row[0] += used
            row[1] += capacity
        rows = sorted(usage.items()) or [(TIER_POOL, [0, 0])]
        return [TierInfo(name, cap, used, shared=True) for name, (used, cap) in rows]

    def stats(self) -> Meta:
        """Usage and membership; the master checks its invariants while answering."""
        return self._call(P.STATS, {})

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._master.close()
        with self._lock:
            for link in self._links.values():
                link.close()
            self._links.clear()
