"""One access line per request, as vLLM logs them: method, route, status, prompt and output
tokens, time to first token and duration. `hetserve serve --disable-log-requests` turns it off.

The route records the engine request ids it started in the ASGI scope (`hetserve.ids`); an
engine observer keeps each request's latest counts until the HTTP response ends, when the
guard writes the line (for a stream, after its last event; for one its client left, at once,
with what it had streamed: its request ends after that).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from typing import Any

log = logging.getLogger("hetserve.access")
MAX_PENDING = 4096  # requests whose response has not ended yet, and ids written (bounded)


class AccessLog:
    def __init__(self, engine) -> None:
        self._done: dict[str, tuple[int, int, float | None]] = {}
        # Ids whose line is written, oldest first: an aborted request's last outputs come after.
        self._written: OrderedDict[str, None] = OrderedDict()
        engine.observers.append(self.observe)
        if not log.handlers:
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False

    def observe(self, request_id: str, out, timing) -> None:
        # The engine thread, once per output; the latest is kept.
        if request_id in self._written:
            return
        generated = sum(len(c.token_ids) for c in out.outputs)
        first = timing.first_token if timing.first_token is not None else None
        ttft = None if first is None else first - timing.arrival
        if request_id not in self._done and len(self._done) >= MAX_PENDING:
            self._done.pop(next(iter(self._done)))
        self._done[request_id] = (len(out.prompt_token_ids), generated, ttft)

    def write(self, scope: dict[str, Any], status: int) -> None:
        prompt = output = 0
        ttfts = []
        for rid in scope.get("hetserve.ids", ()):
            p, o, t = self._done.pop(rid, (0, 0, None))
            self._written[rid] = None
            if len(self._written) > MAX_PENDING:
                self._written.popitem(last=False)
            prompt, output = prompt + p, output + o
            if t is not None:
                ttfts.append(t)
        took = time.monotonic() - scope.get("hetserve.arrival", time.monotonic())
        client = scope.get("client") or ("-", 0)
        ttft = f"{min(ttfts):.3f}s" if ttfts else "-"
        log.info(
            '%s "%s %s" %d prompt_tokens=%d output_tokens=%d ttft=%s time=%.3fs',
            client[0],
            scope.get("method", "-"),
            scope.get("path", "-"),
            status,
            prompt,
            output,
            ttft,
            took,
        )
