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
    out_text = capsys.readouterr().out
    assert "train tok/s" in out_text and "no fp32 implementation can pass" in out_text
    limit = json.loads(out.read_text())["limit"]
    assert limit["gemm_peak_gflops"] > 0 and limit["model_flops_per_token"] > 0
    hf = best["transformers+peft"]["model_gflops_per_s"]
    assert abs(limit["max_speedup_over_hf"] * hf / limit["gemm_peak_gflops"] - 1) < 1e-9


def test_train_flops_per_token_counts_every_product(tiny_model):
    """The model FLOPs of the machine-limit line, against a count by hand from config.json."""
    from hetserve.bench.finetune import train_flops_per_token

    path = tiny_model("qwen3-moe")
    c = json.loads((path / "config.json").read_text())
    h, hd = c["hidden_size"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    layer = (
        2 * h * nh * hd  # q, o
        + 2 * h * nkv * hd  # k, v
        + h * c["num_experts"]  # router
        + c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]  # experts used
    )
    frozen = 4 * (c["num_hidden_layers"] * layer + h * c["vocab_size"])  # forward + input grad
    lora = 6 * 4 * c["num_hidden_layers"] * (h + nh * hd)  # rank 4 on q_proj
    attention = 3 * 2 * 2 * nh * hd * (64 + 1) / 2 * c["num_hidden_layers"]
    assert train_flops_per_token(str(path), 64, 4, "q_proj") == frozen + lora + attention
