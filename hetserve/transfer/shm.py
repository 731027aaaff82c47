"""Shared-memory segments: anonymous memory (memfd) or a file, mapped by the owner and, on the
same host, by clients that copy into and out of it directly instead of over TCP.

The owner unlinks its file right away, so nothing leaks when it is killed; a client maps the
segment through `/proc/<pid>/fd/<fd>`, and checks a random nonce in the first bytes so it never
maps the wrong memory (a reused pid or fd). The kernel lets only processes that may inspect the
owner (same user, or root) open that path, so the fast path is as private as the owner itself.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import tempfile

HEADER_BYTES = 4096  # the nonce lives here; data offsets start after it


def host_id() -> str:
    """Equal on two processes only if they share a kernel (and so can share memory)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


class Segment:
    """Owner side. `directory=None` puts the segment in anonymous memory (DRAM); a directory puts
    it in a file there (the SSD tier: the kernel pages it to disk)."""

    def __init__(self, capacity: int, directory: str | None = None) -> None:
        self.size = HEADER_BYTES + capacity
        if directory is None:
            self.fd = os.memfd_create("hetserve-segment")
        else:
            self.fd, path = tempfile.mkstemp(prefix="hetserve-seg-", dir=directory)
            os.unlink(path)
        os.ftruncate(self.fd, self.size)
        flags = mmap.MAP_SHARED
        if directory is None:
            # Reserve and touch the memory now: first-touch faults run ~20x slower than copies
            # here, and a memfd that cannot get its pages later would SIGBUS mid-write.
            os.posix_fallocate(self.fd, 0, self.size)
            flags |= mmap.MAP_POPULATE
        self.map = mmap.mmap(self.fd, self.size, flags=flags)
        self.view = memoryview(self.map)
        self.nonce = secrets.token_hex(16)
        self.view[:16] = bytes.fromhex(self.nonce)

    def close(self) -> None:
        self.view.release()
        self.map.close()
        os.close(self.fd)


def attach(pid: int, fd: int, size: int, nonce: str, populate: bool) -> memoryview | None:
    """Map another process's segment; None when it is not reachable or not the one expected.
    `populate` fills this process's page tables now (DRAM segments), not on every first copy;
    a file-backed segment is left to page in on demand."""
    try:
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(f).st_size != size:
            return None
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        mapped = mmap.mmap(f, size, flags=flags)
    except OSError:
        return None
    finally:
        os.close(f)
    view = memoryview(mapped)
    if bytes(view[:16]) != bytes.fromhex(nonce):
        view.release()
        mapped.close()
        return None
    return view
