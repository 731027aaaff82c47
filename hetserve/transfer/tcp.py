"""A threaded TCP frame server and its client connection, with a shared-token handshake.

Every connection starts with HELLO {"token"}; the server compares in constant time and drops the
peer on a mismatch. After that each request frame gets exactly one reply frame (OK or ERR), so a
client may pipeline: send many requests, then read the replies in order.
"""

from __future__ import annotations

import hmac
import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hetserve.transfer.framing import (
    FrameError,
    PeerClosed,
    Sink,
    recv_frame,
    recv_frame_into,
    send_frame,
    send_frame_parts,
)

log = logging.getLogger(__name__)

HELLO, OK, ERR = 1, 2, 3
# handler(session, meta, data) -> (reply meta, reply data or None); raise RequestError to answer
# ERR and keep the connection, anything else drops it.
Meta = dict[str, Any]
Data = memoryview | None
Reply = tuple[Meta, Data]
Handler = Callable[[Meta, Meta, Data], Reply]


class RequestError(Exception):
    """A well-formed request that cannot be served; the peer gets ERR with this message."""

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


class RemoteError(Exception):
    """Client side: the server answered ERR."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # request/reply latency
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)  # fewer wakeups on MiB transfers


class _ThreadingServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # a restarted service rebinds its port at once
    daemon_threads = True  # a stuck peer never blocks shutdown


class FrameServer:
    """Serves `handlers` (op -> Handler) on host:port until `close()`; each connection runs in
    its own thread, so one slow or hostile peer never blocks the others."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        handlers: dict[int, Handler],
        max_data: int,
        sink: Sink | None = None,
        on_close: Callable[[Meta], None] | None = None,
    ) -> None:
        self.token, self.handlers, self.max_data = token, handlers, max_data
        self.sink, self.on_close = sink, on_close
        self.known_ops = frozenset(handlers) | {HELLO}
        outer = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve_connection(self.request)

        self._server = _ThreadingServer((host, port), _Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> FrameServer:
        self._thread.start()
        return self

    def _serve_connection(self, sock: socket.socket) -> None:
        _tune(sock)
        session: Meta = {}
        try:
            if not self._handshake(sock):
                return
            while True:
                op, meta, data = recv_frame(sock, self.max_data, self.sink, self.known_ops)
                self._dispatch(sock, session, op, meta, data)
        except (PeerClosed, ConnectionError, TimeoutError):
            pass
        except FrameError as exc:
            log.warning("dropping a peer that sent a bad frame: %s", exc)
            _try_send(sock, ERR, {"error": str(exc), "code": "bad_frame"})
        except Exception:  # a handler bug must cost one connection, not the service
            log.exception("request handler failed; dropping the connection")
        finally:
            if self.on_close is not None and session:
                self.on_close(session)

    def _handshake(self, sock: socket.socket) -> bool:
        # Before the token checks out, a peer gets no more than a few KiB of our memory.
        op, meta, _ = recv_frame(sock, 0, None, frozenset({HELLO}), max_meta=4096)
        token = meta.get("token", "")
        if not isinstance(token, str) or not hmac.compare_digest(
            token.encode(), self.token.encode()
        ):
            _try_send(sock, ERR, {"error": "bad token", "code": "auth"})
            return False
        send_frame(sock, OK, {})
        return True

    def _dispatch(
        self, sock: socket.socket, session: Meta, op: int, meta: Meta, data: memoryview | None
    ) -> None:
        try:
            reply_meta, reply_data = self.handlers[op](session, meta, data)
        except RequestError as exc:
            send_frame(sock, ERR, {"error": str(exc), "code": exc.code})
            return
        except (KeyError, TypeError, ValueError) as exc:  # well-framed but malformed request
            send_frame(sock, ERR, {"error": f"malformed request: {exc!r}", "code": "bad_request"})
            return
        send_frame(sock, OK, reply_meta, reply_data)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _try_send(sock: socket.socket, op: int, meta: Meta) -> None:
    try:
        send_frame(sock, op, meta)
    except OSError:
        pass


class FrameClient:
    """One authenticated connection. Not thread-safe: callers pool them (one per thread)."""

    def __init__(self, host: str, port: int, token: str, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        try:
            _tune(self.sock)
            self.call(HELLO, {"token": token})
        except BaseException:
            self.sock.close()
            raise

    def send(self, op: int, meta: Meta, data: memoryview | None = None) -> None:
        send_frame(self.sock, op, meta, data)

    def send_parts(self, op: int, meta: Meta, parts: Sequence[memoryview]) -> None:
        """A request whose data is the concatenation of `parts` (gathered, not copied)."""
        send_frame_parts(self.sock, op, meta, parts)

    def recv(self, max_data: int = 0, sink: Sink | None = None) -> tuple[Meta, memoryview | None]:
        op, meta, data = recv_frame(self.sock, max_data, sink, frozenset({OK, ERR}))
        if op == ERR:
            raise RemoteError(str(meta.get("error")), str(meta.get("code")))
        return meta, data

    def recv_into(self, parts: Sequence[memoryview]) -> Meta:
        """A reply whose data is scattered over `parts`; a reply without data, or with data of
        another length, is an error (RemoteError, or FrameError and the connection is done)."""
        op, meta, came = recv_frame_into(self.sock, parts, frozenset({OK, ERR}))
        if op == ERR:
            raise RemoteError(str(meta.get("error")), str(meta.get("code")))
        if not came and parts and any(p.nbytes for p in parts):
            raise FrameError("the reply carries no data")
        return meta

    def call(
        self,
        op: int,
        meta: Meta,
        data: memoryview | None = None,
        max_data: int = 0,
        sink: Sink | None = None,
    ) -> tuple[Meta, memoryview | None]:
        self.send(op, meta, data)
        return self.recv(max_data, sink)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
