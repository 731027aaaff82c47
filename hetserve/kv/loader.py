"""What the scheduler needs of the KV tiers, as a protocol: the tiers (`kv/tiers.py`) implement
it; the scheduler (`sched/scheduler.py`) calls it on the engine thread and knows nothing else of
stores, loads or threads. Defined here, below the scheduler, so neither imports the other.
"""

from __future__ import annotations

import enum
from typing import Protocol

from hetserve.core.request import Request
from hetserve.kv.block_pool import KVBlock


class LoadState(enum.Enum):
    """What `KVLoader.prepare` tells the scheduler about a waiting request."""

    WAIT = "wait"  # a store lookup is out: admit other requests meanwhile
    LOADING = "loading"  # its next blocks are being loaded into blocks the loader reserved
    READY = "ready"  # its next blocks were loaded right now: they are device prefix hits now
    NONE = "none"  # nothing to load: admit it as it is


class KVLoader(Protocol):
    def prepare(self, req: Request, computed: list[KVBlock]) -> LoadState:
        """At each admission attempt of `req`, after its device prefix hit `computed`."""
        ...

    def landed(self) -> list[Request]:
        """Requests whose loads finished (their loaded blocks are now device prefix hits)."""
        ...

    def release(self, req: Request) -> None:
        """`req` left the waiting line (admitted: its table holds the loaded blocks now;
        finished or aborted): let go of the loaded blocks held for it."""
        ...

    def release_all(self) -> int:
        """Let go of every such hold (nothing runs and the head of the queue cannot start:
        holds must not deadlock the pool). Returns the blocks released."""
        ...
