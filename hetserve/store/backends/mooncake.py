"""`mooncake://MASTER_HOST:PORT?metadata=http://H:P/metadata&segment=256M&buffer=64M&host=127.0.0.1`

An adapter to the real Mooncake Store, for clusters that already run it or need RDMA
(`protocol=rdma&devices=mlx5_0`). This client contributes `segment` bytes of its memory to the
cluster (0: use only other clients' memory). Values are stored sealed (checksum header + payload);
`upsert` gives the contract's replace-on-put. Mooncake evicts in the background once above its
high watermark, so a put refused for space is retried briefly before it becomes a capacity error.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from hetserve.store import checksum
from hetserve.store.api import (
    DEFAULT_MAX_VALUE,
    Buffer,
    BufferTooSmallError,
    InvalidInputError,
    Key,
    KVStore,
    ReplicateConfig,
    StoreCapacityError,
    StoreUnavailableError,
    ValueTooLargeError,
    as_memoryview,
    normalize_key,
)
from hetserve.store.registry import StoreSpec, parse_size, register_backend

NO_SPACE = -200  # ErrorCode::NO_AVAILABLE_HANDLE
SPACE_RETRY_S = 3.0


def _mooncake():
    try:
        from mooncake import store
    except ImportError as exc:
        raise StoreUnavailableError(
            "mooncake:// needs pip install mooncake-transfer-engine-non-cuda "
            "and apt-get install libibverbs1"
        ) from exc
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
            spec.params.get("protocol", "tcp"),
            spec.params.get("devices", ""),
            master,
        )
        if rc != 0:
            raise StoreUnavailableError(f"mooncake setup failed (rc={rc}) for master {master}")

    def _config(self, config: ReplicateConfig | None):
        out = self._mc.ReplicateConfig()
        if config is not None:
            out.replica_num = config.replica_num
            if config.preferred_segment:
                out.preferred_segment = config.preferred_segment
            if config.soft_pin:
                out.soft_pin_action = self._mc.SoftPinAction.ENABLE
        return out

    def _sealed(self, buffer: Buffer) -> bytes:
        view = as_memoryview(buffer)
        if len(view) > self.max_value:
            raise ValueTooLargeError(
                f"value of {len(view)} B exceeds {self.max_value} (max_value, or buffer= size)"
            )
        return checksum.seal(view)

    def _retry_space(self, fn) -> None:
        deadline = time.monotonic() + SPACE_RETRY_S
        while True:
            rc = fn()
            if rc == 0:
                return
            if rc != NO_SPACE:
                raise StoreUnavailableError(f"mooncake put failed with error {rc}")
            if time.monotonic() > deadline:
                raise StoreCapacityError("mooncake has no space left (everything is leased?)")
            time.sleep(0.02)  # its eviction runs in the background; give it a moment

    def put_from(self, key: Key, buffer: Buffer, config: ReplicateConfig | None = None) -> None:
        name, blob, cfg = normalize_key(key), self._sealed(buffer), self._config(config)
        self._retry_space(lambda: self._store.upsert(name, blob, cfg))

    def batch_put_from(
        self, keys: Sequence[Key], buffers: Sequence[Buffer], config: ReplicateConfig | None = None
    ) -> None:
        if len(keys) != len(buffers):
            raise InvalidInputError(f"{len(keys)} keys but {len(buffers)} buffers")
        names = [normalize_key(k) for k in keys]
        blobs = [self._sealed(b) for b in buffers]
        cfg = self._config(config)
        if names:
            self._retry_space(lambda: self._store.upsert_batch(names, blobs, cfg))

    def get(self, key: Key) -> bytes | None:
        payload = checksum.open_sealed(self._store.get(normalize_key(key)))
        return None if payload is None else bytes(payload)

    def get_into(self, key: Key, buffer: Buffer) -> int | None:
        return self.batch_get_into([key], [buffer])[0]

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Buffer]) -> list[int | None]:
        if len(keys) != len(buffers):
            raise InvalidInputError(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [as_memoryview(b, writable=True) for b in buffers]
        blobs = self._store.get_batch([normalize_key(k) for k in keys]) if keys else []
        out: list[int | None] = []
        for blob, view in zip(blobs, views, strict=True):
            payload = checksum.open_sealed(blob)
            if payload is not None and len(payload) > len(view):
                raise BufferTooSmallError(f"buffer of {len(view)} B < value of {len(payload)} B")
            if payload is not None:
                view[: len(payload)] = payload
            out.append(None if payload is None else len(payload))
        return out

    def exists(self, key: Key) -> bool:
        return self._store.is_exist(normalize_key(key)) == 1

    def batch_exists(self, keys: Sequence[Key]) -> int:
        found = self._store.batch_is_exist([normalize_key(k) for k in keys]) if keys else []
        return next((i for i, f in enumerate(found) if f != 1), len(keys))

    def remove(self, key: Key) -> bool:
        # force: a recent reader's lease must not make remove fail; a reader that races the
        # removal sees a checksum mismatch, i.e. a miss.
        return self._store.remove(normalize_key(key), True) == 0

    def close(self) -> None:
        self._store.close()
