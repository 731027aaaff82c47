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
- the direct path (`handoff_direct.py`) and Mooncake's Transfer Engine
  (`handoff_mooncake.py`) push the blocks into the receiver's staging.

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
from dataclasses import asdict, dataclass, field
from typing import Any

from hetserve.store.allocator import ExtentAllocator
from hetserve.store.api import KVStore
from hetserve.transfer import shm

log = logging.getLogger(__name__)


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
    # A linear-attention model's state after those tokens, after the blocks (0: none).
    state_bytes: int = 0

    @property
    def num_blocks(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.state_bytes

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
            int(obj.get("state_bytes", 0)),
        )


Blocks = Sequence[Sequence[memoryview]]  # per block, its parts; then the state's, if any


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


def _state_key(key: str) -> str:
    return f"hetserve-handoff/{key}/state"


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
        if manifest.state_bytes:
            self.store.put_parts(_state_key(manifest.key), list(blocks[manifest.num_blocks]))
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
        for k in (_manifest_key(key), _tail_key(key), _state_key(key)):  # gone after use
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
        if m.state_bytes:
            at = m.num_blocks * bpb
            got = self.store.get_into(_state_key(m.key), view[at : at + m.state_bytes])
            if got != m.state_bytes:
                raise HandoffError("a handed-off state is missing from the store")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
