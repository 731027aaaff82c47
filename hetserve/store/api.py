"""The KV store contract: one API over every backend (local DRAM/SSD, pool, mooncake, redis).

Who calls it: the engine's tier manager (a later issue) stores full KV blocks keyed by their
`BlockHash` and reads back the longest cached prefix; the store benchmark; operators' scripts.
Objects are typically 64 KiB to a few MiB. All methods are thread-safe unless a backend says
otherwise; a store is opened with `open_store(spec)` and closed with `close()`.

Failure contract, the same for every backend:
- A miss (absent, evicted, lost with a dead node, or failing its checksum) is `None` from
  `get`, `None` from `get_into`, `False` from `exists` and ends the run of `batch_exists`. A miss
  is never an exception and never wrong bytes: every value carries a checksum verified on read.
- `StoreCapacityError`: a put cannot find room even after eviction (everything left is leased
  or pinned, or the value exceeds the total capacity).
- `ValueTooLargeError` / `InvalidKeyError`: the caller broke a size or key limit.
- `StoreUnavailableError`: the service cannot be reached (after the backend's own retries).
- `BufferTooSmallError`: `get_into` was given a buffer smaller than the value.

Keys are `str` (at most MAX_KEY_LEN characters, no control characters) or `bytes`; bytes keys
are stored under their hex form so `BlockHash.digest` and `BlockHash.hex()` name one object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from hetserve.errors import HetserveError, InvalidInputError

MAX_KEY_LEN = 256
# Far above a KV block (a few MiB) yet small enough that one bad put cannot exhaust a node.
DEFAULT_MAX_VALUE = 1 << 30


class StoreError(HetserveError):
    """Base of the store's typed errors (all are input or environment problems)."""


class InvalidKeyError(StoreError, InvalidInputError):
    pass


class ValueTooLargeError(StoreError, InvalidInputError):
    pass


class BufferTooSmallError(StoreError, InvalidInputError):
    pass


class StoreCapacityError(StoreError):
    """No room for a put even after evicting everything evictable."""


class StoreUnavailableError(StoreError, ConnectionError):
    """The backing service cannot be reached."""


@dataclass(frozen=True)
class ReplicateConfig:
    """Placement of one put. Replicas go to distinct nodes, so `replica_num` is capped at the
    number of live nodes (backends without replicas ignore it). `preferred_segment` names a node
    (pool: an id from `stats()["nodes"]`) or segment (mooncake) for the first replica;
    `soft_pin` objects are evicted only when nothing else is left."""

    replica_num: int = 1
    preferred_segment: str | None = None
    soft_pin: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.replica_num <= 16:
            raise InvalidInputError(f"replica_num must be in 1..16, got {self.replica_num}")


Key = str | bytes
# Anything exposing the buffer protocol, or a torch CPU tensor (converted by `as_memoryview`).
Buffer = object


def normalize_key(key: Key) -> str:
    """The canonical str form of a key; raises InvalidKeyError for a key no backend accepts."""
    if isinstance(key, bytes | bytearray):
        key = bytes(key).hex()
    if not isinstance(key, str):
        raise InvalidKeyError(f"a key must be str or bytes, got {type(key).__name__}")
    if not key or len(key) > MAX_KEY_LEN:
        raise InvalidKeyError(f"a key must have 1..{MAX_KEY_LEN} characters, got {len(key)}")
    if not key.isprintable():
        raise InvalidKeyError("a key must not contain control or non-printable characters")
    return key


def as_memoryview(buf: Buffer, writable: bool = False) -> memoryview:
    """A flat byte view of `buf` (memoryview, bytes, bytearray, numpy array, torch CPU tensor)
    without copying; contiguous memory is required because the bytes move as one block."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "numpy"):  # torch.Tensor, without importing torch
        if buf.device.type != "cpu":
            raise InvalidInputError(f"store buffers must be CPU tensors, got {buf.device}")
        if not buf.is_contiguous():
            raise InvalidInputError("store buffers must be contiguous tensors")
        buf = buf.detach().view(-1).view(_torch_uint8()).numpy()
    try:
        view = memoryview(buf)
    except TypeError as exc:
        raise InvalidInputError(f"not a buffer: {type(buf).__name__}") from exc
    if not view.contiguous:
        raise InvalidInputError("store buffers must be contiguous")
    if writable and view.readonly:
        raise InvalidInputError("get_into needs a writable buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _torch_uint8():
    import torch

    return torch.uint8


class KVStore(ABC):
    """One store client. Subclasses implement the primitives; batch methods have loop defaults
    that backends override where they can move many objects in one round trip."""

    @abstractmethod
    def put_from(self, key: Key, buffer: Buffer, config: ReplicateConfig | None = None) -> None:
        """Store the bytes of `buffer` under `key` (replacing any old value)."""

    @abstractmethod
    def get_into(self, key: Key, buffer: Buffer) -> int | None:
        """Copy the value into `buffer`; return its length, or None on a miss."""

    @abstractmethod
    def get(self, key: Key) -> bytes | None:
        """The value, or None on a miss."""

    @abstractmethod
    def exists(self, key: Key) -> bool: ...

    @abstractmethod
    def remove(self, key: Key) -> bool:
        """Drop the object; True if it was there."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and memory; the store is unusable afterwards."""

    def put(self, key: Key, value: bytes, config: ReplicateConfig | None = None) -> None:
        self.put_from(key, value, config)

    def batch_put_from(
        self, keys: Sequence[Key], buffers: Sequence[Buffer], config: ReplicateConfig | None = None
    ) -> None:
        if len(keys) != len(buffers):
            raise InvalidInputError(f"{len(keys)} keys but {len(buffers)} buffers")
        for key, buf in zip(keys, buffers, strict=True):
            self.put_from(key, buf, config)

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Buffer]) -> list[int | None]:
        if len(keys) != len(buffers):
            raise InvalidInputError(f"{len(keys)} keys but {len(buffers)} buffers")
        return [self.get_into(k, b) for k, b in zip(keys, buffers, strict=True)]

    def batch_exists(self, keys: Sequence[Key]) -> int:
        """Length of the leading run of `keys` that are present (prefix semantics: a cached
        prefix is usable only up to its first missing block)."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
