"""`mooncake://MASTER_HOST:PORT?metadata=http://H:P/metadata&segment=256M&buffer=64M&host=127.0.0.1`

An adapter to the real Mooncake Store, for clusters that already run it or need RDMA
(`protocol=rdma&devices=mlx5_0`). This client contributes `segment` bytes of its memory to the
cluster (0: use only other clients' memory). Values are stored sealed (checksum header + payload).

How bytes move (`mooncake_io.py`): over RDMA (`gather=direct`, the default for protocols other
than tcp) Mooncake's multi-buffer calls take the caller's parts as they are, no copy on our side;
over TCP (`gather=stage`, its default) header and parts are gathered into one staging buffer of
`buffer` bytes per thread, in the pass that computes the checksum, because Mooncake's TCP
transport sends each buffer as its own request. Mooncake evicts in the background once above its
high watermark, so a put refused for space is retried briefly before it becomes a capacity
error.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from hetserve.errors import InvalidInputError
from hetserve.store import checksum
from hetserve.store.api import (
    DEFAULT_MAX_VALUE,
    TIER_MOONCAKE,
    Key,
    KVStore,
    Parts,
    ReplicateConfig,
    StoreDependencyError,
    StoreUnavailableError,
    TierInfo,
    ValueTooLargeError,
    normalize_key,
)
from hetserve.store.backends.mooncake_io import Direct, Staged, diagnose
from hetserve.store.registry import StoreSpec, parse_size, register_backend


def _mooncake() -> Any:
    try:
        from mooncake import store  # type: ignore[import-untyped, import-not-found, unused-ignore]
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
        # Mooncake's own get stages in this client's buffer, and so do we over TCP: it bounds
        # the value.
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
        gather = spec.params.get("gather", "stage" if self.protocol == "tcp" else "direct")
        if gather not in ("stage", "direct"):
            raise InvalidInputError(f"mooncake gather={gather!r}: use stage or direct")
        self._direct = Direct(self._store, register=self.protocol != "tcp")
        self._staged = Staged(self._store, self.buffer) if gather == "stage" else None

    def _config(self, config: ReplicateConfig) -> Any:
        out = self._mc.ReplicateConfig()
        out.replica_num = config.replica_num
        if config.preferred_segment:
            out.preferred_segment = config.preferred_segment
        if config.soft_pin:
            out.soft_pin_action = self._mc.SoftPinAction.ENABLE
        return out

    # -- writes ---------------------------------------------------------------------------
    def _put(self, names: list[str], values: list[Parts], config: ReplicateConfig) -> None:
        for parts in values:
            n = sum(p.nbytes for p in parts)
            if n > self.max_value:
                raise ValueTooLargeError(
                    f"value of {n} B exceeds {self.max_value} (max_value, or buffer= size)"
                )
        (self._staged or self._direct).put(names, values, self._config(config))

    # -- reads ----------------------------------------------------------------------------
    def get(self, key: Key) -> bytes | None:
        payload = checksum.open_sealed(self._store.get(normalize_key(key)))
        return None if payload is None else bytes(payload)

    def _get_into(self, names: list[str], dests: list[Parts], exact: bool) -> list[int | None]:
        if self._staged is not None:
            got = self._staged.get(names, dests, exact, self.max_value)
        elif exact:
            got = self._direct.get(names, dests)
        else:  # sizes unknown: Mooncake's direct reads need them; take its copy instead
            blobs = self._store.get_batch(names)
            return [
                checksum.unseal_into(blob, d, exact, name)
                for blob, d, name in zip(blobs, dests, names, strict=True)
            ]
        for i, n in enumerate(got):
            if n == -1:  # refused: a size error for the caller, or a miss
                diagnose(self._store, names[i], dests[i], exact)
                got[i] = None
        return got

    def exists(self, key: Key) -> bool:
        return bool(self._store.is_exist(normalize_key(key)) == 1)

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
        return bool(self._store.remove(normalize_key(key), True) == 0)

    def close(self) -> None:
        self._store.close()
