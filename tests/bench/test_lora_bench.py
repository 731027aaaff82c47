"""`hetserve bench lora` on the demo model at its smallest: every configuration timed, ratios
against the engine without LoRA, typed errors."""

from __future__ import annotations

import json

import pytest

from hetserve.cli import main

CONFIGS = {"base", "lora-off", "1-adapter", "4-adapters"}


def test_bench_lora_times_every_configuration_against_base(tmp_path, capsys):
    out = tmp_path / "lora.json"
    rc = main(["bench", "lora", "--num-prompts", "5", "--input-len", "8", "--output-len", "3",
               "--rank", "2", "--repeats", "1", "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "lora" and data["rank"] == 2
    assert set(data["seconds"]) == set(data["runs_seconds"]) == CONFIGS
    assert data["seconds"] == {name: min(r) for name, r in data["runs_seconds"].items()}
    assert data["vs_base"]["base"] == 1.0
    for name in CONFIGS:
        secs = data["seconds"][name]
        assert data["vs_base"][name] == pytest.approx(data["seconds"]["base"] / secs)
        assert data["output_tok_s"][name] == pytest.approx(data["output_tokens"] / secs)
    assert "vs base" in capsys.readouterr().out


def test_bench_lora_bad_rank_is_a_user_error(capsys):
    assert main(["bench", "lora", "--rank", "0"]) == 2
    assert "--rank must be >= 1" in capsys.readouterr().err
