"""`hetserve bench throughput` and `bench prefix` end to end on a tiny MoE."""

from __future__ import annotations

import json

import pytest

from hetserve.cli import main


@pytest.fixture(scope="module")
def moe_dir(tiny_model):
    return tiny_model("qwen3-moe")


def test_bench_throughput_alternates_repeats_and_keeps_the_best(moe_dir, tmp_path, capsys):
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", str(moe_dir), "--num-prompts", "6",
               "--input-len", "12", "--output-len", "5", "--hf-batch", "4", "--repeats", "2",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    runs = data["runs_seconds"]
    assert set(runs) == {"hetserve", "transformers"}
    assert all(len(r) == 2 and min(r) > 0 for r in runs.values())
    assert data["seconds"] == {name: min(r) for name, r in runs.items()}
    ratio = data["seconds"]["transformers"] / data["seconds"]["hetserve"]
    assert data["speedup_vs_transformers"] == pytest.approx(ratio)
    assert "speedup vs HF" in capsys.readouterr().out


def test_bench_throughput_bad_repeats_is_a_user_error(moe_dir, capsys):
    rc = main(["bench", "throughput", "--model", str(moe_dir), "--repeats", "0", "--skip-hf"])
    assert rc == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_bench_prefix_warm_requests_compute_only_their_new_blocks(moe_dir, tmp_path):
    out = tmp_path / "prefix.json"
    rc = main(["bench", "prefix", "--model", str(moe_dir), "--prompt-len", "100",
               "--trials", "2", "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["shared_tokens"] == 90
    (row,) = data["rows"]
    # 90 shared tokens = 5 full 16-token blocks reused; the rest (10 + 10 tokens) is computed.
    assert row["row"] == "device" and row["warm_computed"] == [20, 20]
    assert row["warm_cached_by_tier"] == [{"device": 80}] * 2
    assert len(row["cold_s"]) == len(row["warm_s"]) == 2 and row["warm_over_cold"] > 0


def test_bench_prefix_tiers_load_from_dram_and_ssd(moe_dir, tmp_path, capsys):
    out = tmp_path / "prefix.json"
    rc = main(["bench", "prefix", "--model", str(moe_dir), "--prompt-len", "100", "--trials",
               "1", "--tiers", "dram,ssd", "--kv-load", "always", "--store-gb", "0.05",
               "--ssd-dir", str(tmp_path), "--json", str(out)])  # fmt: skip
    assert rc == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["dram"]["warm_cached_by_tier"] == [{"dram": 80}]
    assert rows["ssd"]["warm_cached_by_tier"] == [{"ssd": 80}]
    assert rows["dram"]["warm_computed"] == rows["ssd"]["warm_computed"] == [20]
    # Each tier's one load, as predicted and as measured, in the JSON and the second table.
    for tier in ("dram", "ssd"):
        fit = rows[tier]["load_fit"][tier]
        assert fit["loads"] == 1 and fit["predicted_ms"] > 0 and fit["measured_ms"] > 0
        assert fit["ratio"] == pytest.approx(fit["measured_ms"] / fit["predicted_ms"])
    out = capsys.readouterr().out
    assert "predicted ms" in out and "wait ms" in out and "1/8/32 blocks" in out


def test_bench_speculative_runs_every_system_with_decodings_outputs(moe_dir, tmp_path, capsys):
    out = tmp_path / "spec.json"
    rc = main(["bench", "speculative", "--model", str(moe_dir), "--input-len", "24",
               "--output-len", "40", "--rounds", "2", "--cost-repeats", "2",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["outputs_equal"] is True
    assert set(data["rounds"]) == {"decode", "ngram drafts", "ngram, every draft",
                                   "prediction drafts"}  # fmt: skip
    assert all(len(r) == 2 for r in data["rounds"].values())
    # a prediction 10% edited: most of its drafts hold
    predicted = data["rounds"]["prediction drafts"][0]
    assert predicted["accepted_tokens"] > predicted["draft_tokens"] / 2 > 0
    assert len(data["step_seconds_by_drafts"]) == 5
    assert "prediction drafts" in capsys.readouterr().out


def test_bench_speculative_bad_prediction_edit_is_a_user_error(moe_dir, capsys):
    rc = main(["bench", "speculative", "--model", str(moe_dir), "--prediction-edit", "2"])
    assert rc == 2
    assert "--prediction-edit must be within 0..1" in capsys.readouterr().err
