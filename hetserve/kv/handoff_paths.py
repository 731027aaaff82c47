"""How a prefill instance's KV reaches a decode instance: the hand-off paths.

Who calls it: the engine's hand-off sender (`kv/handoff.py`, on its worker thread) calls
`send`; the decode engine's hand-off receiver starts the receiving side and takes what arrived
(`take`) on the engine thread. Paths move bytes and know nothing of requests or scheduling:
a hand-off is a key, a `Manifest` and `n` blocks of `bytes_per_block` bytes each (the blocks'
parts back to back, page-first, as `BlockIO.save_parts` gives them), landing in a `Staging`
area of the receiver until the engine copies them into its KV blocks.

- `StorePath`: through a KV store both instances share: full blocks under their `BlockHash`
  digest (so a block the store already has is not sent twice, and other instances can hit
  it), the partial last block and the manifest under request-scoped keys, deleted once read.
- `DirectPath`: pushed to the receiver (`DirectReceiver`, a `transfer.tcp.FrameServer`): on
  one host the sender maps the receiver's staging segment and copies into it; otherwise the
  blocks go over TCP, striped over several connections, and a connection that fails mid-way
  leaves its stripes to the others.

Failure contract: `send` raises `HandoffError` (or the store's and the transport's own errors)
when the bytes did not all arrive; the receiver side never exposes a partial hand-off: `take`
returns an arrival only once its manifest came after all of its bytes. A receiver that waits
too long recomputes (the receiver's business, not the path's).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from hetserve.store.allocator import ExtentAllocator
from hetserve.store.api import KVStore
from hetserve.transfer import shm
from hetserve.transfer.tcp import FrameClient, FrameServer, Handler, Meta, Reply, RequestError

log = logging.getLogger(__name__)

OPEN, PUSH, COMMIT = 10, 11, 12  # direct path ops (transfer.tcp keeps 1-3 for itself)
STRIPE_BYTES = 8 << 20  # a stripe: enough to amortize a frame, small enough to spread
MAX_LINKS = 4


class HandoffError(Exception):
    """A hand-off could not be completed; the decode side will recompute."""


@dataclass(frozen=True)
class Manifest:
    """What the receiver needs to trust and place the blocks. `seed` is the sender's KV
    identity (model, dtype, layout, block size): a receiver with another one recomputes."""

    key: str
    seed: str  # hex of the root of the block hashes
    block_size: int
    bytes_per_block: int
    tokens: int  # tokens whose KV is handed over (the prompt but its last token)
    digests: list[str] = field(default_factory=list)  # of the full blocks, in order

    @property
    def num_blocks(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str | dict[str, Any]) -> Manifest:
        obj = data if isinstance(data, dict) else json.loads(data)
        return cls(
            str(obj["key"]),
            str(obj["seed"]),
            int(obj["block_size"]),
            int(obj["bytes_per_block"]),
            int(obj["tokens"]),
            [str(d) for d in obj["digests"]],
        )


Blocks = Sequence[Sequence[memoryview]]  # per block, its parts


class Staging:
    """Where handed-off bytes wait for the engine: one shared-memory segment (so a sender on
    the same host can copy straight in) with an extent per hand-off. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.segment = shm.Segment(capacity)
        self._alloc = ExtentAllocator(shm.HEADER_BYTES, capacity)
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        with self._lock:
            return self._alloc.alloc(max(nbytes, 1))

    def free(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._alloc.free(offset, max(nbytes, 1))

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self.segment.view[offset : offset + nbytes]

    def info(self) -> dict[str, Any]:
        s = self.segment
        return {"pid": _pid(), "fd": s.fd, "size": s.size, "nonce": s.nonce, "host": shm.host_id()}

    def close(self) -> None:
        self.segment.close()


def _pid() -> int:
    import os

    return os.getpid()


@dataclass
class Arrival:
    """A complete hand-off in staging: `manifest.nbytes` bytes at `offset`."""

    manifest: Manifest
    offset: int
    path: str
    arrived: float = field(default_factory=time.monotonic)


class Arrivals:
    """Complete hand-offs by key, waiting for their request (which may come before or after
    its bytes); unclaimed ones expire so a request that never comes cannot hold staging."""

    def __init__(self, staging: Staging, ttl_s: float = 120.0) -> None:
        self.staging, self.ttl_s = staging, ttl_s
        self._ready: dict[str, Arrival] = {}
        self._lock = threading.Lock()

    def put(self, arrival: Arrival) -> None:
        with self._lock:
            old = self._ready.pop(arrival.manifest.key, None)
            self._ready[arrival.manifest.key] = arrival
        if old is not None:  # a key sent twice: the newer bytes win
            self.staging.free(old.offset, old.manifest.nbytes)
        self.expire()

    def take(self, key: str) -> Arrival | None:
        with self._lock:
            return self._ready.pop(key, None)

    def release(self, arrival: Arrival) -> None:
        self.staging.free(arrival.offset, arrival.manifest.nbytes)

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [k for k, a in self._ready.items() if now - a.arrived > self.ttl_s]
            gone = [self._ready.pop(k) for k in old]
        for a in gone:
            self.release(a)


# ---- through the shared store -------------------------------------------------------------
def _tail_key(key: str) -> str:
    return f"hetserve-handoff/{key}/tail"


def _manifest_key(key: str) -> str:
    return f"hetserve-handoff/{key}/manifest"


class StorePath:
    name = "store"

    def __init__(self, store: KVStore) -> None:
        self.store = store

    def send(self, manifest: Manifest, blocks: Blocks, known: Sequence[bool]) -> None:
        """Full blocks the store lacks (`known[i]`: it has block i already), the partial last
        block, then the manifest: a receiver that sees the manifest finds everything."""
        full = len(manifest.digests)
        todo = [i for i in range(full) if not known[i]]
        if todo:
            keys = [bytes.fromhex(manifest.digests[i]) for i in todo]
            self.store.batch_put_parts(keys, [list(blocks[i]) for i in todo])
        if manifest.num_blocks > full:
            self.store.put_parts(_tail_key(manifest.key), list(blocks[full]))
        self.store.put(_manifest_key(manifest.key), manifest.to_bytes())


class StoreReceiver:
    """Polls the store for the manifests of the hand-offs it is asked about (on its own
    thread) and reads their blocks into staging."""

    name = "store"

    def __init__(self, store: KVStore, arrivals: Arrivals, poll_s: float = 0.002) -> None:
        self.store, self.arrivals, self.poll_s = store, arrivals, poll_s
        self._wanted: dict[str, float] = {}  # key -> deadline
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hetserve-handoff")
        self._thread.start()

    def want(self, key: str, timeout_s: float) -> None:
        with self._lock:
            self._wanted.setdefault(key, time.monotonic() + timeout_s)

    def forget(self, key: str) -> None:
        with self._lock:
            self._wanted.pop(key, None)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                now = time.monotonic()
                for k in [k for k, d in self._wanted.items() if d < now]:
                    del self._wanted[k]
                keys = list(self._wanted)
            for key in keys:
                try:
                    if self._fetch(key):
                        self.forget(key)
                except Exception as exc:  # the store failed: the receiver times out, recomputes
                    log.warning("hand-off %s: reading from the store failed: %s", key, exc)
                    self.forget(key)

    def _fetch(self, key: str) -> bool:
        raw = self.store.get(_manifest_key(key))
        if raw is None:
            return False
        m = Manifest.from_json(raw)
        offset = self.arrivals.staging.alloc(m.nbytes)
        if offset is None:
            raise HandoffError(f"no staging room for {m.nbytes} bytes")
        try:
            self._read(m, offset)
        except BaseException:
            self.arrivals.staging.free(offset, m.nbytes)
            raise
        self.arrivals.put(Arrival(m, offset, self.name))
        for k in (_manifest_key(key), _tail_key(key)):  # request-scoped: gone after use
            self.store.remove(k)
        return True

    def _read(self, m: Manifest, offset: int) -> None:
        bpb, full = m.bytes_per_block, len(m.digests)
        view = self.arrivals.staging.view(offset, m.nbytes)
        keys: list[str | bytes] = [bytes.fromhex(d) for d in m.digests]
        if m.num_blocks > full:
            keys.append(_tail_key(m.key))
        dests = [view[i * bpb : (i + 1) * bpb] for i in range(len(keys))]
        sizes = self.store.batch_get_into(keys, dests) if keys else []
        if any(s != bpb for s in sizes):
            raise HandoffError("a handed-off block is missing from the store")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# ---- pushed directly ----------------------------------------------------------------------
class DirectReceiver:
    """The decode side of the direct path: OPEN gives a sender an extent of staging (and, on
    the same host, the segment to map), PUSH lands a stripe in it, COMMIT with the manifest
    checks every stripe came and makes the hand-off an arrival."""

    name = "direct"

    def __init__(self, host: str, port: int, token: str, arrivals: Arrivals) -> None:
        self.arrivals = arrivals
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
