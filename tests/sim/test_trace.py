"""Trace reading: both formats, every bad line named; the request log written and read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetserve.core.block_hash import hash_prefix_blocks
from hetserve.core.trace_record import RequestLogWriter, TraceRecord, block_ids, log_record
from hetserve.errors import InvalidInputError
from hetserve.sim.trace import coarsen, read_trace

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}


def write(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_mooncake_records_are_read_as_written(tmp_path: Path) -> None:
    rows = [GOOD, {**GOOD, "timestamp": 250.5, "hash_ids": [1, 3, 9]}]
    recs = read_trace(write(tmp_path / "t.jsonl", rows))
    assert recs[0] == TraceRecord(0.0, 600, 3, (1, 2))
    assert recs[1].timestamp_ms == 250.5 and recs[1].hash_ids == (1, 3)  # ids past the prompt cut
    assert recs[1].block_size == 512 and recs[1].ttft_ms is None


@pytest.mark.parametrize(
    "bad, words",
    [
        ({k: v for k, v in GOOD.items() if k != "hash_ids"}, "missing field 'hash_ids'"),
        ({**GOOD, "input_length": -5}, "'input_length' must be an integer >= 1"),
        ({**GOOD, "output_length": 0}, "'output_length' must be an integer >= 1"),
        ({**GOOD, "timestamp": -1}, "'timestamp' must be a number >= 0"),
        ({**GOOD, "hash_ids": [1, "x"]}, "list of integers"),
        ({**GOOD, "input_length": 2000}, "exceeds its hash_ids"),
        ({**GOOD, "timestamp": 10}, "earlier than the line before"),  # after a line at 100
        ({**GOOD, "timestamp": 200, "block_size": 16, "hash_ids": list(range(40))}, "block_size"),
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
    ],
)
def test_bad_lines_are_one_line_errors_naming_the_line(tmp_path: Path, bad, words) -> None:
    path = write(tmp_path / "t.jsonl", [{**GOOD, "timestamp": 100}, bad])
    with pytest.raises(InvalidInputError) as err:
        read_trace(path)
    msg = str(err.value)
    assert "line 2" in msg and words in msg and "\n" not in msg


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="not found"):
        read_trace(str(tmp_path / "none.jsonl"))
    with pytest.raises(InvalidInputError, match="no records"):
        read_trace(write(tmp_path / "empty.jsonl", []))


def test_request_log_round_trip_with_real_block_hashes(tmp_path: Path) -> None:
    shared = list(range(100, 132))  # two full 16-token blocks
    a = log_record(0.0, shared + [7, 8, 9], 5, 16, extra=("m",), ttft_ms=12.5, cached_tokens=0)
    b = log_record(0.25, shared + [1] * 16, 3, 16, extra=("m",), ttft_ms=4.0, cached_tokens=32)
    path = tmp_path / "requests.log"
    writer = RequestLogWriter(str(path))
    for rec in (a, b):
        writer.write(rec)
    writer.close()
    back = read_trace(str(path))
    assert back == [a, b]
    assert back[1].timestamp_ms == 250.0 and back[1].block_size == 16
    # The same prefix, the same ids: the engine's chained hashes, cut to 8 bytes.
    full = hash_prefix_blocks(shared, 16, ("m",))
    assert (
        a.hash_ids[:2] == b.hash_ids[:2] == tuple(int.from_bytes(h.digest[:8], "big") for h in full)
    )
    assert a.hash_ids[2] != b.hash_ids[2] and len(a.hash_ids) == 3  # the partial tail hashed too
    assert block_ids(shared, 16, ("other model",))[0] != a.hash_ids[0]


def test_coarser_blocks_are_named_by_their_last_fine_id() -> None:
    rec = TraceRecord(0.0, 20, 1, (1, 2, 3, 4, 5), block_size=4)
    assert coarsen(rec, 8).hash_ids == (2, 4, 5) and coarsen(rec, 8).block_size == 8
    assert coarsen(rec, 4) is rec
    with pytest.raises(ValueError, match="multiple"):
        coarsen(rec, 6)


def test_the_published_synthetic_trace_reads_whole() -> None:
    path = Path("/work/shared/data/mooncake/synthetic_trace.jsonl")
    if not path.is_file():
        pytest.skip("the Mooncake synthetic trace is not on this machine")
    recs = read_trace(str(path))
    assert len(recs) == 3993
    assert sum(r.input_length for r in recs) / len(recs) == pytest.approx(15325, rel=1e-3)


def test_a_request_log_in_finish_order_is_read_in_arrival_order(tmp_path: Path) -> None:
    # A server logs a request when it finishes: a long one that arrived first comes later.
    rows = [
        {**GOOD, "timestamp": 100, "ttft_ms": 5.0, "cached_tokens": 0},
        {**GOOD, "timestamp": 40, "ttft_ms": 90.0, "cached_tokens": 512},
        {**GOOD, "timestamp": 100, "ttft_ms": 7.0, "cached_tokens": 0},
    ]
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = read_trace(str(path))
    assert [(r.timestamp_ms, r.ttft_ms) for r in got] == [(40, 90.0), (100, 5.0), (100, 7.0)]


def test_a_clusters_logs_join_on_the_conductors_request_id(tmp_path: Path) -> None:
    from hetserve.sim.trace import read_cluster_logs

    def write(name: str, rows: list[dict]) -> None:
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("conductor", [
        {**GOOD, "timestamp": 5, "request_id": "a", "output_length": 16},
        {**GOOD, "timestamp": 9, "request_id": "b", "rejected": True},
        {**GOOD, "timestamp": 12, "request_id": "c", "rejected": False},
    ])  # fmt: skip
    # Each instance's clock starts elsewhere; only the Conductor's arrivals are kept.
    write("prefill-0", [{**GOOD, "timestamp": 900, "request_id": "a", "output_length": 1,
                         "ttft_ms": 30.0, "cached_tokens": 512}])  # fmt: skip
    write("decode-0", [{**GOOD, "timestamp": 950, "request_id": "a", "output_length": 7,
                        "ttft_ms": 41.0, "tbt_ms": 9.0, "cached_tokens": 600}])  # fmt: skip
    a, b, c = read_cluster_logs(str(tmp_path))
    assert (a.timestamp_ms, a.output_length, a.ttft_ms, a.tbt_ms) == (5, 7, 41.0, 9.0)
    assert a.cached_tokens == 512  # where the prompt was computed, not the handed-off KV
    assert b.rejected and b.ttft_ms is None and b.cached_tokens is None
    assert c.ttft_ms is None  # logged by no instance (it failed): no measurement
    (tmp_path / "conductor.jsonl").unlink()
    with pytest.raises(InvalidInputError, match="no conductor.jsonl"):
        read_cluster_logs(str(tmp_path))
