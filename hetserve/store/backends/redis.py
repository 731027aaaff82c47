"""`redis://host:port/db?password=..&prefix=hetserve:kv:&max_value=512M`: Redis or Valkey.

For sites that already run Redis. Values are stored sealed (checksum header + payload) under
`prefix + key`, so other data in the same database is left alone and a damaged value is a miss.
Capacity and eviction are Redis's own (`maxmemory`, `maxmemory-policy allkeys-lru`); a write
refused for memory is a StoreCapacityError.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetserve.store import checksum
from hetserve.store.api import (
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
from hetserve.store.registry import StoreSpec, register_backend

REDIS_MAX_VALUE = 512 << 20  # Redis's own limit on one string (proto-max-bulk-len)


def _redis():
    try:
        import redis
    except ImportError as exc:  # an optional dependency: only redis:// users need it
        raise StoreUnavailableError("redis:// needs the redis package: pip install redis") from exc
    return redis


@register_backend("redis")
class RedisStore(KVStore):
    def __init__(self, spec: StoreSpec) -> None:
        redis = _redis()
        db = spec.path.strip("/") or "0"
        if not db.isdigit():
            raise InvalidInputError(f"redis database must be a number, got {db!r}")
        self.prefix = spec.params.get("prefix", "hetserve:kv:")
        self.max_value = min(spec.size("max_value", REDIS_MAX_VALUE), REDIS_MAX_VALUE)
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self._r = redis.Redis(
            host=spec.host or "127.0.0.1",
            port=spec.port or 6379,
            db=int(db),
            password=spec.params.get("password") or spec.token() or None,
            socket_timeout=spec.number("timeout", 30.0),
            socket_connect_timeout=5.0,
        )
        self._run(self._r.ping)  # fail fast on a wrong address or password

    def _run(self, fn, *args):
        redis = _redis()
        try:
            return fn(*args)
        except self._errors as exc:
            raise StoreUnavailableError(f"redis unreachable: {exc}") from exc
        except redis.ResponseError as exc:
            if "OOM" in str(exc) or "maxmemory" in str(exc):
                raise StoreCapacityError(f"redis is full: {exc}") from exc
            raise
        except redis.AuthenticationError as exc:
            raise StoreUnavailableError(f"redis refused our password: {exc}") from exc

    def _name(self, key: Key) -> str:
        return self.prefix + normalize_key(key)

    def _sealed(self, buffer: Buffer) -> bytes:
        view = as_memoryview(buffer)
        if len(view) > self.max_value:
            raise ValueTooLargeError(f"value of {len(view)} B exceeds max_value={self.max_value}")
        return checksum.seal(view)

    def put_from(self, key: Key, buffer: Buffer, config: ReplicateConfig | None = None) -> None:
        self._run(self._r.set, self._name(key), self._sealed(buffer))

    def batch_put_from(
        self, keys: Sequence[Key], buffers: Sequence[Buffer], config: ReplicateConfig | None = None
    ) -> None:
        if len(keys) != len(buffers):
            raise InvalidInputError(f"{len(keys)} keys but {len(buffers)} buffers")
        pipe = self._r.pipeline(transaction=False)
        for key, buf in zip(keys, buffers, strict=True):
            pipe.set(self._name(key), self._sealed(buf))
        self._run(pipe.execute)

    def get(self, key: Key) -> bytes | None:
        payload = checksum.open_sealed(self._run(self._r.get, self._name(key)) or b"")
        return None if payload is None else bytes(payload)

    def get_into(self, key: Key, buffer: Buffer) -> int | None:
        return self.batch_get_into([key], [buffer])[0]

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Buffer]) -> list[int | None]:
        if len(keys) != len(buffers):
            raise InvalidInputError(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [as_memoryview(b, writable=True) for b in buffers]
        blobs = self._run(self._r.mget, [self._name(k) for k in keys]) if keys else []
        out: list[int | None] = []
        for blob, view in zip(blobs, views, strict=True):
            payload = checksum.open_sealed(blob or b"")
            if payload is None:
                out.append(None)
                continue
            if len(payload) > len(view):
                raise BufferTooSmallError(f"buffer of {len(view)} B < value of {len(payload)} B")
            view[: len(payload)] = payload
            out.append(len(payload))
        return out

    def exists(self, key: Key) -> bool:
        return bool(self._run(self._r.exists, self._name(key)))

    def batch_exists(self, keys: Sequence[Key]) -> int:
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._name(key))
        found = self._run(pipe.execute) if keys else []
        return next((i for i, f in enumerate(found) if not f), len(keys))

    def remove(self, key: Key) -> bool:
        return bool(self._run(self._r.delete, self._name(key)))

    def close(self) -> None:
        self._r.close()
