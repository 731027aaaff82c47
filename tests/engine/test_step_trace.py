"""The per-step trace (HETSERVE_STEP_TRACE): one JSON line per step, with what the tail needs."""

import json

from hetserve.engine.step_log import StepTrace
from hetserve.kv.step_time import StepShape


def test_each_step_is_one_line_with_its_prediction_gap_and_collections(tmp_path):
    path = tmp_path / "steps.jsonl"
    trace = StepTrace(path)
    mixed = StepShape().plus(1, 10).plus(32, 100)
    trace.write(mixed, 0.015, 0.020, 0.018, ledger=(0.016, 0.004))
    trace.write(StepShape().plus(1, 11), None, 0.002, 0.0019)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["mixed", "decode"]
    first, second = rows
    assert (first["decodes"], first["chunk_tokens"], first["chunk_context"]) == (1, 32, 132)
    assert (first["predicted_ms"], first["ms"], first["batch_ms"]) == (15.0, 20.0, 18.0)
    assert first["gap_ms"] is None  # nothing before the first step
    assert second["predicted_ms"] is None and isinstance(second["gap_ms"], float)
    assert all(r["gc"] >= 0 and r["gc_ms"] >= 0 for r in rows)
    # the prompt chunk's ledger: what the step was allowed and what its prompt owes after it
    assert (first["allowance_ms"], first["debt_ms"]) == (16.0, 4.0)
    assert second["allowance_ms"] is None and second["debt_ms"] is None
