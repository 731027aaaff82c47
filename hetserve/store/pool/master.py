"""`hetserve store master`: the pool's metadata service.

Nodes register over a connection they keep open and heartbeat on; the master drops a node (and
the replicas it held) when that connection closes or its heartbeats stop. Clients ask it where
to write (PUT_START), commit with the value's digest (PUT_END), and where to read (LOCATE); the
bytes never pass through the master. State is in memory only: a restarted master starts empty,
nodes re-register within a heartbeat, and the objects of before are misses.
"""

from __future__ import annotations

import logging
import threading
import time

from hetserve.store.api import DEFAULT_MAX_VALUE
from hetserve.store.pool import protocol as P
from hetserve.store.pool.metadata import Obj, PoolMetadata
from hetserve.transfer.tcp import Data, FrameServer, Handler, Meta, Reply, RequestError

log = logging.getLogger(__name__)


class PoolMaster:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = P.DEFAULT_PORT,
        token: str = "",
        node_timeout: float = 3.0,
        max_value: int = DEFAULT_MAX_VALUE,
        watermarks: tuple[float, float] = (0.9, 0.8),
    ) -> None:
        P.require_token(host, token)
        self.meta = PoolMetadata(high=watermarks[0], low=watermarks[1])
        self.node_timeout, self.max_value = node_timeout, max_value
        self._lock = threading.Lock()
        self._owners: dict[str, Meta] = {}  # node id -> the session that registered it
        self._stop = threading.Event()
        handlers: dict[int, Handler] = {
            P.REGISTER: self._register,
            P.HEARTBEAT: self._heartbeat,
            P.UNREGISTER: self._unregister,
            P.PUT_START: self._put_start,
            P.PUT_END: self._put_end,
            P.PUT_ABORT: self._put_abort,
            P.LOCATE: self._locate,
            P.EXISTS: self._exists,
            P.REMOVE: self._remove,
            P.STATS: self._stats,
            P.NODES: self._nodes,
        }
        self.server = FrameServer(host, port, token, handlers, max_data=0, on_close=self._closed)
        self.port = self.server.port
        self._reaper = threading.Thread(target=self._reap_loop, daemon=True)

    def start(self) -> PoolMaster:
        self.server.start()
        self._reaper.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self.server.close()

    def _reap_loop(self) -> None:
        while not self._stop.wait(min(0.25, self.node_timeout / 4)):
            with self._lock:
                for node_id in self.meta.reap(self.node_timeout):
                    log.warning("node %s missed its heartbeats; dropped with its objects", node_id)

    # -- nodes ----------------------------------------------------------------------------
    def _register(self, session: Meta, meta: Meta, _data: Data) -> Reply:
        node_id, info = str(meta["node_id"]), meta["info"]
        for seg in P.want_list(info["segments"], "segments", 16):
            P.want_int(seg["capacity"], 1, 1 << 44, "segment capacity")
        with self._lock:
            self.meta.add_node(node_id, info)
            # The connection that registered a node owns it: when an older connection of the
            # same node closes late (after a re-register), it must not drop the new one.
            self._owners[node_id] = session
        session["node_id"] = node_id
        log.info("node %s joined at %s:%s", node_id, info.get("host"), info.get("port"))
        return {"node_timeout": self.node_timeout}, None

    def _heartbeat(self, session: Meta, _meta: Meta, _data: Data) -> Reply:
        with self._lock:
            node = self.meta.nodes.get(session.get("node_id", ""))
            if node is None:
                raise RequestError("unknown node; register again", "unknown_node")
            node.last_seen = time.monotonic()
        return {}, None

    def _unregister(self, session: Meta, _meta: Meta, _data: Data) -> Reply:
        self._closed(session)
        session.clear()
        return {}, None

    def _closed(self, session: Meta) -> None:
        node_id = session.get("node_id")
        with self._lock:
            if node_id is None or self._owners.get(node_id) is not session:
                return
            del self._owners[node_id]
            self.meta.drop_node(node_id)
        log.info("node %s left; its objects are gone", node_id)

    # -- objects --------------------------------------------------------------------------
    def _put_start(self, _s: Meta, meta: Meta, _data: Data) -> Reply:
        puts = P.want_list(meta["puts"], "puts")
        replica_num = P.want_int(meta.get("replica_num", 1), 1, 16, "replica_num")
        preferred = meta.get("preferred")
        pin_s = 0.0
        if meta.get("soft_pin", False):  # pinned for pin_ttl seconds, or for good without one
            ttl = meta.get("pin_ttl")
            pin_s = float("inf") if ttl is None else P.want_float(ttl, 0.0, 1e9, "pin_ttl")
        out: list[Meta] = []
        nodes: set[str] = set()
        for item in puts:
            key = P.want_key(item["key"])
            size = P.want_int(item["size"], 0, 1 << 62, "size")
            if size > self.max_value:
                out.append(
                    {"error": f"{size} B exceeds max_value {self.max_value}", "code": "too_large"}
                )
                continue
            try:
                with self._lock:
                    put_id, obj = self.meta.put_start(key, size, replica_num, preferred, pin_s)
            except RequestError as exc:
                out.append({"error": str(exc), "code": exc.code})
                continue
            out.append({"id": put_id, "replicas": _replicas(obj)})
            nodes.update(r.node for r in obj.replicas)
        with self._lock:
            infos = self._node_infos(nodes)
        return {"puts": out, "nodes": infos}, None

    def _put_end(self, _s: Meta, meta: Meta, _data: Data) -> Reply:
        results: list[str | None] = []
        for item in P.want_list(meta["puts"], "puts"):
            put_id = P.want_int(item["id"], 0, 1 << 62, "id")
            digest = P.want_int(item["digest"], 0, (1 << 64) - 1, "digest")
            try:
                with self._lock:
                    self.meta.put_end(put_id, digest)
                results.append(None)
            except RequestError as exc:
                results.append(exc.code)
        return {"results": results}, None

    def _put_abort(self, _s: Meta, meta: Meta, _data: Data) -> Reply:
        with self._lock:
            for put_id in P.want_list(meta["ids"], "ids"):
                self.meta.put_abort(P.want_int(put_id, 0, 1 << 62, "id"))
        return {}, None

    def _locate(self, _s: Meta, meta: Meta, _data: Data) -> Reply:
        keys = [P.want_key(k) for k in P.want_list(meta["keys"], "keys")]
        found: list[Meta | None] = []
        nodes: set[str] = set()
        with self._lock:
            for key in keys:
                obj = self.meta.locate(key)
                if obj is None:
                    found.append(None)
                    continue
                found.append({"size": obj.size, "digest": obj.digest, "replicas": _replicas(obj)})
                nodes.update(r.node for r in obj.replicas)
            infos = self._node_infos(nodes)
            epoch = self.meta.epoch
        return {"objects": found, "nodes": infos, "epoch": epoch}, None

    def _exists(self, _s: Meta, meta: Meta, _data: Data) -> Reply:
        """The length of the present prefix; with "where", also each of those keys' replica
        nodes and the nodes' infos (a client tells which it maps). Unlike LOCATE, no lease."""
        keys = [P.want_key(k) for k in P.want_list(meta["keys"], "keys")]
        with self._lock:
            n = next((i for i, k in enumerate(keys) if k not in self.meta.objects), len(keys))
            if not meta.get("where"):
                return {"prefix": n}, None
            where = [[r.node for r in self.meta.objects[k].replicas] for k in keys[:n]]
            infos = self._node_infos({node for nodes in where for node in nodes})
        return {"prefix": n, "where": where, "nodes": infos}, None

    def _remove(self, _s: Meta, meta: Meta, _data: Data) -> Reply:
        key = P.want_key(meta["key"])
        with self._lock:
            return {"removed": self.meta.remove(key)}, None

    def _stats(self, _s: Meta, _meta: Meta, _data: Data) -> Reply:
        with self._lock:
            used, cap = self.meta.usage()
            self.meta.check_integrity()
            per_node = {
                n.node_id: [sum(a.used for a in n.allocs), sum(a.capacity for a in n.allocs)]
                for n in self.meta.nodes.values()
            }
            return {
                "used": used,
                "capacity": cap,
                "objects": len(self.meta.objects),
                "nodes": sorted(self.meta.nodes),
                "epoch": self.meta.epoch,
                "per_node": per_node,
                "node_infos": self._node_infos(set(per_node)),
            }, None

    def _nodes(self, _s: Meta, _meta: Meta, _data: Data) -> Reply:
        with self._lock:
            return {"nodes": sorted(self.meta.nodes), "epoch": self.meta.epoch}, None

    def _node_infos(self, ids: set[str]) -> dict[str, Meta]:
        return {i: self.meta.nodes[i].info for i in ids if i in self.meta.nodes}


def _replicas(obj: Obj) -> list[list[str | int]]:
    return [[r.node, r.segment, r.offset] for r in obj.replicas]
