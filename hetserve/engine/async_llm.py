"""AsyncLLM: the EngineCore driven by a background thread, streaming outputs to asyncio callers.

Who calls it: the OpenAI server (and any asyncio program). `submit(NewRequest)` validates in
the caller's thread and returns the request's `RequestStream`; the engine thread applies adds and
aborts between steps and hands each output to the stream's loop with call_soon_threadsafe.
Only the engine thread touches the EngineCore.

Failure contract: bad input raises `InvalidInputError` from `submit` (nothing queued). A
request that fails inside the engine ends its stream with `EngineRequestError`; the others go
on. If the engine thread itself dies, every open stream ends with `EngineDeadError`, as does
every later `submit`. A stream always ends: with a finished output or one of those errors.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from hetserve.config import EngineConfig
from hetserve.core.outputs import RequestOutput
from hetserve.core.request import NewRequest
from hetserve.core.stats import EngineStats
from hetserve.engine.core import EngineCore
from hetserve.engine.errors import EngineDeadError, EngineRequestError
from hetserve.engine.execute import describe
from hetserve.errors import HetserveError, InvalidInputError
from hetserve.native.openmp import release_thread_team

log = logging.getLogger(__name__)
BACKGROUND_TICK_S = 0.005  # how often an idle engine takes finished KV saves in

__all__ = ["AsyncLLM", "EngineDeadError", "EngineRequestError", "RequestStream", "RequestTiming"]


@dataclass(frozen=True)
class _Add:
    """Queue a checked request (the caller's thread validated it)."""

    new: NewRequest


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    """Run `fn(engine)` on the engine thread between steps; its result or error goes to
    `future` (a concurrent.futures.Future)."""

    fn: Callable[[EngineCore], Any]
    future: Future[Any]


@dataclass(frozen=True)
class _Wake:
    """Nothing to do: wakes the engine thread (at shutdown, to see the stop flag)."""


Command = (
    _Add | _Abort | _Call | _Wake
)  # what callers hand the engine thread, applied between steps


@dataclass
class RequestTiming:
    arrival: float  # when the request reached us (HTTP arrival for the server)
    first_token: float | None = None
    last_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    caller_id: str | None = None  # NewRequest.caller_id: joins a Conductor's log to ours


class RequestStream:
    """One request's cumulative outputs, ending with a finished one (or an error).

    Iterate it with `async for`. `abort()` stops the request and frees its KV blocks; it is
    idempotent and harmless after the end, so consumers call it in a `finally`.
    """

    def __init__(
        self, request_id: str, owner: AsyncLLM, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids  # known before the first output
        self.num_prompt_tokens = len(prompt_token_ids)
        self._owner = owner
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.error is not None:
            self._end()
            raise EngineRequestError(self.request_id, item.error)
        if item.finished:
            self._end()
        return item

    def abort(self) -> None:
        if not self.finished:
            self._end()
            self._owner.abort(self.request_id)

    def _end(self) -> None:
        self.finished = True
        self._owner._streams.pop(self.request_id, None)

    def _put(self, item) -> None:  # from the engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody will read this
            self._owner.abort(self.request_id)


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, engine: EngineCore | None = None):
        self.engine = engine or EngineCore(config or EngineConfig())
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.model_dir = self.engine.model_dir
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self.kv_summary = self.engine.kv_summary
        self.placement_summary = self.engine.placement_summary
        self.memory = getattr(self.engine, "memory", None)  # where host memory went at start
        self._commands: queue.Queue[Command] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._stop = threading.Event()
        self.observers: list = []  # callables(request_id, RequestOutput, RequestTiming)
        self.step_observers: list = []  # callables(tokens computed in one engine step)
        self._timings: dict[str, RequestTiming] = {}
        self._stats = self.engine.stats()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hetserve-engine", daemon=True)
        # Every step runs on the engine thread from here on: the OpenMP team that building the
        # engine left to this thread goes back, or its idle workers would make libgomp wake the
        # engine thread's own team through the kernel at each parallel region (native/openmp.py)
        release_thread_team()
        self._thread.start()

    # ---- caller side ------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def submit(self, new: NewRequest) -> RequestStream:
        """Validate `new` here, in the caller's thread (InvalidInputError names the field;
        nothing is queued), and hand it to the engine thread; returns its stream. Must be called
        from a running event loop (the stream belongs to it)."""
        checked = self.engine.validate(new)
        if not self.is_alive:
            raise EngineDeadError("the engine has stopped; restart the server")
        rid = checked.request_id
        if rid in self._streams:
            raise EngineRequestError(rid, "a request with this id is already running")
        stream = RequestStream(rid, self, checked.prompt_token_ids)
        self._streams[rid] = stream
        self._commands.put(_Add(checked))
        return stream

    async def generate(self, new: NewRequest) -> AsyncIterator[RequestOutput]:
        """Convenience over `submit`: yields outputs; leaving early aborts the request."""
        stream = self.submit(new)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    # LoRA adapters: the manager is thread-safe for these; slots change on the engine thread.
    def lora_adapters(self) -> dict[str, str]:
        """Loaded LoRA adapters: name -> directory (empty without LoRA support)."""
        return {} if self.engine.lora is None else self.engine.lora.adapters()

    def lora_ids(self) -> dict[str, str]:
        """Loaded LoRA adapters: name -> content id (a Conductor hashes their prefixes so)."""
        return {} if self.engine.lora is None else self.engine.lora.ids()

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter directory under `name` (reads files: call it off the loop)."""
        if self.engine.lora is None:
            raise InvalidInputError("this engine has no LoRA support (start it with enable_lora)")
        self.engine.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget `name`; requests already running with it finish with it."""
        if self.engine.lora is None:
            raise InvalidInputError(f"LoRA adapter {name!r} is not loaded", param="lora_name")
        self.engine.lora.unload(name)

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """`fn(engine)` run on the engine thread between steps (never beside a step): a
        measurement or an inspection that must see the engine still."""
        future: Future[Any] = Future()
        self._commands.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def kv_info(self) -> dict[str, object]:
        """How the engine names and publishes its KV (see EngineCore.kv_info; thread-safe)."""
        return self.engine.kv_info()

    def kv_snapshot(self) -> tuple[int, float, dict[str, list[bytes]]] | None:
        """Every block the KV events say the engine holds, per medium, and the event batch
        this is current as of, with its time stamp (thread-safe); None while KV events are
        off."""
        pub = self.engine.kv_events
        return None if pub is None else pub.snapshot()

    @property
    def handoff_address(self) -> str | None:
        """Where this engine receives prefill/decode hand-offs (None: it does not)."""
        return self.engine.handoff.address

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        """The engine's state as of its last step (thread-safe snapshot)."""
        return self._stats

    def routing_stats(self):
        return self.engine.routing_stats()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(_Wake())
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.engine.close()  # the KV store gets what it lacks; only now: no step runs

    # ---- engine thread ----------------------------------------------------------------------
    def _apply(self, cmd: Command) -> None:
        match cmd:
            case _Add(new):
                stream = self._streams.get(new.request_id)
                if stream is None:  # aborted before it reached the engine
                    return
                try:
                    self.engine.enqueue(new)
                    assert new.arrival_time is not None  # stamped by validation
                    timing = RequestTiming(new.arrival_time, caller_id=new.caller_id)
                    self._timings[new.request_id] = timing
                except HetserveError as exc:  # a user mistake only the engine thread could see
                    stream._put(exc)
                except Exception as exc:  # surfaces in the caller; the engine keeps going
                    log.exception("adding request %s failed", new.request_id)
                    stream._put(EngineRequestError(new.request_id, describe(exc)))
            case _Abort(request_id):
                self.engine.abort_request(request_id)
                self._timings.pop(request_id, None)
            case _Call(fn, future):
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:  # the caller gets it; the engine goes on
                    future.set_exception(exc)
            case _Wake():
                pass

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            log.exception("the engine thread died")
            self._dead = exc
        finally:
            if self._dead is None:
                self._dead = EngineDeadError("the engine was shut down")
            for stream in list(self._streams.values()):
                stream._put(EngineDeadError(f"the engine stopped: {self._dead}"))

    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished()
            # Idle but with KV saves out: wake up now and then to take them in.
            wait = 0.0 if busy else (BACKGROUND_TICK_S if self.engine.background_work() else 0.5)
            try:
                cmd = self._commands.get(timeout=wait) if wait else self._commands.get_nowait()
                self._apply(cmd)
                while True:
                    self._apply(self._commands.get_nowait())
            except queue.Empty:
                pass
            if self.engine.has_unfinished() or self.engine.background_work():
                self._step()
            before, self._stats = self._stats, self.engine.stats()
            if self.step_observers and before is not None:
                tokens = (self._stats.prompt_tokens_computed + self._stats.generation_tokens) - (
                    before.prompt_tokens_computed + before.generation_tokens
                )
                for fn in self.step_observers:
                    if tokens > 0:
                        fn(tokens)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # Outside any one request (the scheduler): the engine's state cannot be trusted for
            # the live requests, so each ends with an error; new requests are served.
            log.exception("engine step failed")
            for rid in list(self.engine.parents):
                self.engine.abort_request(rid)
                self._timings.pop(rid, None)
                stream = self._streams.get(rid)
                if stream is not None:
                    stream._put(EngineRequestError(rid, f"engine step failed: {exc}"))
            return
        now = time.monotonic()
        for out in outputs:
            self._observe(out, now)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream._put(out)

    def _observe(self, out: RequestOutput, now: float) -> None:
        timing = self._timings.get(out.request_id)
        if timing is None:
            return
        if out.finished:
            self._timings.pop(out.request_id, None)
        if out.error is None:
            if timing.first_token is None:
                timing.first_token = now
            timing.token_times.append(now)
            timing.last_token = now
        for fn in self.observers:
            fn(out.request_id, out, timing)
