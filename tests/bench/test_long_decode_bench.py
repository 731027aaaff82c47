"""`hetserve bench long-decode` on tiny models: a hybrid against its full-attention twin, with
the profile's parts adding up to the step and a bad --contexts one line."""

from __future__ import annotations

import json

from hetserve.cli import main


def test_long_decode_against_a_peer_writes_json(tiny_model, tmp_path, capsys):
    hybrid = tiny_model("qwen3-next")
    full = tiny_model("qwen3-next", overrides={"full_attention_interval": 1})
    out = tmp_path / "long.json"
    rc = main(["bench", "long-decode", "--model", str(hybrid), "--peer", str(full),
               "--contexts", "32,96", "--steps", "2", "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    hyb, twin = data["results"]
    for r in (hyb, twin):
        for c in ("32", "96"):
            x = r["contexts"][c]
            assert x["step_ms"] > 0 and len(x["times_ms"]) == 2
            assert x["profile_ms"]["mlp"] > 0  # the hooks saw the layers' modules
    assert hyb["contexts"]["96"]["profile_ms"]["linear attention"] > 0
    assert "linear attention" not in twin["contexts"]["96"]["profile_ms"]
    assert "vs --model" in capsys.readouterr().out


def test_bad_contexts_are_one_line(tiny_model, capsys):
    rc = main(["bench", "long-decode", "--model", str(tiny_model("qwen3-next")),
               "--contexts", "a,b"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--contexts" in err[0]


def test_contexts_past_the_models_positions_are_one_line(tiny_model, capsys):
    """A context the model's positions cannot hold (the rotary table ends there) is refused
    before any step, not an IndexError from the rotary lookup."""
    path = tiny_model("deepseek-v3")
    limit = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    rc = main(["bench", "long-decode", "--model", str(path), "--contexts", str(limit),
               "--steps", "2"])  # fmt: skip
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("error")]
    assert rc == 2 and len(err) == 1 and "max_position_embeddings" in err[0]
