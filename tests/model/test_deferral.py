"""Expert deferral: exact at d = 0, bounded change at d > 0, never in the last MoE layer."""

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.errors import InvalidInputError

IDS = torch.randint(10, 400, (60,), generator=torch.Generator().manual_seed(0)).tolist()
PARAMS = SamplingParams(max_tokens=1, prompt_logprobs=0)


def logprobs(llm) -> torch.Tensor:
    out = llm.generate(prompt_token_ids=IDS, sampling_params=PARAMS)[0]
    return torch.tensor(
        [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], IDS[1:], strict=True)]
    )


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral", "deepseek-v3"])
def test_deferral_exact_at_zero_and_bounded_above(tiny_model, family):
    llm = LLM(tiny_model(family))
    base = logprobs(llm)
    llm.model.set_expert_deferral(0)
    assert torch.equal(logprobs(llm), base)
    llm.model.set_expert_deferral(1)
    layers = llm.model.moe_layers()
    assert [m.num_deferred for m in layers] == [1] * (len(layers) - 1) + [0]
    diff = (logprobs(llm) - base).abs()
    # Deferral is an approximation: it must change something, and not much on average.
    assert diff.max() > 1e-4
    assert diff.mean() < 0.5 and diff.max() < 3.0


def test_single_moe_layer_never_defers(tiny_model):
    path = tiny_model("deepseek-v3", overrides={"num_hidden_layers": 2})  # layer 0 dense
    llm = LLM(path)
    base = logprobs(llm)
    llm.model.set_expert_deferral(1)
    assert [m.num_deferred for m in llm.model.moe_layers()] == [0]
    assert torch.equal(logprobs(llm), base)


def test_deferral_through_engine_config_and_bounds(tiny_model):
    path = tiny_model("qwen3-moe", lm_head_scale=8.0)
    llm = LLM(path, max_deferred_experts_per_token=1)
    outs = llm.generate(
        prompt_token_ids=[IDS[:20], IDS[5:50]],
        sampling_params=SamplingParams(max_tokens=8, temperature=0),
    )
    assert all(len(o.token_ids) == 8 or o.finish_reason == "stop" for o in outs)
    with pytest.raises(InvalidInputError, match="top_k"):
        llm.model.set_expert_deferral(2)
