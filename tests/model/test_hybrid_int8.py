"""Linear-attention models under the CPU default placement (auto: all-int8 where the native
kernels build) against the exact fp32 run.

Why the input projections of linear attention stay out of int8 is in layers/linear_attention.py
("Precision"). The bound is held on models whose tokens take every routed expert: with top-2 of
8, any perturbation (int8 experts alone, the hybrid placement, too) flips some token's expert
choice at a near-tie of the random router, which moves that position by up to 0.9 nats and
hides the rounding error behind which prompt happens to hold such a tie. Measured here (AVX2;
four 40-token prompts, mean |logprob change| over their positions), input projections kept /
int8 per output channel / the hybrid placement: qwen3-next 0.0114 / 0.0190 / 0.0043,
qwen3.5-moe 0.0105 / 0.0160 / 0.0046, kimi-linear 0.0143 / 0.0194 / 0.0055; every prompt's mean
moves the same way. Greedy outputs flipped only where the exact model's top two were within
0.023 nats.
"""

import pytest
import torch
from torch import nn

from hetserve import LLM, SamplingParams
from hetserve.layers.int8_linear import Int8Linear
from hetserve.native import native_unavailable_reason
from tests.model.test_parity import random_ids

HYBRID = ["qwen3-next", "qwen3.5-moe", "kimi-linear"]
PROMPTS = [random_ids(40, seed=s) for s in (3, 4, 5, 6)]
PROMPT_LP = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=20)
# The stated bound on the mean over the four prompts: above the measured value (room for
# another CPU's kernel path), below what int8 input projections give.
BOUND = {"qwen3-next": 0.015, "qwen3.5-moe": 0.013, "kimi-linear": 0.017}
# A greedy choice that flips where the exact model's top two are this close is a near-tie:
# single positions move by up to 0.07 nats here.
NEAR_TIE = 0.05
EVERY_EXPERT = {"qwen3-next": {"num_experts_per_tok": 8}, "qwen3.5-moe": {"num_experts_per_tok": 8},
                "kimi-linear": {"num_experts_per_token": 8}}  # fmt: skip

pytestmark = pytest.mark.skipif(
    native_unavailable_reason() is not None,
    reason=f"auto is all-int8 only with the native kernels: {native_unavailable_reason()}",
)


def _chosen(out):
    ids, entries = out.prompt_token_ids, out.prompt_logprobs
    return torch.tensor([e[t].logprob for e, t in zip(entries[1:], ids[1:], strict=True)])


def _precise_modules(llm: LLM) -> list[nn.Module]:
    return [m for m in llm.engine.model.modules() if getattr(m, "precise_projections", ())]


@pytest.mark.parametrize("family", HYBRID)
def test_linear_attention_inputs_stay_out_of_int8(tiny_model, family):
    llm = LLM(tiny_model(family))
    assert llm.engine.placement_summary.startswith("placement: all-int8")
    mixers = _precise_modules(llm)
    assert len(mixers) == 3  # the three linear-attention layers of each tiny model
    for m in mixers:
        kept = [getattr(m, n) for n in m.precise_projections if hasattr(m, n)]
        assert kept and all(isinstance(c, Int8Linear) and "residual" in repr(c) for c in kept)
        rest = [c for n, c in m.named_children() if n.endswith("proj") and n not in kept_names(m)]
        assert rest and all(isinstance(c, Int8Linear) for c in rest)  # out_proj / o_proj
        assert not any("residual" in repr(c) for c in rest)


def kept_names(m: nn.Module) -> set[str]:
    return set(m.precise_projections)


@pytest.mark.parametrize("family", HYBRID)
def test_auto_placement_stays_within_the_stated_bound(tiny_model, family):
    path = tiny_model(family, overrides=EVERY_EXPERT[family])
    exact, auto = LLM(path, placement="device"), LLM(path)
    e = exact.generate(prompt_token_ids=PROMPTS, sampling_params=PROMPT_LP)
    a = auto.generate(prompt_token_ids=PROMPTS, sampling_params=PROMPT_LP)
    diff = torch.cat([(_chosen(x) - _chosen(y)).abs() for x, y in zip(a, e, strict=True)])
    assert float(diff.mean()) <= BOUND[family], (family, float(diff.mean()))
    greedy = exact.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    for p, ge in zip(PROMPTS, greedy, strict=True):
        ga = auto.generate(prompt_token_ids=p, sampling_params=GREEDY)[0]
        _assert_greedy_equal_unless_near_tie(ge.outputs[0], ga.outputs[0])


def _assert_greedy_equal_unless_near_tie(exact, auto) -> None:
    for i, (x, y) in enumerate(zip(exact.token_ids, auto.token_ids, strict=True)):
        if x != y:
            top = exact.logprobs[i]
            margin = top[x].logprob - (top[y].logprob if y in top else float("-inf"))
            assert margin <= NEAR_TIE, (i, margin)
            return
