"""`mooncake://MASTER_HOST:PORT?metadata=http://H:P/metadata&segment=256M&buffer=64M&host=127.0.0.1`

An adapter to the real Mooncake Store, for clusters that already run it or need RDMA
(`protocol=rdma&devices=mlx5_0`). This client contributes `segment` bytes of its memory to the
cluster (0: use only other clients' memory). Values are stored sealed (checksum header + payload).

Puts, and reads into parts, use Mooncake's multi-buffer calls: the header is one buffer and the
caller's parts the others, so the bytes go from and into the caller's memory with no staging copy
on our side. Mooncake's put keeps an object that already exists, so a put removes the old one
first (the contract replaces). A read into one buffer that may be larger than the value goes
through Mooncake's own copy (`get_batch`), because its direct reads need the exact size. Mooncake
evicts in the background once above its high watermark, so a put refused for space is retried
briefly before it becomes a capacity error.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from hetserve.store import checksum
from hetserve.store.api import (
    DEFAULT_MAX_VALUE,
    TIER_MOONCAKE,
    Key,
    KVStore,
    Parts,
    ReplicateConfig,
    StoreCapacityError,
    StoreDependencyError,
    StoreUnavailableError,
    TierInfo,
    ValueTooLargeError,
    fit_parts,
    normalize_key,
)
from hetserve.store.registry import StoreSpec, parse_size, register_backend

NO_SPACE = -200  # ErrorCode::NO_AVAILABLE_HANDLE
OBJECT_NOT_FOUND = -704
SPACE_RETRY_S = 3.0


def _addr(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers too, which ctypes refuses)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _verified(head: memoryview, parts: Parts) -> int | None:
    """The payload's length if the header is ours and the parts hash to its digest."""
    got = checksum.unpack_header(head)
    if got is None or got[0] != sum(p.nbytes for p in parts):
        return None
    return got[0] if checksum.digest_parts(parts) == got[1] else None


def _mooncake() -> Any:
    try:
        from mooncake import store  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        # A missing shared library (libibverbs) also surfaces as ImportError on import.
        lib = " and apt-get install libibverbs1" if "libibverbs" in str(exc) else ""
        raise StoreDependencyError(
            f"mooncake:// needs Mooncake: pip install 'hetserve[mooncake]'{lib}"
        ) from None
    return store


