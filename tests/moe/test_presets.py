"""`--placement` presets and the `auto` default: the policy alone, then through the engine."""

import pytest
import torch

from hetserve.moe.presets import (
    PlacementFacts,
    choose_placement,
    preset_name,
    preset_rules,
)

GIB = 1 << 30


def test_auto_without_an_accelerator_is_all_int8():
    c = choose_placement("auto", PlacementFacts(accelerator=None))
    assert c.preset == "all-int8"
    assert c.line().startswith("placement: all-int8 (auto: no accelerator")
    assert "--placement device" in c.line() and "\n" not in c.line()


@pytest.mark.parametrize(
    ("facts", "preset", "why"),
    [
        (PlacementFacts(None, dtype="float32"), "device", "exactness"),
        (PlacementFacts("cuda", 80 * GIB, 10 * GIB, 2 * GIB, dtype="fp32"), "device", "exact"),
        (PlacementFacts(None, dtype="bfloat16"), "device", "bfloat16 on the CPU"),
        (PlacementFacts(None, native_unavailable="no C compiler"), "device", "no C compiler"),
        (PlacementFacts("cuda", 80 * GIB, 60 * GIB, 2 * GIB), "device", "fits cuda"),
        (PlacementFacts("cuda", 80 * GIB, 71 * GIB, 2 * GIB), "hybrid", "experts on the CPU"),
        (PlacementFacts("cuda:1", 24 * GIB, 40 * GIB, 0, dtype="bf16"), "hybrid", "cuda:1"),
    ],
)
def test_auto_decides_from_the_facts(facts, preset, why):
    c = choose_placement("auto", facts)
    assert c.preset == preset and why in c.reason, c


@pytest.mark.parametrize(
    ("asked", "preset"),
    [("device", "device"), ("hybrid", "hybrid"), ("default", "hybrid"), ("all-int8", "all-int8")],
)
def test_named_presets_are_taken_as_asked(asked, preset):
    # even on a machine where auto would choose otherwise
    c = choose_placement(asked, PlacementFacts("cuda", 80 * GIB, GIB, GIB))
    assert c.preset == preset and "auto" not in c.line()


def test_a_rules_file_is_not_a_preset():
    assert preset_name("rules.yaml") is None
    c = choose_placement("rules.yaml", PlacementFacts(None))
    assert c.preset is None and c.line().startswith("placement: rules file rules.yaml")


def test_preset_rules():
    assert preset_rules("device") is None
    hybrid = preset_rules("default", "cpu-int4")
    assert [(r.device, r.backend) for r in hybrid] == [("cpu", "cpu-int4"), ("auto", None)]
    int8 = preset_rules("all-int8", "cpu-fp8")
    assert [(r.device, r.backend) for r in int8] == [("cpu", "cpu-fp8"), ("cpu", "cpu-int8")]
    with pytest.raises(ValueError, match="not a placement preset"):
        preset_rules("auto")


def _prompt_logprobs(llm):
    from hetserve import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate(prompt_token_ids=[list(range(3, 40))], sampling_params=params)[0]
    return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])


def test_engine_default_on_cpu_is_the_all_int8_preset(tiny_model):
    """No flag on a CPU-only machine: every linear and the experts on the native int8 kernels,
    the same numbers as the all-int8 rules file, within int8's error of the exact model."""
    from hetserve import LLM
    from hetserve.bench.decode import _all_int8_rules
    from hetserve.layers.int8_linear import Int8Linear
    from hetserve.native import native_unavailable_reason

    if native_unavailable_reason() is not None:
        pytest.skip(f"native kernels unavailable: {native_unavailable_reason()}")
    path = tiny_model("qwen3-moe")
    auto = LLM(path)
    assert auto.placement_summary.startswith("placement: all-int8 (auto:")
    assert all(e.backend_name == "placed" for _, e in auto.model.routed_experts())
    linears = [m for m in auto.model.modules() if isinstance(m, Int8Linear)]
    assert linears and all(m.kernel == "native" for m in linears)
    assert not any(type(m) is torch.nn.Linear for m in auto.model.modules())
    got = _prompt_logprobs(auto)
    # the same numbers as the rules file with auto's fp16 KV cache (a rules file keeps fp32)
    rules = LLM(path, placement=_all_int8_rules(), kv_cache_dtype="float16")
    assert torch.equal(got, _prompt_logprobs(rules))
    exact = LLM(path, dtype="float32")
    assert exact.placement_summary == "placement: device (auto: --dtype float32 asks for exactness)"
    ref = _prompt_logprobs(exact)
    assert torch.equal(ref, _prompt_logprobs(LLM(path, placement="device")))
    # int8 weights (one scale per row) and int16 activations through every layer: on the tiny
    # checkpoint (vocabulary 64) the prompt's logprobs move 0.01 on average, 0.05 at most
    err = (got - ref).abs()
    assert 0 < float(err.max()) < 0.1 and float(err.mean()) < 0.025


def test_native_kernels_off_means_auto_is_exact(tiny_model, monkeypatch):
    from hetserve import LLM

    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    llm = LLM(tiny_model("qwen3-moe"))
    assert llm.placement_summary.startswith("placement: device (auto: no accelerator, native")
    assert llm.model.hybrid_plan is None
