"""How the mooncake:// backend moves bytes: two movers over Mooncake's buffer calls.

`Direct` hands Mooncake the caller's parts (and a header buffer) as they are: its multi-buffer
put and get move them with no copy on our side. Over RDMA that is the fast path. Mooncake's TCP
transport, though, sends every buffer as its own request, so a value in 96 parts costs 96 round
trips; `Staged` gathers header and parts into one contiguous buffer first, in the same pass that
computes the checksum (which reads every byte anyway), and moves one buffer per value. The
backend picks `Staged` for TCP and `Direct` otherwise (`gather=` overrides; `hetserve bench store
--parts 96` measures both).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hetserve.store import checksum
from hetserve.store.api import (
    Parts,
    StoreCapacityError,
    StoreUnavailableError,
    fit_parts,
)

NO_SPACE = -200  # ErrorCode::NO_AVAILABLE_HANDLE
OBJECT_NOT_FOUND = -704
SPACE_RETRY_S = 3.0
HEAD = checksum.HEADER.size


def addr(view: memoryview | np.ndarray[Any, Any]) -> int:
    """The address of a buffer's first byte (read-only buffers too, which ctypes refuses)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _total(parts: Parts) -> int:
    return sum(p.nbytes for p in parts)


def put_retrying(put: Callable[[list[int]], list[int]], names: list[str]) -> None:
    """Run `put(indices)` (Mooncake's per-key return codes) until every key is stored; a put
    refused for space is retried while Mooncake's background eviction makes room."""
    deadline = time.monotonic() + SPACE_RETRY_S
    todo = list(range(len(names)))
    while todo:
        rcs = put(todo)
        for i, rc in zip(todo, rcs, strict=True):
            if rc not in (0, NO_SPACE):
                raise StoreUnavailableError(f"mooncake put of {names[i]!r} failed: {rc}")
        todo = [i for i, rc in zip(todo, rcs, strict=True) if rc == NO_SPACE]
        if todo and time.monotonic() > deadline:
            raise StoreCapacityError("mooncake has no space left (everything is leased?)")
        if todo:
            time.sleep(0.02)  # its eviction runs in the background; give it a moment


