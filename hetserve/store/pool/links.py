"""Client-side links to pool nodes and the master: pooled connections, and shared-memory maps
when the node runs on this host. A link moves many objects per call, pipelined: all requests go
out on one connection before the first reply is read, so round trips overlap."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

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

    @contextmanager
    def lease(self) -> Iterator[FrameClient]:
        """A connection for one exchange, given back when it ends. A transport error closes it
        instead (replies may be half read: it is unusable) and goes on to the caller."""
        conn = self.take()
        try:
            yield conn
        except TRANSPORT_ERRORS:
            conn.close()
            raise
        self.give(conn)

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


@dataclass
class Transfer:
    """One object on one replica: (segment, offset, size) and the caller's memory, as parts
    that total `size` (scatter-gather: the engine's block lies in one piece per layer)."""

    index: int  # position in the caller's batch
    segment: int
    offset: int
    size: int
    parts: list[memoryview]
    digest: int | None = None  # reads: expected; writes: filled in


class NodeLink:
    def __init__(self, info: dict[str, Any], token: str, use_shm: bool, timeout: float) -> None:
        self.info = info
        host, port = info["host"], info["port"]
        self.conns = ConnPool(lambda: FrameClient(host, port, token, timeout))
        self.views: list[memoryview] | None = None
        if use_shm and info.get("host_id") == host_id():
            views = [
                attach(info["pid"], s["fd"], s["size"], s["nonce"], s["kind"] == "dram")
                for s in info["segments"]
            ]
            self.views = [v for v in views if v is not None]
            if len(self.views) != len(views):
                self.views = None

    @property
    def shm(self) -> bool:
        """Whether this node's memory is mapped here (reads and writes are memcpy)."""
        return self.views is not None

    def read(self, items: Sequence[Transfer]) -> list[bool]:
        """Fill each item's parts; True where the bytes match their digest."""
        if self.views is not None:
            return [self._shm_read(self.views, t) for t in items]
        ok = [False] * len(items)
        # A failed link leaves the items it did not answer False: the caller tries elsewhere.
        with suppress(*TRANSPORT_ERRORS), self.conns.lease() as conn:
            for t in items:
                conn.send(P.READ, {"seg": t.segment, "off": t.offset, "len": t.size})
            for i, t in enumerate(items):
                conn.recv_into(t.parts)  # straight into the caller's parts (recvmsg_into)
                ok[i] = checksum.digest_parts(t.parts) == t.digest
        return ok

    @staticmethod
    def _shm_read(views: list[memoryview], t: Transfer) -> bool:
        src = views[t.segment][t.offset : t.offset + t.size]
        return checksum.copy_and_digest_parts(t.parts, [src]) == t.digest

    def write(self, items: Sequence[Transfer]) -> list[bool]:
        """Copy each item's parts to the node, setting its digest; True where it landed."""
        if self.views is not None:
            for t in items:
                dst = self.views[t.segment][t.offset : t.offset + t.size]
                t.digest = checksum.copy_and_digest_parts([dst], t.parts)
            return [True] * len(items)
        ok = [False] * len(items)
        with suppress(*TRANSPORT_ERRORS), self.conns.lease() as conn:
            for t in items:
                t.digest = checksum.digest_parts(t.parts)
                meta = {"seg": t.segment, "off": t.offset, "len": t.size}
                conn.send_parts(P.WRITE, meta, t.parts)  # gathered by sendmsg, not copied
            for i in range(len(items)):
                conn.recv()
                ok[i] = True
        return ok

    def close(self) -> None:
        self.conns.close()
        self.views = None  # the maps close when the last copy using them is done
