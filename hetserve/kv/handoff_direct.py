"""The direct hand-off path: a prefill instance pushes a request's KV to the decode instance.

Who calls it: the engine's hand-off sender (`DirectPath.send`, on its worker thread) and, on a
decode instance, `engine/handoff.py`, which starts a `DirectReceiver` (a
`transfer.tcp.FrameServer`). On one host the sender maps the receiver's staging segment and
copies into it; otherwise the blocks go over TCP, striped over several connections, and a
connection that fails mid-way leaves its stripes to the others. OPEN gives a sender an extent
of staging, PUSH lands a stripe in it, COMMIT with the manifest checks every stripe came and
makes the hand-off an arrival (`handoff_paths.Arrivals`).

Failure contract: `send` raises (`HandoffError`, or the transport's errors) when the bytes did
not all arrive; a receiver never exposes a partial hand-off.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from hetserve.kv.handoff_paths import Arrival, Arrivals, Blocks, HandoffError, Manifest
from hetserve.transfer import shm
from hetserve.transfer.tcp import FrameClient, FrameServer, Handler, Meta, Reply, RequestError

log = logging.getLogger(__name__)

OPEN, PUSH, COMMIT = 10, 11, 12  # ops (transfer.tcp keeps 1-3 for itself)
STRIPE_BYTES = 8 << 20  # a stripe: enough to amortize a frame, small enough to spread
MAX_LINKS = 4


class DirectReceiver:
    """The decode side of the direct path: OPEN gives a sender an extent of staging (and, on
    the same host, the segment to map), PUSH lands a stripe in it, COMMIT with the manifest
    checks every stripe came and makes the hand-off an arrival."""

    name = "direct"

    def __init__(self, host: str, port: int, token: str, arrivals: Arrivals) -> None:
        self.arrivals = arrivals
        self.transfer_engine: dict[str, Any] | None = None  # set by handoff_mooncake
        self.keep_alive: object = None
        self._open: dict[str, tuple[int, int, set[int]]] = {}  # key -> offset, bytes, stripes
        self._lock = threading.Lock()
        handlers: dict[int, Handler] = {
            OPEN: self._on_open,
            PUSH: self._on_push,
            COMMIT: self._on_commit,
        }
        max_data = STRIPE_BYTES
        self.server = FrameServer(host, port, token, handlers, max_data, sink=self._sink)
        self.server.start()
        self.address = f"{host}:{self.server.port}"

    def _on_open(self, session: Meta, meta: Meta, data: memoryview | None) -> Reply:
        key, nbytes = str(meta["key"]), int(meta["bytes"])
        with self._lock:
            entry = self._open.get(key)
        if entry is None:
            offset = self.arrivals.staging.alloc(nbytes)
            if offset is None:
                raise RequestError(f"no staging room for {nbytes} bytes", "full")
            with self._lock:
                self._open[key] = entry = (offset, nbytes, set())
        reply: Meta = {"offset": entry[0]}
        if meta.get("host") == shm.host_id():
            reply["shm"] = self.arrivals.staging.info()
        if meta.get("te") and self.transfer_engine is not None:
            reply["te"] = self.transfer_engine  # Mooncake's: its session, the staging's address
        return reply, None

    def _sink(self, op: int, meta: Meta, nbytes: int) -> memoryview | None:
        if op != PUSH:
            return None
        with self._lock:
            entry = self._open.get(str(meta.get("key")))
        start = int(meta.get("at", -1))
        if entry is None or start < 0 or start + nbytes > entry[1]:
            return None  # lands in a scratch buffer; _on_push refuses it
        return self.arrivals.staging.view(entry[0] + start, nbytes)

    def _on_push(self, session: Meta, meta: Meta, data: memoryview | None) -> Reply:
        key, start = str(meta["key"]), int(meta["at"])
        with self._lock:
            entry = self._open.get(key)
            if entry is None or data is None or start + len(data) > entry[1]:
                raise RequestError(f"hand-off {key!r} is not open for these bytes", "bad_push")
            entry[2].add(start)
        return {}, None

    def _on_commit(self, session: Meta, meta: Meta, data: memoryview | None) -> Reply:
        m = Manifest.from_json(meta["manifest"])
        starts = {int(s) for s in meta["stripes"]}
        with self._lock:
            entry = self._open.get(m.key)
            if entry is None:
                raise RequestError(f"hand-off {m.key!r} was never opened", "bad_commit")
            offset, nbytes, got = entry
            if nbytes != m.nbytes or not starts <= got | set(meta.get("copied", [])):
                raise RequestError(f"hand-off {m.key!r}: stripes missing", "incomplete")
            del self._open[m.key]
        self.arrivals.put(Arrival(m, offset, self.name))
        return {}, None

    def close(self) -> None:
        self.server.close()


class DirectPath:
    """The prefill side of the direct path: one connection per link and peer, reused."""

    name = "direct"

    def __init__(self, token: str, links: int = 2, share_memory: bool = True) -> None:
        self.token, self.links = token, max(1, min(links, MAX_LINKS))
        self.share_memory = share_memory  # False: TCP even on one host (tests, benchmarks)
        self._pool = ThreadPoolExecutor(self.links, thread_name_prefix="hetserve-handoff-link")
        self._shm: dict[str, memoryview | None] = {}  # peer -> its mapped staging (same host)

    def send(self, manifest: Manifest, blocks: Blocks, peer: str) -> None:
        host, port = _split(peer)
        first = FrameClient(host, port, self.token)
        try:
            host_id = shm.host_id() if self.share_memory else None
            opening = {"key": manifest.key, "bytes": manifest.nbytes, "host": host_id}
            meta, _ = first.call(OPEN, opening)
            offset = int(meta["offset"])
            stripes = _stripes(manifest.bytes_per_block, len(blocks))
            mapped = self._map(peer, meta.get("shm"))
            control = first
            if mapped is not None:  # same host: copy straight into the receiver's staging
                for start, (i, j) in stripes:
                    _copy_into(mapped, offset + start, blocks[i:j])
                copied = [s for s, _ in stripes]
            else:
                control = self._push(host, port, first, manifest.key, stripes, blocks)
                copied = []
            commit = {"manifest": asdict(manifest), "stripes": [s for s, _ in stripes]}
            control.call(COMMIT, {**commit, "copied": copied})
            if control is not first:
                control.close()
        finally:
            first.close()

    def _map(self, peer: str, info: dict[str, Any] | None) -> memoryview | None:
        if info is None:
            return None
        if peer not in self._shm:
            self._shm[peer] = shm.attach(
                int(info["pid"]), int(info["fd"]), int(info["size"]), str(info["nonce"]), True
            )
        return self._shm[peer]

    def _push(
        self,
        host: str,
        port: int,
        first: FrameClient,
        key: str,
        stripes: list[tuple[int, tuple[int, int]]],
        blocks: Blocks,
    ) -> FrameClient:
        """Stripes spread over the links; a link that fails leaves its stripes to the others.
        Returns a live connection for the commit (a new one if every link failed at the end)."""
        todo = list(stripes)
        clients = [first] + [_connect(host, port, self.token) for _ in range(self.links - 1)]
        live = [c for c in clients if c is not None]
        try:
            while todo:
                share = [todo[k :: len(live)] for k in range(len(live))]
                futures = [
                    self._pool.submit(_push_all, c, key, part, blocks)
                    for c, part in zip(live, share, strict=True)
                ]
                todo, alive = [], []
                for c, fut in zip(live, futures, strict=True):
                    left = fut.result()
                    todo += left
                    if not left:
                        alive.append(c)
                if todo and not alive:
                    raise HandoffError(f"every link to {host}:{port} failed")
                live = alive
            if first in live:
                return first
            return FrameClient(host, port, self.token)
        finally:
            for extra in clients[1:]:
                if extra is not None:
                    extra.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _split(peer: str) -> tuple[str, int]:
    host, _, port = peer.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def _connect(host: str, port: int, token: str) -> FrameClient | None:
    try:
        return FrameClient(host, port, token)
    except OSError:
        return None


def _stripes(bytes_per_block: int, n: int) -> list[tuple[int, tuple[int, int]]]:
    """(byte offset, (first block, end block)) of each stripe of whole blocks."""
    per = max(1, STRIPE_BYTES // max(bytes_per_block, 1))
    return [(i * bytes_per_block, (i, min(i + per, n))) for i in range(0, n, per)]


def _push_all(
    client: FrameClient, key: str, stripes: list[tuple[int, tuple[int, int]]], blocks: Blocks
) -> list[tuple[int, tuple[int, int]]]:
    """Push stripes over one link; returns those not acknowledged (the link failed)."""
    for k, (start, (i, j)) in enumerate(stripes):
        parts = [p for b in blocks[i:j] for p in b]
        try:
            client.send_parts(PUSH, {"key": key, "at": start}, parts)
            client.recv()
        except (OSError, ConnectionError) as exc:
            log.warning("hand-off %s: a link failed (%s); the others take its stripes", key, exc)
            client.close()
            return stripes[k:]
    return []


def _copy_into(mapped: memoryview, at: int, blocks: Blocks) -> None:
    for b in blocks:
        for p in b:
            n = p.nbytes
            mapped[at : at + n] = p.cast("B") if p.format != "B" else p
            at += n