class Direct:
    """Zero-copy: multi-buffer put/get from and into the caller's parts. Memory is registered
    around each call unless the transport takes any address (TCP)."""

    def __init__(self, client: Any, register: bool) -> None:
        self.client, self.register = client, register

    @contextlib.contextmanager
    def _registered(self, views: list[memoryview]) -> Iterator[None]:
        done: list[int] = []
        try:
            for v in views if self.register else []:
                if self.client.register_buffer(addr(v), v.nbytes) != 0:
                    raise StoreUnavailableError(f"mooncake could not register {v.nbytes} B")
                done.append(addr(v))
            yield
        finally:
            for a in done:
                self.client.unregister_buffer(a)

    def put(self, names: list[str], values: list[Parts], cfg: Any) -> None:
        pieces = []
        for parts in values:
            head = checksum.pack_header(_total(parts), checksum.digest_parts(parts))
            pieces.append([memoryview(head), *(p for p in parts if p.nbytes)])
        ptrs = [[addr(v) for v in views] for views in pieces]
        sizes = [[v.nbytes for v in views] for views in pieces]
        with self._registered([v for views in pieces for v in views]):
            # Mooncake's put keeps an object that exists (and reports success): remove first,
            # so a put replaces as the contract says.
            self.client.batch_remove(names, True)
            put_retrying(
                lambda todo: self.client.batch_put_from_multi_buffers(
                    [names[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo], cfg
                ),
                names,
            )

    def get(self, names: list[str], dests: list[Parts]) -> list[int | None]:
        """Reads into parts of known total (exact); per key its length, None on a miss, or -1
        where Mooncake refused the read (see `diagnose`)."""
        heads = [memoryview(bytearray(HEAD)) for _ in names]
        pieces = [[h, *(p for p in d if p.nbytes)] for h, d in zip(heads, dests, strict=True)]
        ptrs = [[addr(v) for v in views] for views in pieces]
        sizes = [[v.nbytes for v in views] for views in pieces]
        with self._registered([v for views in pieces for v in views]):
            rcs = self.client.batch_get_into_multi_buffers(names, ptrs, sizes)
        out: list[int | None] = []
        for head, dest, rc in zip(heads, dests, rcs, strict=True):
            if rc < 0:
                out.append(None if rc == OBJECT_NOT_FOUND else -1)
                continue
            got = checksum.unpack_header(head)
            ok = (
                got is not None and got[0] == _total(dest) and checksum.digest_parts(dest) == got[1]
            )
            out.append(_total(dest) if ok else None)
        return out


class Staged:
    """One contiguous buffer per value: header and parts gathered into a reusable staging
    buffer (copied in the checksum's pass) and moved with Mooncake's single-buffer calls."""

    def __init__(self, client: Any, capacity: int) -> None:
        self.client, self.capacity = client, capacity
        self._local = threading.local()

    def _buffer(self, n: int) -> np.ndarray[Any, Any]:
        """This thread's staging buffer, at least n bytes; grown, never shrunk, and touched
        once (a first touch of fresh memory runs ~20x slower than a copy here)."""
        buf: np.ndarray[Any, Any] | None = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < n:
            buf = np.ones(n, dtype=np.uint8)
            self._local.buf = buf
        return buf

    def _chunks(self, sizes: list[int]) -> Iterator[list[int]]:
        """Indices in runs whose sizes fit the staging capacity together."""
        run: list[int] = []
        used = 0
        for i, n in enumerate(sizes):
            if run and used + n > self.capacity:
                yield run
                run, used = [], 0
            run.append(i)
            used += n
        if run:
            yield run

    def put(self, names: list[str], values: list[Parts], cfg: Any) -> None:
        sizes = [HEAD + _total(parts) for parts in values]
        for run in self._chunks(sizes):
            buf = self._buffer(sum(sizes[i] for i in run)).data
            base, ptrs, off = addr(buf), [], 0
            for i in run:
                n = sizes[i]
                value_digest = checksum.copy_and_digest_parts(
                    [buf[off + HEAD : off + n]], values[i]
                )
                buf[off : off + HEAD] = checksum.pack_header(n - HEAD, value_digest)
                ptrs.append(base + off)
                off += n
            keys = [names[i] for i in run]
            lens = [sizes[i] for i in run]
            put_retrying(functools.partial(self._upsert, keys, ptrs, lens, cfg), keys)

    def _upsert(
        self, keys: list[str], ptrs: list[int], lens: list[int], cfg: Any, todo: list[int]
    ) -> list[int]:
        rcs: list[int] = self.client.batch_upsert_from(
            [keys[j] for j in todo], [ptrs[j] for j in todo], [lens[j] for j in todo], cfg
        )
        return rcs

    def get(self, names: list[str], dests: list[Parts], exact: bool, cap: int) -> list[int | None]:
        """Per key the value's length, None on a miss, or -1 where Mooncake refused the read
        (the caller learns the size and raises the caller's size error, or calls it a miss)."""
        want = [HEAD + (_total(d) if exact else min(d[0].nbytes, cap)) for d in dests]
        out: list[int | None] = [None] * len(names)
        for run in self._chunks(want):
            buf = self._buffer(sum(want[i] for i in run)).data
            offs = np.cumsum([0, *(want[i] for i in run)]).tolist()
            rcs = self.client.batch_get_into(
                [names[i] for i in run], [addr(buf) + o for o in offs[:-1]], [want[i] for i in run]
            )
            for j, (i, rc) in enumerate(zip(run, rcs, strict=True)):
                if rc >= 0:
                    blob = buf[offs[j] : offs[j] + rc]
                    out[i] = checksum.unseal_into(blob, dests[i], exact, names[i])
                elif rc != OBJECT_NOT_FOUND:
                    out[i] = -1
        return out


def diagnose(client: Any, name: str, dest: Parts, exact: bool) -> None:
    """After a refused read: raise the caller's size error if the stored size does not fit
    `dest`; return (a miss) if it does, or if the object is gone."""
    size = client.get_size(name) - HEAD
    if size >= 0:
        fit_parts(dest, size, exact, name)
