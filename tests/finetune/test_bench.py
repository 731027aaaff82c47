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


def test_bench_finetune_device_cuda_without_cuda_is_a_clear_error(tiny_model, capsys):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the GPU half hour runs --device cuda for real")
    rc = main(["bench", "finetune", "--model", str(tiny_model("qwen3-moe")), "--device", "cuda"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda" in err[0] and "--device cpu" in err[0]


def test_bench_finetune_counts_are_checked_before_either_system_runs(tmp_path, capsys):
    """--steps 0 was a ZeroDivisionError after both runs, --warmup -1 a rate of millions of
    tokens/s, --seq-len 0 or 1 two 'failed' rows (or a nan loss) with exit code 0."""
    import pytest

    for flags, needle in (
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--rounds", "0"], "--rounds must be >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["--seq-len", "1"], "a sequence >= 2 tokens, got 1 and 1"),
        (["--batch", "0"], "need a batch >= 1"),
    ):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("hetserve.bench.finetune._spawn", pytest.fail)  # nothing may start
            rc = main(["bench", "finetune", "--model", str(tmp_path), *flags])
        assert rc == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and needle in err, err


def test_bench_finetune_reports_the_system_that_ran_when_the_other_fails(
    tiny_model, tmp_path, capsys, monkeypatch
):
    import hetserve.bench.finetune as bench

    def fake_spawn(system, s):
        if system == "transformers+peft":
            raise RuntimeError("transformers+peft worker failed: CUDA out of memory")
        return {"system": system, "tokens_per_s": 10.0, "seconds": 1.0, "peak_rss_mib": 100.0,
                "baseline_rss_mib": 50.0, "final_loss": 1.0, "peak_gpu_mib": 7.0}  # fmt: skip

    monkeypatch.setattr(bench, "_spawn", fake_spawn)
    out = tmp_path / "r.json"
    rc = main(["bench", "finetune", "--model", str(tiny_model("qwen3-moe")), "--steps", "1",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["best"]) == {"hetserve"} and "limit" not in report and report["machine"]
    assert report["rounds"][1] == {
        "round": 0,
        "system": "transformers+peft",
        "error": "transformers+peft worker failed: CUDA out of memory",
    }
    captured = capsys.readouterr()
    assert "CUDA out of memory" in captured.err
    rows = {line.split()[0]: line.split() for line in captured.out.splitlines() if line.strip()}
    assert rows["transformers+peft"][1] == "failed"
    assert rows["hetserve"][1:3] == ["10", "-"] and rows["hetserve"][-1] == "7"


def test_offload_device_map_puts_only_routed_experts_on_the_cpu(tiny_model):
    from hetserve.bench.hybrid import offload_device_map

    path = tiny_model("deepseek-v3")
    c = json.loads((path / "config.json").read_text())
    dense, n = c.get("first_k_dense_replace", 0), c["num_hidden_layers"]
    m = offload_device_map(str(path))
    cpu = {k for k, v in m.items() if v == "cpu"}
    assert cpu == {f"model.layers.{i}.mlp.experts" for i in range(dense, n)} and cpu
    assert all(m[f"model.layers.{i}"] == 0 for i in range(n)) and m["lm_head"] == 0
