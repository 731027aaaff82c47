"""gpt-oss beyond the shared parity suite: the options its published config uses (window
alternation, sinks, the clamp) each change the output and each match transformers; MXFP4
experts as published, served by cpu-mxfp4, against the exact fp32 model and transformers."""

from __future__ import annotations

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.testing.tiny_quant import write_quantized

transformers = pytest.importorskip("transformers")

IDS = torch.randint(10, 400, (48,), generator=torch.Generator().manual_seed(3)).tolist()
# As published: windows of 128 on every other layer, the clamp at 7 (shrunk to fit the tiny
# model's prompts and activations: sliding_window 4, limit 0.5).
VARIANTS = {
    "all-sliding": {"layer_types": ["sliding_attention"] * 3, "sliding_window": 4},
    "all-full": {"layer_types": ["full_attention"] * 3},
    "published-clamp": {"swiglu_limit": 7.0, "swiglu_alpha": 1.702},
    "tight-clamp": {"swiglu_limit": 0.5},
}


def prompt_logprobs(llm: LLM, ids: list[int] = IDS) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate(prompt_token_ids=ids, sampling_params=params)[0]
    return torch.tensor(
        [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    )


def hf_prompt_logprobs(path, ids: list[int] = IDS, **kwargs) -> torch.Tensor:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True, **kwargs
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:]).view(-1, 1))[:, 0]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_options_match_transformers_and_matter(tiny_model, variant):
    base = prompt_logprobs(LLM(tiny_model("gpt-oss"), placement="device"))
    path = tiny_model("gpt-oss", overrides=VARIANTS[variant])
    ours = prompt_logprobs(LLM(path, placement="device"))
    torch.testing.assert_close(ours, hf_prompt_logprobs(path), atol=1e-4, rtol=0)
    assert float((ours - base).abs().max()) > 1e-3  # the option is not a no-op


def test_sinks_matter(tiny_model):
    llm = LLM(tiny_model("gpt-oss"), placement="device")
    before = prompt_logprobs(llm)
    for layer in llm.model.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)  # a sink nobody attends to: plain softmax
    assert float((prompt_logprobs(llm) - before).abs().max()) > 1e-3


def test_decode_with_sinks_and_windows_off_the_native_kernel(tiny_model, monkeypatch):
    """The torch decode path (off-CPU, or kernels off) against the native one."""
    path = tiny_model("gpt-oss", overrides=VARIANTS["all-sliding"])
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1, logprobs=0, ignore_eos=True)
    native = LLM(path, placement="device").generate(
        prompt_token_ids=IDS[:9], sampling_params=params
    )[0]
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    plain = LLM(path, placement="device").generate(
        prompt_token_ids=IDS[:9], sampling_params=params
    )[0]
    assert native.token_ids == plain.token_ids
    a = torch.tensor([e[t].logprob for e, t in zip(native.logprobs, native.token_ids, strict=True)])
    b = torch.tensor([e[t].logprob for e, t in zip(plain.logprobs, plain.token_ids, strict=True)])
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def mxfp4(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    write_quantized(tiny_model("gpt-oss"), root / "quant", "mxfp4", root / "ref")
    return root / "quant", root / "ref"


# |logprob(MXFP4 checkpoint) - logprob(its exact fp32 model)|: the e2m1 codes and e8m0 scales
# are read as published, so only the kernel's int16 activation rounding is left.
MXFP4_BOUND = 1e-3


def test_mxfp4_checkpoint_served_as_published(mxfp4):
    quant, ref = mxfp4
    llm = LLM(quant, placement="device")
    assert {e.backend_name for _, e in llm.model.routed_experts()} == {"cpu-mxfp4"}
    err = (prompt_logprobs(llm) - prompt_logprobs(LLM(ref, placement="device"))).abs()
    assert float(err.max()) <= MXFP4_BOUND
    hybrid = LLM(quant, placement="default")
    assert "cpu-mxfp4" in hybrid.model.hybrid_plan.table()


def test_mxfp4_matches_transformers_reading_the_same_file(mxfp4):
    quant, _ = mxfp4
    hf = hf_prompt_logprobs(quant, quantization_config=transformers.Mxfp4Config(dequantize=True))
    assert float((prompt_logprobs(LLM(quant, placement="device")) - hf).abs().max()) <= MXFP4_BOUND
