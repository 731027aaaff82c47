"""Store backends by URL-like spec: `scheme://host:port/path?param=value`.

    local://?dram=1G&ssd_dir=/tmp/kv&ssd=4G     in-process DRAM LRU spilling to SSD files
    pool://127.0.0.1:7600?token=...             hetserve's own pool service (store master)
    mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata&segment=512M
    redis://127.0.0.1:6379/0

Every backend has the uniform constructor `Backend(spec: StoreSpec)`; its module registers it
here on import, and `open_store` imports the module on first use (so redis or mooncake clients are
needed only by those who use them). A parameter the backend did not read while it opened (a
typo, or one that the rest of the spec leaves unused) is an InvalidInputError naming it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

from hetserve import envs
from hetserve.errors import InvalidInputError
from hetserve.registry import Registry
from hetserve.store.api import KVStore

# Each scheme's module registers its backend on import (so redis and mooncake clients are
# needed only by those who use them).
STORES: Registry[Callable[[StoreSpec], KVStore]] = Registry(
    "store backend",
    {
        "local": "hetserve.store.backends.local",
        "pool": "hetserve.store.pool.client",
        "mooncake": "hetserve.store.backends.mooncake",
        "redis": "hetserve.store.backends.redis",
    },
)
TOKEN_ENV = envs.STORE_TOKEN
B = TypeVar("B", bound=KVStore)
SECRET_PARAMS = frozenset({"token", "password"})


class Params(dict[str, str]):
    """A spec's parameters, remembering the ones a backend read (`read`)."""

    def __init__(self, items: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(items)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)


@dataclass(frozen=True)
class StoreSpec:
    scheme: str
    host: str | None = None
    port: int | None = None
    path: str = ""
    params: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.redacted()

    def size(self, name: str, default: int) -> int:
        raw = self.params.get(name)
        return default if raw is None else parse_size(raw)

    def number(self, name: str, default: float) -> float:
        raw = self.params.get(name)
        try:
            return default if raw is None else float(raw)
        except ValueError as exc:
            raise InvalidInputError(f"store spec parameter {name}={raw!r} is not a number") from exc

    def token(self) -> str:
        return self.params.get("token") or env_token()

    def redacted(self) -> str:
        """The spec as a URL with secrets masked: safe in logs and error messages."""
        netloc = self.host or ""
        if self.port is not None:
            netloc += f":{self.port}"
        params = [f"{k}={'***' if k in SECRET_PARAMS else v}" for k, v in self.params.items()]
        query = "?" + "&".join(params) if params else ""
        return f"{self.scheme}://{netloc}{self.path}{query}"


def env_token() -> str:
    return envs.store_token()


def register_backend(scheme: str) -> Callable[[type[B]], type[B]]:
    def deco(cls: type[B]) -> type[B]:
        STORES.register(scheme)(cls)
        return cls

    return deco


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'4K' -> 4096, '1.5G' -> 1610612736 (binary units), '100' -> 100."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise InvalidInputError(f"not a size: {text!r} (use e.g. 4K, 64M, 1G)")
    scale = 1 << (10 * " kmgt".index(m.group(2).lower() or " "))
    return int(float(m.group(1)) * scale)


def parse_spec(spec: str) -> StoreSpec:
    parts = urlsplit(spec)
    if parts.scheme not in STORES:
        known = ", ".join(STORES.names())
        raise InvalidInputError(f"unknown store backend in {spec!r}; known schemes: {known}")
    try:
        port = parts.port
    except ValueError as exc:
        raise InvalidInputError(f"bad port in store spec {spec!r}") from exc
    return StoreSpec(
        scheme=parts.scheme,
        host=parts.hostname,
        port=port,
        path=parts.path,
        params=Params(parse_qsl(parts.query)),
    )


def open_store(spec: str | StoreSpec) -> KVStore:
    """Open a store client from its spec string (see the module docstring)."""
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    store = STORES.get(parsed.scheme)(parsed)
    params = parsed.params
    if isinstance(params, Params):
        unused = sorted(set(params) - params.read - SECRET_PARAMS)
        if unused:
            store.close()
            used = ", ".join(sorted(params.read - SECRET_PARAMS)) or "none"
            raise InvalidInputError(
                f"store spec {parsed.redacted()}: {parsed.scheme}:// does not use parameter "
                f"{unused[0]!r} here (it read: {used})"
            )
    store.label = parsed.redacted()
    return store
