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
