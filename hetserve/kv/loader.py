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

    def ready_prefix(self, req: Request) -> tuple[list[KVBlock], int] | None:
        """After READY: the blocks and token count `req` is admitted with, where the loader
        knows them exactly (a hand-off's partial last block); None: look the prefix up in the
        device prefix cache."""
        ...


class Loaders:
    """The scheduler's one loader over a hand-off receiver and the KV tiers: a request that
    receives a hand-off asks the receiver first, and the tiers once the receiver gave up."""

    def __init__(self, handoff: KVLoader | None, tiers: KVLoader | None) -> None:
        self.handoff, self.tiers = handoff, tiers
        self._parts = [p for p in (handoff, tiers) if p is not None]

    def prepare(self, req: Request, computed: list[KVBlock]) -> LoadState:
        if self.handoff is not None and req.kv_handoff is not None:
            state = self.handoff.prepare(req, computed)
            if state is not LoadState.NONE:
                return state
        return self.tiers.prepare(req, computed) if self.tiers is not None else LoadState.NONE

    def landed(self) -> list[Request]:
        return [r for p in self._parts for r in p.landed()]

    def release(self, req: Request) -> None:
        for p in self._parts:
            p.release(req)

    def release_all(self) -> int:
        return sum(p.release_all() for p in self._parts)

    def ready_prefix(self, req: Request) -> tuple[list[KVBlock], int] | None:
        for p in self._parts:
            ready = p.ready_prefix(req)
            if ready is not None:
                return ready
        return None
