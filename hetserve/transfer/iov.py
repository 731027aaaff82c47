"""Vectored I/O: move one logical byte string that lies in several buffers (a KV block spread
over one tensor per layer) with one system call per batch of buffers and no staging copy.

Every helper loops until all bytes moved, because sendmsg/recvmsg_into/writev/preadv may stop
short (socket buffers, signals), and hands the kernel at most IOV_MAX buffers per call.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

IOV_MAX = 1024  # Linux's limit on buffers per call (sysconf SC_IOV_MAX)


def total(views: Sequence[memoryview]) -> int:
    return sum(v.nbytes for v in views)


def advance(views: list[memoryview], n: int) -> list[memoryview]:
    """What is left of `views` after the first `n` bytes moved."""
    i = 0
    while i < len(views) and n >= views[i].nbytes:
        n -= views[i].nbytes
        i += 1
    rest = views[i:]
    if n and rest:
        rest[0] = rest[0][n:]
    return rest


def _pending(views: Sequence[memoryview]) -> list[memoryview]:
    # Empty buffers would make a zero-byte return ambiguous (EOF or nothing asked).
    return [v for v in views if v.nbytes]


def sendmsg_all(sock: socket.socket, views: Sequence[memoryview]) -> None:
    left = _pending(views)
    while left:
        sent = sock.sendmsg(left[:IOV_MAX])
        left = advance(left, sent)


def recvmsg_into_all(sock: socket.socket, views: Sequence[memoryview]) -> int:
    """Fill `views` in order; returns the bytes received, fewer only when the peer closed."""
    left, got = _pending(views), 0
    while left:
        n = sock.recvmsg_into(left[:IOV_MAX])[0]
        if n == 0:
            return got
        got += n
        left = advance(left, n)
    return got


def writev_all(fd: int, views: Sequence[memoryview]) -> None:
    left = _pending(views)
    while left:
        left = advance(left, os.writev(fd, left[:IOV_MAX]))


def preadv_all(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Fill `views` from the file at `offset`; returns the bytes read (fewer only at EOF)."""
    left, got = _pending(views), 0
    while left:
        n = os.preadv(fd, left[:IOV_MAX], offset + got)
        if n == 0:
            return got
        got += n
        left = advance(left, n)
    return got
