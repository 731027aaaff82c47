"""Request traces: Mooncake's published format and hetserve's own request log, one format.

One JSON object a line, sorted by arrival:

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

- `timestamp`: milliseconds since the trace (or the log) began.
- `input_length`, `output_length`: prompt and output tokens.
- `hash_ids`: one id per block of `block_size` prompt tokens, the last one possibly partial
  (`len(hash_ids) == ceil(input_length / block_size)`); ids are chained prefix hashes, so the
  same id at position i means the same first (i + 1) * block_size tokens.

Mooncake's traces (FAST'25 release) use 512-token blocks and small remapped integers. hetserve's
request log (`--log-requests FILE` of `serve` and `conductor`) writes the same fields with real
block hashes: each id is the first 8 bytes (big-endian) of the chained `BlockHash` of the
engine's blocks (`block_ids`), and it adds:

- `block_size`: tokens per id (the engine's block size); absent means 512; one value per file;
- what the server measured, all optional: `ttft_ms`, `tbt_ms` (mean of the longest 10% of the
  request's token intervals, as the Mooncake paper defines TBT), `cached_tokens` (prompt tokens
  served from a cache), `rejected` (true when the request was refused), `priority`.

Who calls it: the simulator (`read_trace`), the load generator's trace replay
(`hetserve bench serve --dataset-name mooncake-trace`); the servers write logs with
`core/trace_record.py` (`RequestLogWriter`, `log_record`), the record's own module.
Failure contract: a file that is missing, a line that is not such a record (missing field,
wrong type, negative length, fewer ids than its prompt needs), a line earlier than the one
before it, or a block size that changes: `InvalidInputError`, one line naming the file and the
line. A request log is written as requests finish, not as they arrive,
so lines that carry measurements may come out of arrival order; `read_trace` sorts those.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from hetserve.core.trace_record import MOONCAKE_BLOCK_SIZE, TraceRecord
from hetserve.errors import InvalidInputError

_MEASURED = ("ttft_ms", "tbt_ms")


def read_trace(path: str, param: str = "--trace") -> list[TraceRecord]:
    """Every record of the file at `path`, checked (see the module's failure contract);
    `param` names the option the path came from, for the error message."""
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(f"{param}: file not found: {path}", param=param)
    records: list[TraceRecord] = []
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = _parse(line)
                if records:
                    _check_follows(rec, records[-1])
            except ValueError as exc:
                raise InvalidInputError(f"{param}: {path} line {lineno}: {exc}", param) from exc
            records.append(rec)
    if not records:
        raise InvalidInputError(f"{param}: no records in {path}", param=param)
    return sorted(records, key=lambda r: r.timestamp_ms)  # stable: ties keep the file's order


def read_cluster_logs(directory: str, param: str = "--trace") -> list[TraceRecord]:
    """A cluster's request logs (`hetserve cluster up --log-requests DIR`) as one trace: the
    Conductor's records (arrivals on its one clock, prompts, rejections, priorities) joined by
    `request_id` with what the instances measured: TTFT (the Conductor's own where it has
    one), TBT and the output length where the stream was served (decode-N or both-N), cached
    tokens where the prompt was computed (prefill-N or both-N). A request nobody measured
    (refused, failed) keeps no measurement.
    Errors: as `read_trace`, and a directory without conductor.jsonl."""
    d = Path(directory)
    if not (d / "conductor.jsonl").is_file():
        raise InvalidInputError(
            f"{param}: {directory} has no conductor.jsonl (a `cluster up --log-requests` "
            "directory)", param=param
        )  # fmt: skip
    served: dict[str, TraceRecord] = {}
    computed: dict[str, TraceRecord] = {}
    for path in sorted(d.glob("*.jsonl")):
        role = path.stem.split("-")[0]
        if role not in ("prefill", "decode", "both"):
            continue
        for rec in read_trace(str(path), param):
            if rec.request_id is None:
                continue
            if role in ("decode", "both"):
                served[rec.request_id] = rec
            if role in ("prefill", "both"):
                computed[rec.request_id] = rec
    out = []
    for rec in read_trace(str(d / "conductor.jsonl"), param):
        s, c = served.get(rec.request_id or ""), computed.get(rec.request_id or "")
        out.append(
            replace(
                rec,
                output_length=s.output_length if s is not None else rec.output_length,
                # The Conductor's own TTFT where it logged one (what the cluster's client
                # waited), else the serving instance's.
                ttft_ms=rec.ttft_ms if rec.ttft_ms is not None else s.ttft_ms if s else None,
                tbt_ms=s.tbt_ms if s is not None else None,
                cached_tokens=c.cached_tokens if c is not None else None,
            )
        )
    return out


def _parse(line: str) -> TraceRecord:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in row:
            raise ValueError(f"missing field '{key}'")
    ts = _number(row, "timestamp")
    n, out = _count(row, "input_length", 1), _count(row, "output_length", 1)
    bs = _count(row, "block_size", 1) if "block_size" in row else MOONCAKE_BLOCK_SIZE
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(_is_int(h) for h in ids):
        raise ValueError("'hash_ids' must be a list of integers")
    if n > len(ids) * bs:
        raise ValueError(f"input_length {n} exceeds its hash_ids ({len(ids)} blocks of {bs})")
    measured = {k: _number(row, k) for k in _MEASURED if row.get(k) is not None}
    cached = _count(row, "cached_tokens", 0) if row.get("cached_tokens") is not None else None
    rejected = row.get("rejected")
    if rejected is not None and not isinstance(rejected, bool):
        raise ValueError("'rejected' must be true or false")
    priority = row.get("priority", 0)
    if not _is_int(priority):
        raise ValueError("'priority' must be an integer")
    request_id = row.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise ValueError("'request_id' must be a string")
    handed = _count(row, "handoff_tokens", 0) if row.get("handoff_tokens") is not None else None
    return TraceRecord(
        ts,
        n,
        out,
        tuple(ids[: math.ceil(n / bs)]),
        bs,
        priority,
        cached_tokens=cached,
        rejected=rejected,
        request_id=request_id,
        handoff_tokens=handed,
        **measured,
    )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(row: dict[str, Any], key: str) -> float:
    x = row[key]
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x < 0:
        raise ValueError(f"'{key}' must be a number >= 0, got {x!r}")
    return float(x)


def _count(row: dict[str, Any], key: str, least: int) -> int:
    x = row[key]
    if not _is_int(x) or x < least:
        raise ValueError(f"'{key}' must be an integer >= {least}, got {x!r}")
    return int(x)


def _measured(rec: TraceRecord) -> bool:
    return rec.ttft_ms is not None or rec.cached_tokens is not None or rec.rejected is not None


def _check_follows(rec: TraceRecord, prev: TraceRecord) -> None:
    # A request log's lines follow finish order (see the module doc): sorted after reading.
    if rec.timestamp_ms < prev.timestamp_ms and not (_measured(rec) and _measured(prev)):
        raise ValueError(
            f"timestamp {rec.timestamp_ms:g} is earlier than the line before "
            f"({prev.timestamp_ms:g}): the trace must be sorted by time"
        )
    if rec.block_size != prev.block_size:
        raise ValueError(
            f"block_size {rec.block_size} differs from earlier lines' {prev.block_size}"
        )


def coarsen(record: TraceRecord, block_size: int) -> TraceRecord:
    """The record with blocks of `block_size` tokens, a multiple of its own: a coarse block is
    named by the last fine id inside it (ids are chained, so that id names the whole prefix)."""
    if block_size == record.block_size:
        return record
    k, rest = divmod(block_size, record.block_size)
    if rest or k < 1:
        raise ValueError(
            f"--block-tokens {block_size} must be a multiple of the trace's {record.block_size}"
        )
    ids = record.hash_ids
    full = ids[k - 1 :: k][: len(ids) // k]
    tail = (ids[-1],) if len(ids) % k else ()
    return TraceRecord(
        record.timestamp_ms,
        record.input_length,
        record.output_length,
        full + tail,
        block_size,
        record.priority,
        record.ttft_ms,
        record.tbt_ms,
        record.cached_tokens,
        record.rejected,
        record.request_id,
    )
