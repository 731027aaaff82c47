"""Length-prefixed frames: a fixed header, a JSON object of metadata, then raw data bytes.

    header (16 bytes, little endian): magic b"HT", version, op, meta length u32, data length u64

JSON, never pickle, so a hostile peer can at worst send a frame we reject. The receiver bounds
both lengths before reading, and data may land straight in caller memory (`sink`), which is how a
node writes into its segment and a client reads into a tensor without an intermediate copy.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable

HEADER = struct.Struct("<2sBBIQ")
MAGIC = b"HT"
VERSION = 1
MAX_META = 4 << 20  # a batch of a few thousand keys with their locations


class FrameError(Exception):
    """The peer sent something that is not a valid frame; the connection must be dropped."""


class PeerClosed(ConnectionError):
    """The peer closed the connection (cleanly or in the middle of a frame)."""


# sink(op, meta, data_len) -> where to receive the data (None: a fresh buffer)
Sink = Callable[[int, dict, int], memoryview | None]


def encode_header(op: int, meta_bytes: bytes, data_len: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, len(meta_bytes), data_len) + meta_bytes


def send_frame(sock: socket.socket, op: int, meta: dict, data=None) -> None:
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode() if meta else b""
    n = 0 if data is None else memoryview(data).nbytes
    head = encode_header(op, meta_bytes, n)
    if n == 0:
        sock.sendall(head)
    elif n <= 64 * 1024:  # one syscall for small frames: latency over a second copy
        sock.sendall(head + bytes(data))
    else:
        sock.sendall(head)
        sock.sendall(data)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerClosed(f"peer closed after {got} of {n} bytes")
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return buf


def recv_frame(
    sock: socket.socket,
    max_data: int,
    sink: Sink | None = None,
    known_ops: frozenset[int] | None = None,
    max_meta: int = MAX_META,
) -> tuple[int, dict, memoryview | None]:
    """One frame: (op, meta, data). Raises FrameError on anything malformed, PeerClosed on EOF."""
    raw = recv_exact(sock, HEADER.size)
    magic, version, op, meta_len, data_len = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        raise FrameError(f"bad frame header {bytes(raw[:4])!r}")
    if known_ops is not None and op not in known_ops:
        raise FrameError(f"unknown op {op}")
    if meta_len > max_meta or data_len > max_data:
        raise FrameError(f"frame too large: meta {meta_len} B, data {data_len} B")
    meta: dict = {}
    if meta_len:
        try:
            meta = json.loads(recv_exact(sock, meta_len))
        except (ValueError, UnicodeDecodeError) as exc:
            raise FrameError(f"frame metadata is not JSON: {exc}") from exc
        if not isinstance(meta, dict):
            raise FrameError("frame metadata must be a JSON object")
    if not data_len:
        return op, meta, None
    dest = sink(op, meta, data_len) if sink is not None else None
    if dest is None:
        dest = memoryview(bytearray(data_len))
    elif len(dest) != data_len:
        raise FrameError(f"sink gave {len(dest)} bytes for {data_len}")
    recv_exact_into(sock, dest)
    return op, meta, dest
