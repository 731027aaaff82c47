"""Background responses (`background: true` on /v1/responses): the generation runs as a task
of its own, not tied to the HTTP request that created it, and its events are kept so a client
can read them again.

Who calls it: `server/responses.py`. `create` starts a `BackgroundRun` (after the request's
checks, so a mistake is still the create call's 400) and answers at once, the response
`queued` (or, with `stream: true`, its events as they come). `GET /v1/responses/{id}` answers
the response as it stands (the output items so far while it runs), `GET ...?stream=true
&starting_after=N` the events after sequence number N and then the live ones until it ends,
and `POST /v1/responses/{id}/cancel` stops it (its requests are aborted, their KV blocks freed
at the engine's next step) and answers it `cancelled`; cancelling one that ended answers it as
it ended. A client that disconnects stops nothing: that is what background is for.

Bounds: at most `max_running` run at once (one more is a 429 with Retry-After: a client could
otherwise queue work without end, no connection held); the runs' events are kept for the
newest `keep` runs (their responses stay in the
response store as any other); an older run's events are gone and streaming it again is a 400
naming why. Failure contract: an engine failure ends the run `failed` with the error in the
response (never an exception to a caller); a request for events of a response that did not run
in the background is a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

MAX_KEPT_RUNS = 64
MAX_RUNNING = 256  # background responses generating at once; one more is a 429
ENDED = ("completed", "incomplete", "failed", "cancelled")


class BackgroundRun:
    """One background response: its events as sent (sequence number = index), the response as
    it stands, and the task that produces them."""

    def __init__(self, rid: str, response: dict, items: Any, streams: list) -> None:
        self.rid = rid
        self.response = response  # the latest snapshot any event carried
        self.items = items  # the output items being built (an OutputItems)
        self.streams = streams
        self.events: list[dict] = []
        self.task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    @property
    def ended(self) -> bool:
        return self.task is not None and self.task.done()

    def start(self, events: AsyncIterator[dict], on_end: Callable[[BackgroundRun], None]) -> None:
        async def drive() -> None:
            try:
                async for e in events:
                    self.events.append(e)
                    if "response" in e:
                        self.response = e["response"]
                    self._wake()
            finally:
                for s in self.streams:
                    s.abort()
                if self.response.get("status") not in ENDED:  # cancelled, or ended unseen
                    self.response = {**self.snapshot(), "status": "cancelled"}
                on_end(self)
                self._wake()

        self.task = asyncio.get_running_loop().create_task(drive())

    def snapshot(self) -> dict:
        """The response as it stands: while it runs, with the output items done so far."""
        if self.ended or self.response.get("status") in ENDED:
            return copy.deepcopy(self.response)
        return {**copy.deepcopy(self.response), "output": copy.deepcopy(self.items.items)}

    async def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def follow(self, after: int) -> AsyncIterator[dict]:
        """The events with a sequence number above `after`, then each new one until it ends."""
        i = max(after + 1, 0)
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.ended:
                return
            await self._changed.wait()  # set by the next event (no await since the check)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class BackgroundRuns:
    """The runs whose events are kept: every unfinished one, and the newest `keep` ended."""

    def __init__(self, keep: int = MAX_KEPT_RUNS, max_running: int = MAX_RUNNING) -> None:
        self.keep, self.max_running = keep, max_running
        self._runs: OrderedDict[str, BackgroundRun] = OrderedDict()

    def add(self, run: BackgroundRun) -> None:
        self._runs[run.rid] = run
        ended = [rid for rid, r in self._runs.items() if r.ended]
        for rid in ended[: max(0, len(ended) - self.keep)]:
            del self._runs[rid]

    def get(self, rid: str) -> BackgroundRun | None:
        return self._runs.get(rid)

    def pop(self, rid: str) -> BackgroundRun | None:
        return self._runs.pop(rid, None)

    def running(self) -> int:
        return sum(not r.ended for r in self._runs.values())
