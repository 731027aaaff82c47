"""A checkpoint whose sizes fit none of the kernels' units (hidden 70: linears' rows off whole
quads and columns off 32s; the experts' intermediate 40 off int8's 32 and int4's groups; 5
experts, top-3) loads and generates under the all-int8 placement (routed experts on the native
cpu-int8 or cpu-int4 kernel, every other linear a native Int8Linear, all stored padded with zero
weights): int8 close to the fp32 run, int4 to torch's int4 op on the same numbers; and the fused
decode step, which chains the same kernels in C, takes it and gives the modules' results."""

from __future__ import annotations

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.bench.decode import _all_int8_rules
from hetserve.layers.int8_linear import Int8Linear
from hetserve.moe.cpu_native import _NativeExperts
from hetserve.native import native_unavailable_reason
from tests.model.test_fused_decode import _Spy

pytestmark = pytest.mark.skipif(
    bool(native_unavailable_reason()), reason="native kernels unavailable"
)

ODD = {
    "hidden_size": 70,
    "moe_intermediate_size": 40,
    "num_experts": 5,
    "num_experts_per_tok": 3,
    "head_dim": 16,
}
PROMPTS = [list(range(10, 31)), list(range(40, 45)), list(range(100, 112))]


def _generate(llm: LLM, n: int = 6) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Per prompt: the greedy tokens and, per step, the top-20 logprobs."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=20)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    return [
        (o.outputs[0].token_ids,
         [{t: v.logprob for t, v in step.items()} for step in o.outputs[0].logprobs])
        for o in outs
    ]  # fmt: skip


@pytest.fixture(scope="module")
def fp32_run(tiny_model):
    return _generate(LLM(str(tiny_model("qwen3-moe", overrides=ODD))))


def _load_checked(path: str, experts: str, monkeypatch) -> tuple[LLM, list]:
    """The model under the all-int8 placement: every linear native (none fell back to fbgemm),
    some of them off the kernel's units, the experts native at the model's sizes; and its
    generation, which the fused decode step runs, equal to the modules' bit for bit."""
    llm = LLM(path, placement=_all_int8_rules(experts))
    linears = [m for m in llm.model.modules() if isinstance(m, Int8Linear)]
    assert linears and all(m.kernel == "native" for m in linears)
    assert any(m.in_features % 32 or m.out_features % 4 for m in linears)
    backends = [m._backend for m in llm.model.modules() if hasattr(m, "set_phase_backends")]
    assert backends and all(isinstance(b, _NativeExperts) for b in backends)
    assert all(b.hidden == 70 and b.inter == 40 for b in backends)
    spy = _Spy(monkeypatch, llm)
    fused = _generate(llm)
    assert spy.fused == 5  # every decode step after the prefill
    spy.off = True
    assert _generate(llm) == fused
    return llm, fused


def test_all_int8_matches_fp32(tiny_model, monkeypatch, fp32_run):
    """The same greedy tokens as fp32, their logprobs within int8's noise (~1% of a linear's
    output: tests/moe), and the prompts' next-token logprobs too."""
    path = str(tiny_model("qwen3-moe", overrides=ODD))
    _, run = _load_checked(path, "cpu-int8", monkeypatch)
    for (tokens, steps), (ref_tokens, ref_steps) in zip(run, fp32_run, strict=True):
        assert tokens == ref_tokens
        chosen = [torch.tensor([s[t] for s, t in zip(st, tokens, strict=True)])
                  for st in (steps, ref_steps)]  # fmt: skip
        torch.testing.assert_close(*chosen, rtol=0, atol=0.05)
        common = sorted(steps[0].keys() & ref_steps[0].keys())
        assert len(common) >= 10
        first = [torch.tensor([st[0][t] for t in common]) for st in (steps, ref_steps)]
        torch.testing.assert_close(*first, rtol=0, atol=0.05)


def test_int4_experts_match_the_library_kernel(tiny_model, monkeypatch):
    """cpu-int4 experts: int4's noise flips this random model's greedy tokens against fp32 at
    aligned sizes too (its top tokens lie within ~0.3 of each other), so the check is against
    the same int4 numbers on torch's int4 op (also padded, by its own code): the prompts'
    next-token logprobs agree but for the native kernel's int16 activation rounding."""
    import hetserve.moe.cpu_backends as cpu_backends

    path = str(tiny_model("qwen3-moe", overrides=ODD))
    _, native = _load_checked(path, "cpu-int4", monkeypatch)
    use_native = cpu_backends._use_native
    monkeypatch.setattr(
        cpu_backends, "_use_native", lambda n, k, a: n != "cpu-int4" and use_native(n, k, a)
    )
    library = LLM(path, placement=_all_int8_rules("cpu-int4"))
    experts = [m._backend for m in library.model.modules() if hasattr(m, "set_phase_backends")]
    assert all(type(b).__name__ == "TorchInt4Experts" for b in experts)
    for (_, steps), (_, ref_steps) in zip(native, _generate(library, n=1), strict=True):
        common = sorted(steps[0].keys() & ref_steps[0].keys())
        assert len(common) >= 15
        first = [torch.tensor([st[0][t] for t in common]) for st in (steps, ref_steps)]
        torch.testing.assert_close(*first, rtol=0, atol=2e-3)
