"""`--log-requests FILE`: one line per finished request in hetserve's request-log format
(`sim/trace.py`: arrival, prompt and output lengths, the prompt's chained block hashes, and what
was measured), so `hetserve sim --trace FILE` replays this server's real traffic.

Who calls it: `hetserve serve` installs `RequestLogger.observe` among the engine's observers
(the engine thread calls it with every output; it acts on finished ones only, and hands them
to its own thread, which hashes and writes: the engine never waits on the log). Failure
contract: a log that cannot be written is logged once and the request goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from hetserve.core.outputs import RequestOutput
from hetserve.core.trace_record import RequestLogWriter, log_record

log = logging.getLogger(__name__)


def tbt_ms(token_times: list[float]) -> float | None:
    """Mean of the longest 10% of a request's token intervals (the Mooncake paper's TBT)."""
    gaps = sorted((b - a for a, b in zip(token_times, token_times[1:], strict=False)), reverse=True)
    if not gaps:
        return None
    top = gaps[: max(1, len(gaps) // 10)]
    return sum(top) / len(top) * 1e3


class RequestLogger:
    def __init__(self, path: str, block_size: int, hash_seed: bytes) -> None:
        self.writer = RequestLogWriter(path)
        self.block_size, self.seed = block_size, hash_seed
        self.start = time.monotonic()
        self._failed = False
        self._todo: queue.SimpleQueue[tuple[RequestOutput, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hetserve-reqlog")
        self._thread.start()

    def observe(self, request_id: str, out: RequestOutput, timing: Any) -> None:
        if out.finished and out.error is None:
            self._todo.put((out, timing))

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            self._write(*item)

    def _write(self, out: RequestOutput, timing: Any) -> None:
        try:
            # KV handed over by a prefill instance is no prefix-cache hit: counted apart
            handed = out.cached_tokens_by_tier.get("handoff", 0)
            measured: dict[str, Any] = {"cached_tokens": out.num_cached_tokens - handed}
            if handed:
                measured["handoff_tokens"] = handed
            if timing.first_token is not None:
                measured["ttft_ms"] = (timing.first_token - timing.arrival) * 1e3
            gap = tbt_ms(timing.token_times)
            if gap is not None:
                measured["tbt_ms"] = gap
            if timing.caller_id is not None:
                measured["request_id"] = timing.caller_id
            record = log_record(
                max(0.0, timing.arrival - self.start), out.prompt_token_ids,
                sum(len(c.token_ids) for c in out.outputs), self.block_size, (), self.seed,
                **measured,
            )  # fmt: skip
            self.writer.write(record)
        except Exception as exc:  # the log is a by-product: never fail the request for it
            if not self._failed:
                log.warning("request log: %s (further failures are not logged)", exc)
                self._failed = True

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=10)
        self.writer.close()
