"""Expert deferral: exact at d = 0, decode only (never prefill), bounded change at d > 0, never
in the last MoE layer, and never leaving a token fewer than two on-time experts."""

import json
import logging

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.bench.deferral import decode_logprobs, kl_stats
from hetserve.cli import main
from hetserve.errors import InvalidInputError

IDS = torch.randint(10, 400, (60,), generator=torch.Generator().manual_seed(0)).tolist()
PARAMS = SamplingParams(max_tokens=1, prompt_logprobs=0)
TOP4 = {"num_experts_per_tok": 4}


def prompt_logprobs(llm) -> torch.Tensor:
    out = llm.generate(prompt_token_ids=IDS, sampling_params=PARAMS)[0]
    return torch.tensor(
        [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], IDS[1:], strict=True)]
    )


def decode(llm) -> torch.Tensor:
    return decode_logprobs(llm.model, IDS[:20], IDS[20:44])


@pytest.mark.parametrize("family,top_k", [("qwen3-moe", 4), ("mixtral", 3), ("deepseek-v3", 4)])
def test_deferral_decode_only_exact_at_zero_and_bounded_above(tiny_model, family, top_k):
    llm = LLM(tiny_model(family, overrides={"num_experts_per_tok": top_k}))
    base, base_prefill = decode(llm), prompt_logprobs(llm)
    assert llm.model.set_expert_deferral(0) == 0
    assert torch.equal(decode(llm), base)
    assert llm.model.set_expert_deferral(1) == 1
    layers = llm.model.moe_layers()
    assert [m.num_deferred for m in layers] == [1] * (len(layers) - 1) + [0]
    # Prefill never defers: the prompt's logprobs are bit-identical.
    assert torch.equal(prompt_logprobs(llm), base_prefill)
    kl = kl_stats(base, decode(llm))
    # Deferral is an approximation at decode: it must change something, and not much.
    assert kl["kl_max"] > 1e-7
    assert kl["kl_mean"] < 0.1


def test_single_moe_layer_never_defers(tiny_model):
    path = tiny_model("deepseek-v3", overrides={"num_hidden_layers": 2, **TOP4})  # layer 0 dense
    llm = LLM(path)
    base = decode(llm)
    assert llm.model.set_expert_deferral(1) == 0
    assert [m.num_deferred for m in llm.model.moe_layers()] == [0]
    assert torch.equal(decode(llm), base)


def test_deferral_clamped_to_keep_two_experts(tiny_model, caplog):
    llm = LLM(tiny_model("qwen3-moe", overrides=TOP4))
    with caplog.at_level(logging.WARNING, logger="hetserve.model.base"):
        assert llm.model.set_expert_deferral(3) == 2
    assert "clamped to 2" in caplog.text and "at least 2 non-deferred" in caplog.text
    assert max(m.num_deferred for m in llm.model.moe_layers()) == 2
    top2 = LLM(tiny_model("qwen3-moe"))  # top_k = 2: nothing may be deferred
    assert top2.model.set_expert_deferral(1) == 0
    with pytest.raises(InvalidInputError, match=">= 0"):
        top2.model.set_expert_deferral(-1)


def test_deferral_through_engine_config(tiny_model):
    path = tiny_model("qwen3-moe", lm_head_scale=8.0, overrides=TOP4)
    llm = LLM(path, max_deferred_experts_per_token=2)
    assert max(m.num_deferred for m in llm.model.moe_layers()) == 2
    outs = llm.generate(
        prompt_token_ids=[IDS[:20], IDS[5:50]],
        sampling_params=SamplingParams(max_tokens=8, temperature=0),
    )
    assert all(len(o.token_ids) == 8 or o.finish_reason == "stop" for o in outs)


def test_bench_deferral_reports_rate_and_kl(tiny_model, tmp_path, capsys):
    out = tmp_path / "d.json"
    path = str(tiny_model("qwen3-moe", overrides=TOP4))
    argv = ["bench", "deferral", "--model", path, "--steps", "8", "--tokens", "4"]
    assert main([*argv, "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["d"] for r in report["rows"]] == [0, 1, 2]
    assert report["rows"][0]["kl_mean"] == 0 and report["rows"][0]["top1_agree"] == 1
    assert all(r["tokens_per_s"] > 0 and r["kl_mean"] >= 0 for r in report["rows"])
    assert "KL mean" in capsys.readouterr().out
    assert main(["bench", "deferral", "--model", path, "--defer", "x"]) == 2
    assert "--defer" in capsys.readouterr().err
