"""The KV store contract: one API over every backend (local DRAM/SSD, pool, mooncake, redis).

Who calls it: the engine's tier component stores full KV blocks keyed by their `BlockHash` and
reads back the longest cached prefix; the store benchmark; operators' scripts. Objects are
typically 64 KiB to a few MiB. All methods are thread-safe unless a backend says otherwise; a
store is opened with `open_store(spec)` and closed with `close()`.

A value is one byte string. The `*_parts` calls move it from or into a list of buffers (the
engine keeps one KV tensor per layer, so a block lies in 2 x num_layers pieces): the value is the
concatenation of the parts, and backends move the bytes without a staging copy where they can.
Which tier holds a key (`batch_locate`) and what the tiers hold (`tiers()`) let a caller predict
how long a load takes; `selfcheck.self_check` measures it.

Failure contract, the same for every backend:
- A miss (absent, evicted, lost with a dead node, or failing its checksum) is `None` from
  `get` and the `get_into*` calls, `False` from `exists`, and ends the run of `batch_exists` and
  `batch_locate`. A miss is never an exception and never wrong bytes: every value carries a
  checksum of the whole value, verified on read (the destination of a miss holds unspecified
  bytes: they may have landed before the checksum failed).
- `StoreCapacityError`: a put cannot find room even after eviction (everything left is leased
  or pinned, or the value exceeds the total capacity).
- `ValueTooLargeError` / `InvalidKeyError`: the caller broke a size or key limit.
- `StoreUnavailableError`: the service cannot be reached (after the backend's own retries).
- `BufferTooSmallError`: `get_into` was given a buffer smaller than the value.
- `SizeMismatchError`: `get_into_parts` was given parts whose total is not the value's size
  (the caller's layout differs from the writer's; keys should tell layouts apart).
- `StoreDependencyError` (at open): the backend's client library is not installed; the message
  names the extra to install.

Keys are `str` (at most MAX_KEY_LEN characters, no control characters) or `bytes`; bytes keys
are stored under their hex form so `BlockHash.digest` and `BlockHash.hex()` name one object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hetserve.errors import HetserveError, InvalidInputError

if TYPE_CHECKING:  # torch is imported only when a tensor is passed
    import numpy as np
    import torch

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


class SizeMismatchError(StoreError, InvalidInputError):
    pass


class StoreDependencyError(StoreError):
    """A backend's client library is not installed."""


class StoreCapacityError(StoreError):
    """No room for a put even after evicting everything evictable."""


class StoreUnavailableError(StoreError, ConnectionError):
    """The backing service cannot be reached."""


@dataclass(frozen=True)
class ReplicateConfig:
    """Placement of one put. Replicas go to distinct nodes, so `replica_num` is capped at the
    number of live nodes (backends without replicas ignore it). `preferred_segment` names a node
    (pool: an id from `stats()["nodes"]`) or segment (mooncake) for the first replica;
    `soft_pin` objects are evicted only when nothing else is left, for `soft_pin_ttl_s` seconds
    when given (an agent session's KV: kept while the session is live), else for good. The
    local and pool backends honour the pin and its TTL; Redis and Mooncake evict by their own
    policy."""

    replica_num: int = 1
    preferred_segment: str | None = None
    soft_pin: bool = False
    soft_pin_ttl_s: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.replica_num <= 16:
            raise InvalidInputError(f"replica_num must be in 1..16, got {self.replica_num}")
        ttl = self.soft_pin_ttl_s
        if ttl is not None and not (self.soft_pin and ttl > 0):
            raise InvalidInputError("soft_pin_ttl_s needs soft_pin and a positive number")


Key = str | bytes
# Told where an object went: (normalized name, tier it was in, tier it is in; None = absent).
PlacementListener = Callable[[str, str | None, str | None], None]
# Anything exposing the buffer protocol, or a torch CPU tensor (converted by `as_memoryview`).
Buffer = object
# One value as flat byte views, in order: the value is their concatenation.
Parts = list[memoryview]

# Tier names `batch_locate` answers and `tiers()` lists (a vocabulary shared with the engine's
# tier component and, later, a cluster scheduler that routes on where a block is).
TIER_DRAM, TIER_SSD = "dram", "ssd"  # the local backend's two tiers
TIER_POOL, TIER_POOL_SHM = "pool", "pool-shm"  # pool nodes over TCP / mapped on this host
TIER_MOONCAKE, TIER_REDIS = "mooncake", "redis"


