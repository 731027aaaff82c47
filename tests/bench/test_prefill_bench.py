"""`hetserve bench prefill` on a tiny MoE: the arithmetic it divides by, the peaks it measures,
a peer that cannot run reported with its reason, every round in the JSON, bad flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hetserve import native
from hetserve.bench.prefill_systems import Unavailable, import_llama, prompt_ops
from hetserve.cli import main

FAST = ["--rounds", "2", "--repeats", "1", "--kernel-tokens", "16", "--peak-seconds", "0.01",
        "--bandwidth-mib", "8", "--hf-max-len", "16"]  # fmt: skip


def test_prompt_ops_counts_experts_linears_and_causal_attention():
    cfg = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 6, "vocab_size": 10}  # fmt: skip
    ops = prompt_ops(cfg, 3)
    assert ops["routed_experts"] == 2 * 3 * 2 * (2 * 3 * 8 * 6)  # 2 ops x n x layers x k x 3HI
    # q, k, v, o per layer (8x8, 8x4, 8x4, 8x8) and the router (8x4); lm_head once
    assert ops["linears"] == 2 * (3 * 2 * (8 * (8 + 4 + 4 + 8) + 8 * 4) + 10 * 8)
    assert ops["attention"] == 2 * 2 * 2 * 2 * 4 * (3 * 4 // 2)  # causal: 6 query-key pairs
    assert prompt_ops({**cfg, "kv_lora_rank": 4}, 3) is None  # MLA: not modelled


def test_bench_prefill_end_to_end(tiny_model, tmp_path, monkeypatch):
    from hetserve.bench import prefill_kernels

    monkeypatch.setattr(prefill_kernels, "CHUNK", 6)  # the chunked rows at --kernel-tokens 16
    out = tmp_path / "prefill.json"
    model = str(tiny_model("qwen3-moe"))
    argv = [
        "bench",
        "prefill",
        "--model",
        model,
        "--prompt-lens",
        "8,16",
        "--systems",
        "all-int8,fp32,llama.cpp,transformers",
        *FAST,
        "--json",
        str(out),
    ]
    assert main(argv) == 0  # fmt: skip
    data = json.loads(out.read_text())
    rows = {(r["system"], r["prompt_len"]): r for r in data["rows"]}
    assert set(rows) == {(s, n) for s in ("hetserve all-int8", "hetserve fp32", "llama.cpp",
                                          "transformers") for n in (8, 16)}  # fmt: skip
    for system in ("hetserve fp32", "transformers"):
        assert all(rows[(system, n)]["tokens_per_s"] > 0 for n in (8, 16))
        assert len(data["rounds_tokens_per_s"][system]) == 2  # every round kept
    # no GGUF here (and maybe no llama-cpp-python): a row with its reason, not a bare "-"
    assert rows[("llama.cpp", 8)]["tokens_per_s"] is None
    assert "GGUF" in data["unavailable"]["llama.cpp"] or "llama" in data["unavailable"]["llama.cpp"]
    peaks = data["peaks"]
    assert peaks["read_gbps"] > 0
    if native.native_unavailable_reason() is None:
        assert peaks["gops"]["int8"] > 0 and peaks["gops"]["fp32"] > 0
        assert all(rows[("hetserve all-int8", n)]["of_peak"] > 0 for n in (8, 16))
        assert data["kernels"] and all(k["gops"] > 0 for k in data["kernels"])
        # attention: the native kernel beside SDPA at the model's and the 32/4x128 shape
        attn = {k["kernel"]: k for k in data["kernels"] if "attention" in k["kernel"]}
        native_rows = [k for name, k in attn.items() if name.endswith("native paged")]
        assert len(native_rows) == 4 and any("32/4x128" in k["kernel"] for k in native_rows)
        for k in native_rows:  # whole prompts against SDPA, chunks against gather + SDPA
            peer = k["kernel"].replace("native paged", "torch SDPA")
            if "chunks" in peer:
                peer = peer.replace("torch SDPA", "gather + SDPA")
            assert k["vs_peer"] == pytest.approx(attn[peer]["seconds"] / k["seconds"])
    ratio = rows[("hetserve fp32", 16)]["vs_transformers"]
    assert ratio == pytest.approx(
        rows[("hetserve fp32", 16)]["tokens_per_s"] / rows[("transformers", 16)]["tokens_per_s"]
    )


def test_a_peer_that_does_not_import_says_why(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "llama_cpp":
            exc = ModuleNotFoundError("No module named 'diskcache'")
            exc.name = "diskcache"
            raise exc
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(Unavailable, match="diskcache"):
        import_llama()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--systems", "all-int8,vllm"],
            "--systems: unknown ['vllm']; choose from all-int8, "
            "w8a8, hybrid, fp32, gguf, llama.cpp, transformers",
        ),
        (["--prompt-lens", "10,x"], "--prompt-lens: not integers: '10,x'"),
        (["--rounds", "0"], "--rounds and --repeats must be at least 1"),
        (
            ["--prompt-lens", "64,100000"],
            "--prompt-lens: 100000 tokens do not fit the model's context of {context}",
        ),
    ],
)
def test_bad_flags_are_one_line_exit_2(tiny_model, flags, message):
    model = str(tiny_model("qwen3-moe"))
    r = subprocess.run(
        [sys.executable, "-m", "hetserve.cli", "bench", "prefill", "--model", model, *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    context = json.loads((tiny_model("qwen3-moe") / "config.json").read_text())
    message = message.format(context=context["max_position_embeddings"])
    assert r.stderr.strip().splitlines() == [f"error: {message}"]


def test_default_lengths_are_those_the_context_holds(tiny_model):
    import argparse

    from hetserve.bench.prefill import _parse

    model = tiny_model("qwen3-moe")
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    args = argparse.Namespace(model=str(model), prompt_lens=None, systems="fp32", rounds=1,
                              repeats=1)  # fmt: skip
    _, lens, _ = _parse(args)
    assert lens == [n for n in (512, 2048, 8192) if n < context] and lens
