"""`hetserve bench serve` against a real `hetserve serve` on the demo model (vocabulary 576,
context 512 here): what it learns from the server keeps every request valid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetserve.cli import main

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake"
TRACE_FILE = TRACE / "synthetic_trace.jsonl"
needs_trace = pytest.mark.skipif(
    not TRACE_FILE.is_file(), reason=f"Mooncake trace not present at {TRACE_FILE}"
)


def _bench(server, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--model", "demo", "--disable-tqdm",
               "--result-file", str(out), *args])  # fmt: skip
    assert rc == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def demo_dir() -> str:
    from hetserve.testing.tiny import demo_model_dir

    return str(demo_model_dir())


@needs_trace
def test_mooncake_trace_needs_no_vocabulary_flag(demo_server, tmp_path: Path) -> None:
    result = _bench(demo_server, tmp_path, "--dataset", "mooncake-trace", "--dataset-path",
                    str(TRACE_FILE), "--num-prompts", "4", "--request-rate", "inf")  # fmt: skip
    assert result["metrics"]["completed"] == 4 and result["metrics"]["failed"] == 0
    assert "vocabulary 576 (server /v1/models)" in result["notes"][0]


@needs_trace
def test_mooncake_trace_with_the_models_tokenizer(demo_server, demo_dir, tmp_path: Path) -> None:
    result = _bench(demo_server, tmp_path, "--dataset", "mooncake-trace", "--dataset-path",
                    str(TRACE_FILE), "--num-prompts", "4", "--request-rate", "inf",
                    "--tokenizer", demo_dir)  # fmt: skip
    m = result["metrics"]
    assert (m["completed"], m["failed"]) == (4, 0), m["errors"]
    # The context comes from the server (512, not the checkpoint's 4096); prompts fill it.
    # The server's card and the tokenizer agree; the card is asked first.
    assert result["notes"][0].startswith("model: vocabulary 576")
    assert "context 512 (server /v1/models)" in result["notes"][0]
    assert all(r["prompt_len"] + r["output_tokens"] <= 512 for r in result["requests"])
    assert max(r["prompt_len"] for r in result["requests"]) > 256


def test_long_random_prompts_are_fitted_to_the_servers_context(demo_server, tmp_path) -> None:
    result = _bench(demo_server, tmp_path, "--num-prompts", "4", "--random-input-len", "2000",
                    "--random-output-len", "16", "--vocab-size", "512")  # fmt: skip
    m = result["metrics"]
    assert (m["completed"], m["failed"]) == (4, 0), m["errors"]
    assert all(r["prompt_len"] == 512 - 16 for r in result["requests"])


def test_structured_dataset_compares_with_the_same_load_without(demo_server, tmp_path) -> None:
    result = _bench(demo_server, tmp_path, "--dataset", "structured", "--num-prompts", "10",
                    "--random-input-len", "16", "--random-output-len", "8",
                    "--request-rate", "inf")  # fmt: skip
    assert result["metrics"]["completed"] == 10 and result["metrics"]["failed"] == 0
    assert result["baseline_metrics"]["completed"] == 10
    cmp = result["structured"]
    assert cmp["throughput_ratio"] > 0 and cmp["ttft_ratio"] > 0
    assert "5 of 10 requests under json_schema" in result["notes"]


def test_burst_into_streams_on_the_real_server(demo_server, tmp_path: Path) -> None:
    """Streams, then a long prompt into them: the server chunked it beside the decodes (its
    /metrics counts mixed steps), and the bench reports the burst's figures."""
    import urllib.request

    result = _bench(demo_server, tmp_path, "--num-prompts", "3", "--random-input-len", "8",
                    "--random-output-len", "60", "--request-rate", "inf", "--burst", "400",
                    "--burst-delay", "0.3", "--burst-output-len", "4")  # fmt: skip
    m = result["metrics"]
    assert (m["completed"], m["failed"]) == (4, 0), m["errors"]
    b = m["burst"]
    assert b["decode_only_samples"] > 0 and b["solo_ttft_ms"]["median"] is not None
    assert b["itl_max_over_decode_only"] is not None
    with urllib.request.urlopen(demo_server.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    mixed = [line for line in text.splitlines() if line.startswith("hetserve_step_seconds_count")]
    assert any('kind="mixed"' in line and not line.endswith(" 0.0") for line in mixed), mixed