@register_backend("mooncake")
class MooncakeStore(KVStore):
    def __init__(self, spec: StoreSpec) -> None:
        host = spec.params.get("host", "127.0.0.1")
        if host.startswith("127."):
            # Mooncake's TCP transport binds what this variable names (default: every address);
            # a loopback client must not listen beyond loopback.
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
        mc = _mooncake()
        self._mc = mc
        self.protocol = spec.params.get("protocol", "tcp")
        master = f"{spec.host or '127.0.0.1'}:{spec.port or 50051}"
        metadata = spec.params.get("metadata", f"http://{spec.host or '127.0.0.1'}:8080/metadata")
        # Mooncake stages every value in this client's registered buffer: it bounds the value.
        self.buffer = parse_size(spec.params.get("buffer", "64M"))
        self.max_value = min(
            spec.size("max_value", DEFAULT_MAX_VALUE), self.buffer - checksum.HEADER.size
        )
        self._store = mc.MooncakeDistributedStore()
        rc = self._store.setup(
            host,
            metadata,
            spec.size("segment", 256 << 20),
            self.buffer,
            self.protocol,
            spec.params.get("devices", ""),
            master,
        )
        if rc != 0:
            raise StoreUnavailableError(f"mooncake setup failed (rc={rc}) for master {master}")

    def _config(self, config: ReplicateConfig) -> Any:
        out = self._mc.ReplicateConfig()
        out.replica_num = config.replica_num
        if config.preferred_segment:
            out.preferred_segment = config.preferred_segment
        if config.soft_pin:
            out.soft_pin_action = self._mc.SoftPinAction.ENABLE
        return out

    @contextlib.contextmanager
    def _registered(self, views: list[memoryview]) -> Iterator[None]:
        """RDMA reads and writes only registered memory; the TCP transport takes any address,
        so registration (a page pinning per call) is skipped there."""
        if self.protocol == "tcp":
            yield
            return
        addrs = []
        try:
            for v in views:
                if self._store.register_buffer(_addr(v), v.nbytes) != 0:
                    raise StoreUnavailableError(f"mooncake could not register {v.nbytes} B")
                addrs.append(_addr(v))
            yield
        finally:
            for a in addrs:
                self._store.unregister_buffer(a)

    # -- writes ---------------------------------------------------------------------------
    def _put(self, names: list[str], values: list[Parts], config: ReplicateConfig) -> None:
        pieces = []
        for parts in values:
            n = sum(p.nbytes for p in parts)
            if n > self.max_value:
                raise ValueTooLargeError(
                    f"value of {n} B exceeds {self.max_value} (max_value, or buffer= size)"
                )
            head = memoryview(checksum.pack_header(n, checksum.digest_parts(parts)))
            pieces.append([head, *(p for p in parts if p.nbytes)])
        ptrs = [[_addr(v) for v in views] for views in pieces]
        sizes = [[v.nbytes for v in views] for views in pieces]
        cfg = self._config(config)
        with self._registered([v for views in pieces for v in views]):
            # Mooncake's put keeps an object that exists (and reports success): remove first,
            # so a put replaces as the contract says.
            self._store.batch_remove(names, True)
            self._put_retrying(names, ptrs, sizes, cfg)

    def _put_retrying(
        self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]], cfg: Any
    ) -> None:
        """Put from the callers' buffers (no staging copy); a put refused for space is retried
        while Mooncake's background eviction makes room."""
        deadline = time.monotonic() + SPACE_RETRY_S
        todo = list(range(len(names)))
        while todo:
            rcs = self._store.batch_put_from_multi_buffers(
                [names[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo], cfg
            )
            for i, rc in zip(todo, rcs, strict=True):
                if rc not in (0, NO_SPACE):
                    raise StoreUnavailableError(f"mooncake put of {names[i]!r} failed: {rc}")
            todo = [i for i, rc in zip(todo, rcs, strict=True) if rc == NO_SPACE]
            if todo and time.monotonic() > deadline:
                raise StoreCapacityError("mooncake has no space left (everything is leased?)")
            if todo:
                time.sleep(0.02)  # its eviction runs in the background; give it a moment

    # -- reads ----------------------------------------------------------------------------
    def get(self, key: Key) -> bytes | None:
        payload = checksum.open_sealed(self._store.get(normalize_key(key)))
        return None if payload is None else bytes(payload)

    def _get_into(self, names: list[str], dests: list[Parts], exact: bool) -> list[int | None]:
        if not exact:  # sizes unknown: Mooncake hands back its copy, ours goes into the buffer
            blobs = self._store.get_batch(names)
            return [
                checksum.unseal_into(blob, d, exact, name)
                for blob, d, name in zip(blobs, dests, names, strict=True)
            ]
        heads = [memoryview(bytearray(checksum.HEADER.size)) for _ in names]
        rcs = self._read(names, heads, dests)
        out: list[int | None] = []
        for name, head, dest, rc in zip(names, heads, dests, rcs, strict=True):
            if rc < 0 and rc != OBJECT_NOT_FOUND:
                # Not read: the destination's size may be wrong (an error for the caller) or a
                # transfer failed (read once more: it is a miss if it fails again).
                size = self._store.get_size(name) - checksum.HEADER.size
                if size < 0:
                    out.append(None)
                    continue
                fit_parts(dest, size, exact, name)
                rc = self._read([name], [head], [dest])[0]
            out.append(_verified(head, dest) if rc >= 0 else None)
        return out

    def _read(self, names: list[str], heads: Parts, dests: list[Parts]) -> list[int]:
        """Mooncake's multi-buffer get: the header into `heads`, the payload straight into the
        callers' parts; per key the bytes read or a negative error."""
        pieces = [[h, *(p for p in d if p.nbytes)] for h, d in zip(heads, dests, strict=True)]
        ptrs = [[_addr(v) for v in views] for views in pieces]
        sizes = [[v.nbytes for v in views] for views in pieces]
        with self._registered([v for views in pieces for v in views]):
            rcs: list[int] = self._store.batch_get_into_multi_buffers(names, ptrs, sizes)
        return rcs

    def exists(self, key: Key) -> bool:
        return self._store.is_exist(normalize_key(key)) == 1

    def batch_exists(self, keys: Sequence[Key]) -> int:
        found = self._store.batch_is_exist([normalize_key(k) for k in keys]) if keys else []
        return next((i for i, f in enumerate(found) if f != 1), len(keys))

    def batch_locate(self, keys: Sequence[Key]) -> list[str | None]:
        n = self.batch_exists(keys)
        return [TIER_MOONCAKE] * n + [None] * (len(keys) - n)

    def tiers(self) -> list[TierInfo]:
        """Mooncake's client API tells no capacity or use (its master exports them as metrics
        on a port the client does not know): both are None."""
        return [TierInfo(TIER_MOONCAKE, None, None, shared=True)]

    def remove(self, key: Key) -> bool:
        # force: a recent reader's lease must not make remove fail; a reader that races the
        # removal sees a checksum mismatch, i.e. a miss.
        return self._store.remove(normalize_key(key), True) == 0

    def close(self) -> None:
        self._store.close()
