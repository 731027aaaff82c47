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
from collections.abc import Callable, Sequence
from typing import Any

from hetserve.transfer.iov import recvmsg_into_all, sendmsg_all, total

HEADER = struct.Struct("<2sBBIQ")
MAGIC = b"HT"
VERSION = 1
MAX_META = 4 << 20  # a batch of a few thousand keys with their locations


class FrameError(Exception):
    """The peer sent something that is not a valid frame; the connection must be dropped."""


class PeerClosed(ConnectionError):
    """The peer closed the connection (cleanly or in the middle of a frame)."""


# sink(op, meta, data_len) -> where to receive the data (None: a fresh buffer)
Sink = Callable[[int, dict[str, Any], int], memoryview | None]


def encode_header(op: int, meta_bytes: bytes, data_len: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, len(meta_bytes), data_len) + meta_bytes


def send_frame(
    sock: socket.socket, op: int, meta: dict[str, Any], data: memoryview | None = None
) -> None:
    send_frame_parts(sock, op, meta, [] if data is None else [data])


def send_frame_parts(
    sock: socket.socket, op: int, meta: dict[str, Any], parts: Sequence[memoryview]
) -> None:
    """One frame whose data is the concatenation of `parts`, gathered by the kernel (sendmsg):
    one system call for header and data, and no copy of the data here."""
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode() if meta else b""
    head = memoryview(encode_header(op, meta_bytes, total(parts)))
    sendmsg_all(sock, [head, *parts])


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


def _recv_head(
    sock: socket.socket, max_data: int, known_ops: frozenset[int] | None, max_meta: int
) -> tuple[int, dict[str, Any], int]:
    raw = recv_exact(sock, HEADER.size)
    magic, version, op, meta_len, data_len = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        raise FrameError(f"bad frame header {bytes(raw[:4])!r}")
    if known_ops is not None and op not in known_ops:
        raise FrameError(f"unknown op {op}")
    if meta_len > max_meta or data_len > max_data:
        raise FrameError(f"frame too large: meta {meta_len} B, data {data_len} B")
    meta: dict[str, Any] = {}
    if meta_len:
        try:
            meta = json.loads(recv_exact(sock, meta_len))
        except (ValueError, UnicodeDecodeError) as exc:
            raise FrameError(f"frame metadata is not JSON: {exc}") from exc
        if not isinstance(meta, dict):
            raise FrameError("frame metadata must be a JSON object")
    return op, meta, data_len


def recv_frame(
    sock: socket.socket,
    max_data: int,
    sink: Sink | None = None,
    known_ops: frozenset[int] | None = None,
    max_meta: int = MAX_META,
) -> tuple[int, dict[str, Any], memoryview | None]:
    """One frame: (op, meta, data). Raises FrameError on anything malformed, PeerClosed on EOF."""
    op, meta, data_len = _recv_head(sock, max_data, known_ops, max_meta)
    if not data_len:
        return op, meta, None
    dest = sink(op, meta, data_len) if sink is not None else None
    if dest is None:
        dest = memoryview(bytearray(data_len))
    elif len(dest) != data_len:
        raise FrameError(f"sink gave {len(dest)} bytes for {data_len}")
    recv_exact_into(sock, dest)
    return op, meta, dest


def recv_frame_into(
    sock: socket.socket, parts: Sequence[memoryview], known_ops: frozenset[int] | None = None
) -> tuple[int, dict[str, Any], bool]:
    """One frame whose data, if any, is scattered over `parts` in order (recvmsg_into: no
    staging buffer). Returns (op, meta, whether data came); data of any other length than the
    parts' total is a FrameError, because the rest of the stream can no longer be trusted."""
    want = total(parts)
    op, meta, data_len = _recv_head(sock, want, known_ops, MAX_META)
    if not data_len:
        return op, meta, False
    if data_len != want:
        raise FrameError(f"frame carries {data_len} bytes, the destination holds {want}")
    got = recvmsg_into_all(sock, parts)
    if got != want:
        raise PeerClosed(f"peer closed after {got} of {want} bytes")
    return op, meta, True
