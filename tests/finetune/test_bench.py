"""`hetserve bench finetune` runs both systems and writes its JSON (no timing assertions)."""

import json

from hetserve.cli import main


def test_bench_finetune_smoke(tiny_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "finetune", "--model", str(tiny_model("qwen3-moe")), "--steps", "1",
               "--warmup", "0", "--seq-len", "16", "--json", str(out)])  # fmt: skip
    assert rc == 0
    best = json.loads(out.read_text())["best"]
    assert set(best) == {"hetserve", "transformers+peft"}
    # Same model, data and LoRA: the first step's losses agree.
    assert abs(best["hetserve"]["final_loss"] - best["transformers+peft"]["final_loss"]) < 1e-3
    assert "train tok/s" in capsys.readouterr().out
