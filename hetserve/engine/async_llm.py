"""AsyncLLM: the EngineCore driven by a background thread, streaming outputs to asyncio callers.

The engine is not thread-safe, so only the engine thread touches it: callers enqueue add/abort
commands; the thread applies them between steps and hands each RequestOutput to the caller's
asyncio queue with call_soon_threadsafe. Cancelling a caller's iteration aborts its request,
which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from hetserve.config import EngineConfig
from hetserve.core.outputs import RequestOutput
from hetserve.core.sampling import SamplingParams
from hetserve.engine.core import EngineCore

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclass
class RequestTiming:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    token_times: list[float] = field(default_factory=list)


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, engine: EngineCore | None = None):
        self.engine = engine or EngineCore(config or EngineConfig())
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self.observers: list = []  # callables(request_id, RequestOutput, RequestTiming)
        self._timings: dict[str, RequestTiming] = {}
        self._thread = threading.Thread(target=self._loop, name="hetserve-engine", daemon=True)
        self._thread.start()

    # ---- caller side ------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs until the request finishes. Raises InvalidInputError for a
        bad prompt before anything is queued."""
        self.engine.validate_prompt(prompt_token_ids)
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread has stopped")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._commands.put(("add", request_id, prompt_token_ids, params, prompt, priority))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("noop",))
        self._thread.join(timeout=10)

    def stats(self) -> dict:
        eng = self.engine
        pool = eng.kv.pool
        return {
            "running": len(eng.scheduler.running),
            "waiting": len(eng.scheduler.waiting),
            "kv_blocks_used": pool.num_usable - pool.num_free,
            "kv_blocks_total": pool.num_usable,
            "prefix_queries": pool.queries,
            "prefix_hits": pool.hits,
            "preemptions": eng.stats.preemptions,
        }

    # ---- engine thread ----------------------------------------------------------------------
    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, ids, params, prompt, priority = cmd
            try:
                self.engine.add_request(rid, ids, params, prompt=prompt, priority=priority)
                self._timings[rid] = RequestTiming(time.monotonic())
            except Exception as exc:  # surfaces in the caller as an error, engine keeps going
                self._deliver(rid, exc)
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
            self._timings.pop(cmd[1], None)

    def _loop(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
                self._apply(cmd)
                while True:
                    self._apply(self._commands.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # our bug: fail the live requests, keep serving new ones
                log.exception("engine step failed")
                for rid in list(self.engine.parents):
                    self.engine.abort_request(rid)
                    self._deliver(rid, exc)
                continue
            now = time.monotonic()
            for out in outputs:
                self._observe(out, now)
                self._deliver(out.request_id, out)

    def _observe(self, out: RequestOutput, now: float) -> None:
        timing = self._timings.get(out.request_id)
        if timing is None:
            return
        if timing.first_token is None:
            timing.first_token = now
        timing.token_times.append(now)
        timing.last_token = now
        if out.finished:
            self._timings.pop(out.request_id, None)
        for fn in self.observers:
            fn(out.request_id, out, timing)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, item)
