"""Client-side links to pool nodes and the master: pooled connections, and shared-memory maps
when the node runs on this host. A link moves many objects per call, pipelined: all requests go
out on one connection before the first reply is read, so round trips overlap."""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetserve.store import checksum
from hetserve.store.pool import protocol as P
from hetserve.transfer.framing import FrameError, PeerClosed
from hetserve.transfer.shm import attach, host_id
from hetserve.transfer.tcp import FrameClient, RemoteError

TRANSPORT_ERRORS = (OSError, PeerClosed, FrameError, RemoteError)


class ConnPool:
    """Idle connections to one server; a thread takes one, uses it, and gives it back."""

    def __init__(self, factory: Callable[[], FrameClient]) -> None:
        self.factory = factory
        self._idle: queue.SimpleQueue[FrameClient] = queue.SimpleQueue()

    def take(self) -> FrameClient:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            return self.factory()

    def give(self, conn: FrameClient) -> None:
        self._idle.put(conn)

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


@dataclass
class Transfer:
    """One object on one replica: (segment, offset, size) and the caller's memory."""

    index: int  # position in the caller's batch
    segment: int
    offset: int
    size: int
    buf: memoryview
    digest: int | None = None  # reads: expected; writes: filled in


class NodeLink:
    def __init__(self, info: dict, token: str, use_shm: bool, timeout: float) -> None:
        self.info = info
        host, port = info["host"], info["port"]
        self.conns = ConnPool(lambda: FrameClient(host, port, token, timeout))
        self.views: list[memoryview] | None = None
        if use_shm and info.get("host_id") == host_id():
            views = [
                attach(info["pid"], s["fd"], s["size"], s["nonce"], s["kind"] == "dram")
                for s in info["segments"]
            ]
            self.views = views if all(v is not None for v in views) else None

    def read(self, items: Sequence[Transfer]) -> list[bool]:
        """Fill each item's buffer; True where the bytes match their digest."""
        if self.views is not None:
            return [self._shm_read(t) for t in items]
        ok = [False] * len(items)
        try:
            conn = self.conns.take()
        except TRANSPORT_ERRORS:
            return ok
        try:
            for t in items:
                conn.send(P.READ, {"seg": t.segment, "off": t.offset, "len": t.size})
            for i, t in enumerate(items):
                dest = t.buf[: t.size]
                conn.recv(t.size, sink=lambda _op, _m, n, d=dest: d if n == len(d) else None)
                ok[i] = checksum.digest(dest) == t.digest
        except TRANSPORT_ERRORS:
            conn.close()  # replies may be half read: this connection is unusable
            return ok
        self.conns.give(conn)
        return ok

    def _shm_read(self, t: Transfer) -> bool:
        src = self.views[t.segment][t.offset : t.offset + t.size]
        return checksum.copy_and_digest(t.buf, src) == t.digest

    def write(self, items: Sequence[Transfer]) -> list[bool]:
        """Copy each item's buffer to the node, setting its digest; True where it landed."""
        if self.views is not None:
            for t in items:
                dst = self.views[t.segment][t.offset : t.offset + t.size]
                t.digest = checksum.copy_and_digest(dst, t.buf)
            return [True] * len(items)
        ok = [False] * len(items)
        try:
            conn = self.conns.take()
        except TRANSPORT_ERRORS:
            return ok
        try:
            for t in items:
                t.digest = checksum.digest(t.buf)
                conn.send(P.WRITE, {"seg": t.segment, "off": t.offset, "len": t.size}, t.buf)
            for i in range(len(items)):
                conn.recv()
                ok[i] = True
        except TRANSPORT_ERRORS:
            conn.close()
            return ok
        self.conns.give(conn)
        return ok

    def close(self) -> None:
        self.conns.close()
        self.views = None  # the maps close when the last copy using them is done
