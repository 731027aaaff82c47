"""Small helpers shared by the store tests and the child processes they start."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from hetserve.store import open_store

MiB = 1 << 20


def payload(n: int, seed: str) -> bytes:
    """Deterministic bytes that differ per seed (so a wrong object never passes by accident)."""
    block = hashlib.sha256(seed.encode()).digest() * 128  # 4 KiB
    reps = n // len(block) + 1
    return (block * reps)[:n]


@dataclass
class Backend:
    name: str
    spec: str
    capacity: int  # bytes a client can fill before eviction must start
    corrupt: Callable[[object, str], None]  # (store, key) -> damage the stored value
    shared: bool = True  # do other processes see the same objects?
    # One client for all tests: Mooncake's client takes a second to close, every time.
    keep_client: bool = False
    _client: object | None = None

    def open(self):
        return open_store(self.spec)

    def client(self):
        if self._client is None:
            self._client = self.open()
        return self._client

    def close_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
