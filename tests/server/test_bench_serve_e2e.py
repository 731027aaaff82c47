"""`hetserve bench serve` end to end against a real `hetserve serve` engine on a tiny model."""

import json
from pathlib import Path

import pytest

from hetserve.cli import main

TRACE = (
    Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl"
)


def test_random_workload_against_hetserve(server, tmp_path):
    out = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--model",
            "tiny",
            "--dataset",
            "random",
            "--num-prompts",
            "12",
            "--random-input-len",
            "40",
            "--random-output-len",
            "8",
            "--random-prefix-ratio",
            "0.5",
            "--vocab-size",
            "400",
            "--max-concurrency",
            "4",
            "--slo",
            "ttft=60000,tpot=60000",
            "--result-file",
            str(out),
            "--disable-tqdm",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    text = json.dumps(res)
    assert '"completed": 12' in text and '"failed": 0' in text, text[:2000]
    assert server.wait_idle().kv_blocks_used == 0


@pytest.mark.skipif(not TRACE.is_file(), reason="../shared/data/mooncake trace not present")
def test_mooncake_trace_against_hetserve(server, tmp_path):
    out = tmp_path / "t.json"
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--model",
            "tiny",
            "--dataset",
            "mooncake-trace",
            "--dataset-path",
            str(TRACE),
            "--num-prompts",
            "6",
            "--max-model-len",
            "200",
            "--max-model-len-mode",
            "scale",
            "--vocab-size",
            "400",
            "--request-rate",
            "inf",
            "--result-file",
            str(out),
            "--disable-tqdm",
        ]
    )
    assert rc == 0
    text = out.read_text()
    assert '"completed": 6' in text and '"failed": 0' in text, text[:2000]