@dataclass(frozen=True)
class TierInfo:
    """One tier a store reads from, for a startup line and metrics. `capacity`/`used` are
    bytes, None where the backend cannot tell; `shared` says whether other processes see the
    objects (so writing prompt blocks through at once lets other instances reuse them);
    `placeable`: a put with `ReplicateConfig(preferred_segment=name)` lands in this tier."""

    name: str
    capacity: int | None
    used: int | None
    shared: bool
    placeable: bool = False


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
    without copying; contiguous memory is required because the bytes move as one block. Cheap
    on a flat memoryview (~0.1 us); a torch tensor costs a few us, so callers that move the same
    tensors often convert each once and pass slices of its view."""
    if type(buf) is memoryview:
        view = buf
    else:
        try:
            view = memoryview(buf)  # type: ignore[arg-type]  # TypeError below says what was wrong
        except TypeError as exc:
            if not (hasattr(buf, "data_ptr") and hasattr(buf, "numpy")):
                raise InvalidInputError(f"not a buffer: {type(buf).__name__}") from exc
            view = _tensor_array(buf).data  # type: ignore[arg-type]  # a torch.Tensor
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise InvalidInputError("store buffers must be contiguous")
        view = view.cast("B")
    elif not view.contiguous:
        raise InvalidInputError("store buffers must be contiguous")
    if writable and view.readonly:
        raise InvalidInputError("get_into needs a writable buffer")
    return view


def as_parts(parts: Sequence[Buffer], writable: bool = False) -> Parts:
    if not isinstance(parts, list | tuple):  # a tensor or array would iterate as rows or scalars
        raise InvalidInputError(f"parts must be a list or tuple of buffers, not {type(parts)}")
    return [as_memoryview(p, writable) for p in parts]


def fit_parts(dest: Parts, size: int, exact: bool, name: str) -> Parts:
    """`dest` cut to a value of `size` bytes. `exact` (the parts calls): the parts must total
    `size`; otherwise `dest` is one buffer that may be larger than the value."""
    if exact:
        have = sum(p.nbytes for p in dest)
        if have != size:
            raise SizeMismatchError(
                f"the destination parts hold {have} bytes but {name!r} has {size}"
            )
        return dest
    if len(dest[0]) < size:
        raise BufferTooSmallError(f"buffer of {len(dest[0])} B < value of {size} B")
    return [dest[0][:size]]


_NUMPY_LACKS: set[Any] = set()  # torch dtypes .numpy() refuses (bfloat16, float8, ...)


def _tensor_array(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """The numpy array sharing a CPU tensor's memory (reinterpreted as bytes for dtypes numpy
    lacks, such as bfloat16)."""
    if not t.is_cpu:
        raise InvalidInputError(f"store buffers must be CPU tensors, got {t.device}")
    if not t.is_contiguous():
        raise InvalidInputError("store buffers must be contiguous tensors")
    if t.requires_grad:
        t = t.detach()
    if t.dtype not in _NUMPY_LACKS:
        try:
            return t.numpy()
        except TypeError:
            _NUMPY_LACKS.add(t.dtype)  # remembered: the exception costs more than the rest
    import torch

    return t.view(torch.uint8).numpy()


def _pairs(keys: Sequence[Key], values: Sequence[object], what: str) -> list[str]:
    if len(keys) != len(values):
        raise InvalidInputError(f"{len(keys)} keys but {len(values)} {what}")
    return [normalize_key(k) for k in keys]


class KVStore(ABC):
    """One store client. Backends implement the primitives (`_put`, `_get_into`, `get`,
    `exists`, `remove`, `batch_locate`, `tiers`, `close`); the public calls validate and map
    onto them, and backends override the batch calls where they can do better than a loop."""

    label: str = ""  # the spec it was opened with, secrets redacted (for one-line messages)

    # -- primitives -------------------------------------------------------------------------
    @abstractmethod
    def _put(self, names: list[str], values: list[Parts], config: ReplicateConfig) -> None:
        """Store each value (the concatenation of its parts) under its name, replacing any old
        value. Names are normalized; all of them are stored, or an error is raised."""

    @abstractmethod
    def _get_into(self, names: list[str], dests: list[Parts], exact: bool) -> list[int | None]:
        """Read each value into its destination, cut by `fit_parts(dest, size, exact, name)`
        once the size is known; its length, or None on a miss."""

    @abstractmethod
    def get(self, key: Key) -> bytes | None:
        """The value, or None on a miss."""

    @abstractmethod
    def exists(self, key: Key) -> bool: ...

    @abstractmethod
    def remove(self, key: Key) -> bool:
        """Drop the object; True if it was there."""

    @abstractmethod
    def batch_locate(self, keys: Sequence[Key]) -> list[str | None]:
        """Per key, the tier that would serve its read now (a TIER_* name), with prefix
        semantics: from the first miss on every entry is None, as `batch_exists` stops there.
        An answer, not a lease: the object may move or go before it is read."""

    @abstractmethod
    def tiers(self) -> list[TierInfo]:
        """The tiers `batch_locate` may name, with their capacity and use."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and memory; the store is unusable afterwards."""

    def watch(self, listener: PlacementListener) -> bool:
        """Have `listener(name, old_tier, new_tier)` called whenever an object arrives in a
        tier, moves between tiers or leaves the store (None: not there), from whichever thread
        moved it and under the store's lock (the listener only records; it must not call the
        store). Returns False, and never calls it, where the backend cannot tell: objects that
        other processes place and evict (pool, Mooncake, Redis)."""
        return False

    def make_cold(self, key: Key) -> None:
        """Make the next read of `key` come from its medium, not a cache in front of it (the
        SSD tier drops the page cache), so a probe or a benchmark measures what a load after a
        restart would see. A no-op where the backend has no such cache."""
        return None

    # -- one buffer per value ---------------------------------------------------------------
    def put_from(self, key: Key, buffer: Buffer, config: ReplicateConfig | None = None) -> None:
        """Store the bytes of `buffer` under `key` (replacing any old value)."""
        self._put([normalize_key(key)], [[as_memoryview(buffer)]], config or ReplicateConfig())

    def put(self, key: Key, value: bytes, config: ReplicateConfig | None = None) -> None:
        self.put_from(key, value, config)

    def get_into(self, key: Key, buffer: Buffer) -> int | None:
        """Copy the value into the front of `buffer`; return its length, or None on a miss."""
        view = as_memoryview(buffer, writable=True)
        return self._get_into([normalize_key(key)], [[view]], exact=False)[0]

    def batch_put_from(
        self, keys: Sequence[Key], buffers: Sequence[Buffer], config: ReplicateConfig | None = None
    ) -> None:
        names = _pairs(keys, buffers, "buffers")
        if names:
            self._put(names, [[as_memoryview(b)] for b in buffers], config or ReplicateConfig())

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Buffer]) -> list[int | None]:
        names = _pairs(keys, buffers, "buffers")
        views = [[as_memoryview(b, writable=True)] for b in buffers]
        return self._get_into(names, views, exact=False) if names else []

    # -- several buffers per value ----------------------------------------------------------
    def put_parts(
        self, key: Key, parts: Sequence[Buffer], config: ReplicateConfig | None = None
    ) -> None:
        """Store the concatenation of `parts` under `key`, read from the parts in place."""
        self._put([normalize_key(key)], [as_parts(parts)], config or ReplicateConfig())

    def get_into_parts(self, key: Key, parts: Sequence[Buffer]) -> int | None:
        """Scatter the value over `parts` in order; their total must be the value's size
        (SizeMismatchError otherwise). Returns that size, or None on a miss."""
        dest = as_parts(parts, writable=True)
        return self._get_into([normalize_key(key)], [dest], exact=True)[0]

    def batch_put_parts(
        self,
        keys: Sequence[Key],
        parts_per_key: Sequence[Sequence[Buffer]],
        config: ReplicateConfig | None = None,
    ) -> None:
        names = _pairs(keys, parts_per_key, "part lists")
        if names:
            values = [as_parts(p) for p in parts_per_key]
            self._put(names, values, config or ReplicateConfig())

    def batch_get_into_parts(
        self, keys: Sequence[Key], parts_per_key: Sequence[Sequence[Buffer]]
    ) -> list[int | None]:
        names = _pairs(keys, parts_per_key, "part lists")
        dests = [as_parts(p, writable=True) for p in parts_per_key]
        return self._get_into(names, dests, exact=True) if names else []

    # -- presence ---------------------------------------------------------------------------
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


def prefix_tiers(tiers: Sequence[str | None]) -> list[str | None]:
    """`tiers` with every entry from the first None on set to None (batch_locate's shape)."""
    out = list(tiers)
    for i, tier in enumerate(out):
        if tier is None:
            out[i:] = [None] * (len(out) - i)
            break
    return out
