"""One request-trace record, and the request log that servers write in that format.

The format (Mooncake's published traces and hetserve's own request logs alike) is one JSON
object a line: `timestamp` (ms since the trace or log began), `input_length`, `output_length`,
`hash_ids` (one id per block of `block_size` prompt tokens, chained prefix hashes), and in a
request log `block_size` and what the server measured (`ttft_ms`, `tbt_ms`, `cached_tokens`,
`rejected`, `priority`, `request_id`). `hetserve.sim.trace` documents each field and reads and
checks files; this module is the writing side, low in the house so that every server (the
engine's `serve`, the Conductor) logs without importing the simulator.

Who calls it: `server/request_log.py`, the Conductor (`disagg/conductor.py`), the simulator's
reader. Failure contract: `RequestLogWriter` raises the OSError of a file it cannot open; the
servers treat the log as a by-product and never fail a request for it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hetserve.core.block_hash import CacheExtra, hash_block_tokens, hash_prefix_blocks

MOONCAKE_BLOCK_SIZE = 512


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_size: int = MOONCAKE_BLOCK_SIZE
    priority: int = 0
    # Measured by a live server (request logs only): the digital twin compares against them.
    ttft_ms: float | None = None
    tbt_ms: float | None = None
    cached_tokens: int | None = None
    rejected: bool | None = None
    # Request logs only: the Conductor's id of the request, sent to instances as X-Request-Id,
    # so a cluster's logs join (`read_cluster_logs`).
    request_id: str | None = None
    # A decode instance's log: prompt tokens whose KV came from a prefill instance (not cached)
    handoff_tokens: int | None = None

    def to_json(self) -> str:
        row: dict[str, Any] = {
            "timestamp": _compact(self.timestamp_ms),
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.block_size != MOONCAKE_BLOCK_SIZE:
            row["block_size"] = self.block_size
        for key in ("priority", "ttft_ms", "tbt_ms", "cached_tokens", "rejected", "request_id",
                    "handoff_tokens"):  # fmt: skip
            value = getattr(self, key)
            if value is not None and not (key == "priority" and value == 0):
                row[key] = value
        return json.dumps(row, separators=(",", ":"))


def _compact(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def block_ids(
    token_ids: Sequence[int], block_size: int, extra: CacheExtra = (), seed: bytes = b""
) -> list[int]:
    """A prompt's ids for the log: the engine's chained block hashes (the partial last block
    hashed the same way, after the full ones), each cut to its first 8 bytes."""
    hashes = hash_prefix_blocks(token_ids, block_size, extra, seed)
    tail = len(token_ids) % block_size
    if tail:
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[-tail:], extra, seed))
    return [int.from_bytes(h.digest[:8], "big") for h in hashes]


def log_record(
    arrival_s: float,
    token_ids: Sequence[int],
    output_length: int,
    block_size: int,
    extra: CacheExtra = (),
    seed: bytes = b"",
    **measured: Any,
) -> TraceRecord:
    """One line of a request log: arrival in seconds since the log began, the prompt's token
    ids (hashed here, never written), and what was measured (`ttft_ms`, `tbt_ms`,
    `cached_tokens`, `rejected`, `priority`, `handoff_tokens`) and `request_id`."""
    ids = tuple(block_ids(token_ids, block_size, extra, seed))
    return TraceRecord(
        arrival_s * 1000.0, len(token_ids), output_length, ids, block_size, **measured
    )


class RequestLogWriter:
    """Appends records to a request log, one line each, flushed as written (a server that is
    killed leaves every finished request's line). Safe to call from several threads."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = Path(path).open("a")
        self._lock = threading.Lock()

    def write(self, record: TraceRecord) -> None:
        line = record.to_json() + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
