"""`hetserve store node`: contributes a DRAM segment (and optionally one file-backed segment in
an SSD directory) to the pool and serves its bytes over TCP.

The node trusts the master's allocation: an authenticated client may READ or WRITE any range
inside a segment, never outside it. It keeps one connection to the master for registration and
heartbeats, and re-registers (empty) whenever that connection breaks, e.g. a master restart.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid

from hetserve.store.host_memory import check_reservation
from hetserve.store.pool import protocol as P
from hetserve.transfer.framing import FrameError
from hetserve.transfer.shm import HEADER_BYTES, Segment, host_id
from hetserve.transfer.tcp import Data, FrameClient, FrameServer, Handler, Meta, Reply

log = logging.getLogger(__name__)


class PoolNode:
    def __init__(
        self,
        master: tuple[str, int],
        dram: int,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = "",
        ssd_dir: str | None = None,
        ssd: int = 0,
        advertise: str | None = None,
        heartbeat_s: float = 0.5,
    ) -> None:
        P.require_token(host, token)
        self.master, self.token, self.heartbeat_s = master, token, heartbeat_s
        self.node_id = uuid.uuid4().hex[:12]
        # touched in full now: past the host's memory it would end in the OOM killer
        check_reservation(dram, "a pool node's DRAM", "--dram")
        self.segments = [Segment(dram)]
        if ssd_dir and ssd:
            self.segments.append(Segment(ssd, directory=ssd_dir))
        max_data = max(s.size for s in self.segments)
        handlers: dict[int, Handler] = {P.READ: self._read, P.WRITE: self._write}
        self.server = FrameServer(host, port, token, handlers, max_data, sink=self._sink)
        self.port = self.server.port
        wildcard = host in ("0.0.0.0", "::", "")
        self.host = advertise or (socket.gethostname() if wildcard else host)
        self.registered = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._membership_loop, daemon=True)

    def start(self) -> PoolNode:
        self.server.start()
        self._thread.start()
        return self

    def info(self) -> Meta:
        segs = [
            {
                "kind": "dram" if i == 0 else "ssd",
                "capacity": s.size - HEADER_BYTES,
                "fd": s.fd,
                "size": s.size,
                "nonce": s.nonce,
            }
            for i, s in enumerate(self.segments)
        ]
        return {
            "host": self.host,
            "port": self.port,
            "pid": os.getpid(),
            "host_id": host_id(),
            "segments": segs,
        }

    # -- data plane -----------------------------------------------------------------------
    def _range(self, meta: Meta) -> memoryview:
        seg = meta.get("seg")
        if not isinstance(seg, int) or not 0 <= seg < len(self.segments):
            raise FrameError(f"no segment {seg!r}")
        view = self.segments[seg].view
        off, n = meta.get("off"), meta.get("len")
        if not (isinstance(off, int) and isinstance(n, int)) or not (
            HEADER_BYTES <= off and 0 <= n and off + n <= len(view)
        ):
            raise FrameError(f"range {off!r}+{n!r} is outside segment {seg}")
        return view[off : off + n]

    def _sink(self, op: int, meta: Meta, data_len: int) -> memoryview:
        if op != P.WRITE or meta.get("len") != data_len:
            raise FrameError(f"op {op} carries no data of {data_len} bytes")
        return self._range(meta)  # the bytes land directly in the segment

    def _write(self, _s: Meta, meta: Meta, data: Data) -> Reply:
        if meta.get("len") and data is None:
            raise FrameError("WRITE without its data")
        return {}, None

    def _read(self, _s: Meta, meta: Meta, _data: Data) -> Reply:
        return {}, self._range(meta)

    # -- membership -----------------------------------------------------------------------
    def _membership_loop(self) -> None:
        warned = False  # the first failure of an outage is a warning: a wrong --master or
        # token otherwise leaves a node that said it was ready silently outside the pool
        while not self._stop.is_set():
            conn = None
            try:
                conn = FrameClient(*self.master, self.token, timeout=5.0)
                conn.call(P.REGISTER, {"node_id": self.node_id, "info": self.info()})
                self.registered.set()
                warned = False
                log.info("node %s registered with %s:%s", self.node_id, *self.master)
                while not self._stop.wait(self.heartbeat_s):
                    conn.call(P.HEARTBEAT, {})
            except Exception as exc:  # master down or restarting: retry until it is back
                level = logging.INFO if warned else logging.WARNING
                log.log(level, "node %s: master %s:%s unreachable (%s); retrying",
                        self.node_id, *self.master, exc)  # fmt: skip
                warned = True
            finally:
                self.registered.clear()
                if conn is not None and self._stop.is_set():
                    try:
                        conn.call(P.UNREGISTER, {})
                    except Exception:
                        pass
                if conn is not None:
                    conn.close()
            self._stop.wait(0.2)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.close()
        for seg in self.segments:
            try:
                seg.close()
            except BufferError:  # a transfer still holds a view; the OS frees it at exit
                pass
