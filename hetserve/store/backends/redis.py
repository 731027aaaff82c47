"""`redis://host:port/db?password=..&prefix=hetserve:kv:&max_value=512M`: Redis or Valkey.

For sites that already run Redis. Values are stored sealed (checksum header + payload) under
`prefix + key`, so other data in the same database is left alone and a damaged value is a miss.
Capacity and eviction are Redis's own (`maxmemory`, `maxmemory-policy allkeys-lru`); a write
refused for memory is a StoreCapacityError.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

from hetserve.errors import InvalidInputError
from hetserve.store import checksum
from hetserve.store.api import (
    TIER_REDIS,
    Key,
    KVStore,
    Parts,
    ReplicateConfig,
    StoreCapacityError,
    StoreDependencyError,
    StoreUnavailableError,
    TierInfo,
    ValueTooLargeError,
    normalize_key,
)
from hetserve.store.registry import StoreSpec, register_backend
from hetserve.transfer.iov import sendmsg_all

# redis-py's objects are typed Any here: its annotations are partial (untyped methods, replies
# typed as str | bytes | Awaitable), which strict checking cannot use.
T = TypeVar("T")

REDIS_MAX_VALUE = 512 << 20  # Redis's own limit on one string (proto-max-bulk-len)


def _redis() -> ModuleType:
    try:
        import redis
    except ImportError:  # an optional dependency: only redis:// users need it
        raise StoreDependencyError(
            "redis:// needs the redis client: pip install 'hetserve[redis]'"
        ) from None
    return redis


def _set_command(name: bytes, head: bytes, parts: Parts) -> list[bytes | memoryview]:
    """SET name <head + parts> in RESP, with the parts as they are (the value is never joined)."""
    size = len(head) + sum(p.nbytes for p in parts)
    first = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (len(name), name, size, head)
    return [first, *(p for p in parts if p.nbytes), b"\r\n"]


def _send(conn: Any, pieces: list[memoryview]) -> None:
    """All pieces in as few system calls as the kernel allows (sendmsg gathers them): redis-py
    would call sendall once per piece, and 96 small writes per value cost more than the value's
    copy. TLS sockets cannot gather; they take redis-py's path."""
    sock = getattr(conn, "_sock", None)  # redis-py's connected socket (stable since 2.x)
    if type(sock) is not socket.socket:
        conn.send_packed_command(pieces)
        return
    try:
        sendmsg_all(sock, pieces)
    except OSError as exc:  # as redis-py does: the stream is broken, drop the connection
        conn.disconnect()
        redis = _redis()
        kind = redis.TimeoutError if isinstance(exc, TimeoutError) else redis.ConnectionError
        raise kind(f"error writing to redis: {exc}") from exc


@register_backend("redis")
class RedisStore(KVStore):
    """Copies: a put hands the caller's parts to the kernel as they are (RESP framing around
    them, one sendmsg: no joined value). A read cannot avoid one copy: redis-py's parser hands
    each reply back as a `bytes` object, which is copied into the caller's parts with the
    checksum taken as the bytes land (one pass); reading the socket ourselves would mean our own
    RESP client."""

    def __init__(self, spec: StoreSpec) -> None:
        redis = _redis()
        db = spec.path.strip("/") or "0"
        if not db.isdigit():
            raise InvalidInputError(f"redis database must be a number, got {db!r}")
        self.prefix = spec.params.get("prefix", "hetserve:kv:")
        self.max_value = min(spec.size("max_value", REDIS_MAX_VALUE), REDIS_MAX_VALUE)
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self._r: Any = redis.Redis(
            host=spec.host or "127.0.0.1",
            port=spec.port or 6379,
            db=int(db),
            password=spec.params.get("password") or spec.token() or None,
            socket_timeout=spec.number("timeout", 30.0),
            socket_connect_timeout=5.0,
        )
        self._run(self._r.ping)  # fail fast on a wrong address or password

    def _run(self, fn: Callable[..., T], *args: Any) -> T:
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

    # -- writes ---------------------------------------------------------------------------
    def _put(self, names: list[str], values: list[Parts], config: ReplicateConfig) -> None:
        commands = []
        for name, parts in zip(names, values, strict=True):
            n = sum(p.nbytes for p in parts)
            if n > self.max_value:
                raise ValueTooLargeError(f"value of {n} B exceeds max_value={self.max_value}")
            head = checksum.pack_header(n, checksum.digest_parts(parts))
            commands.append(_set_command((self.prefix + name).encode(), head, parts))
        self._run(self._pipelined, commands)

    def _pipelined(self, commands: list[list[bytes | memoryview]]) -> None:
        """Send every command, then read every reply (the connection stays in step even when
        one reply is an error, e.g. OOM, which is raised after the others are read)."""
        pool = self._r.connection_pool
        conn = pool.get_connection()
        try:
            _send(conn, [memoryview(piece) for cmd in commands for piece in cmd])
            errors = []
            for _ in commands:
                try:
                    conn.read_response()
                except _redis().ResponseError as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
        finally:
            pool.release(conn)

    # -- reads ----------------------------------------------------------------------------
    def get(self, key: Key) -> bytes | None:
        payload = checksum.open_sealed(self._run(self._r.get, self._name(key)) or b"")
        return None if payload is None else bytes(payload)

    def _get_into(self, names: list[str], dests: list[Parts], exact: bool) -> list[int | None]:
        blobs = self._run(self._r.mget, [self.prefix + n for n in names])
        return [
            checksum.unseal_into(blob, dest, exact, name)
            for blob, dest, name in zip(blobs, dests, names, strict=True)
        ]

    # -- the rest -------------------------------------------------------------------------
    def exists(self, key: Key) -> bool:
        return bool(self._run(self._r.exists, self._name(key)))

    def batch_exists(self, keys: Sequence[Key]) -> int:
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._name(key))
        found = self._run(pipe.execute) if keys else []
        return next((i for i, f in enumerate(found) if not f), len(keys))

    def batch_locate(self, keys: Sequence[Key]) -> list[str | None]:
        n = self.batch_exists(keys)
        return [TIER_REDIS] * n + [None] * (len(keys) - n)

    def tiers(self) -> list[TierInfo]:
        """Used and maximum memory of the whole server (`maxmemory` 0, no limit: None)."""
        info = self._run(self._r.info, "memory")
        cap = int(info.get("maxmemory", 0)) or None
        return [TierInfo(TIER_REDIS, cap, int(info["used_memory"]), shared=True)]

    def remove(self, key: Key) -> bool:
        return bool(self._run(self._r.delete, self._name(key)))

    def close(self) -> None:
        self._r.close()
