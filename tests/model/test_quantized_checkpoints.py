"""Checkpoints as publishers quantize them (testing/tiny_quant.py writes them to spec): loaded
logprobs against the exact fp32 model their numbers stand for, against transformers where it
reads the same file, experts served from the published format, and one-line errors for
everything the loader does not understand."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hetserve import LLM, SamplingParams
from hetserve.errors import ModelLoadError
from hetserve.testing.tiny_quant import write_quantized

# Stated bounds on |logprob(quantized checkpoint) - logprob(its exact fp32 model)|, over 40
# prompt positions of the tiny models: FP8 experts keep their bytes and meet fp32 activations
# (fp32 rounding only), or on the avx512bf16 build activations split into two bf16 (2^-18 of
# each input; 1e-5 measured); int4 experts meet int16-rounded activations (max|x| / 32766 per
# element) in both matmuls of every expert.
BOUNDS = {"fp8": 1e-4, "gptq": 2e-3, "compressed-tensors": 2e-3}
CASES = [
    ("deepseek-v3", "fp8"),
    ("deepseek-v3.2", "fp8"),
    ("minimax-m2", "fp8"),
    ("qwen3-moe", "gptq"),
    ("deepseek-v3", "compressed-tensors"),
]
IDS = torch.randint(10, 400, (40,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def quantized(tiny_model, tmp_path_factory):
    made = {}

    def make(family: str, method: str):
        if (family, method) not in made:
            src = tiny_model(family, overrides={"moe_intermediate_size": 64})
            root = tmp_path_factory.mktemp(f"{family}-{method}")
            write_quantized(src, root / "quant", method, root / "ref")
            made[family, method] = (root / "quant", root / "ref")
        return made[family, method]

    return make


def logprobs(llm: LLM, ids: list[int] = IDS) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate(prompt_token_ids=ids, sampling_params=params)[0]
    return torch.tensor(
        [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    )


@pytest.mark.parametrize(("family", "method"), CASES)
def test_quantized_checkpoint_within_bound_of_its_fp32_model(quantized, family, method):
    quant, ref = quantized(family, method)
    llm = LLM(quant, placement="device")
    backends = {e.backend_name for _, e in llm.model.routed_experts()}
    assert backends == {"cpu-fp8" if method == "fp8" else "cpu-int4"}
    # The dense expert weights were never allocated, and the packed copy went to the backend.
    assert all(e.w13.numel() == 0 and e.packed is None for _, e in llm.model.routed_experts())
    err = (logprobs(llm) - logprobs(LLM(ref, placement="device"))).abs()
    print(f"{method}: max {float(err.max()):.2e} mean {float(err.mean()):.2e}")
    assert float(err.max()) <= BOUNDS[method]


@pytest.mark.parametrize(("family", "method"), CASES)
def test_placement_default_serves_experts_in_their_format(quantized, family, method):
    quant, ref = quantized(family, method)
    llm = LLM(quant, placement="default")
    assert ("cpu-fp8" if method == "fp8" else "cpu-int4") in llm.model.hybrid_plan.table()
    err = (logprobs(llm) - logprobs(LLM(ref, placement="device"))).abs()
    assert float(err.max()) <= BOUNDS[method]


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3.2", "minimax-m2"])
def test_fp8_matches_transformers_reading_the_same_file(quantized, family):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    quant, _ = quantized(family, "fp8")
    # On a CPU transformers dequantizes FP8 checkpoints (FineGrainedFP8Config) as it loads.
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        quant, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].log_softmax(-1)
    ref = ref[:-1].gather(1, torch.tensor(IDS[1:]).view(-1, 1))[:, 0]
    assert float((logprobs(LLM(quant, placement="device")) - ref).abs().max()) <= BOUNDS["fp8"]


def _int8_rules(tmp_path) -> str:
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n"
        "  - {name: experts, match: '.*\\.experts', device: cpu, backend: cpu-int8}\n"
        "  - {name: rest, match: '.*', device: cpu}\n"
    )
    return str(rules)


def test_cpu_int8_requantizes_fp8_experts_expert_by_expert(quantized, tmp_path):
    quant, ref = quantized("deepseek-v3", "fp8")
    rules = _int8_rules(tmp_path)
    llm = LLM(quant, placement=rules)
    assert "cpu-int8" in llm.model.hybrid_plan.table()
    # The same as int8 experts quantized from the dense fp32 model of those FP8 numbers.
    assert torch.equal(logprobs(llm), logprobs(LLM(ref, placement=rules)))


def test_convert_accepts_fp8_input(quantized, tmp_path):
    from hetserve.model.convert import convert

    quant, ref = quantized("deepseek-v3", "fp8")
    out = convert(quant, tmp_path / "int8", "int8")
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["hetserve_experts"]["format"] == "int8"
    # Serving the converted model equals quantizing the FP8 model's experts at load time.
    assert torch.equal(
        logprobs(LLM(out, placement="device")),
        logprobs(LLM(quant, placement=_int8_rules(tmp_path))),
    )


# -- what the loader refuses ----------------------------------------------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _one_line_error(path, *needles):
    with pytest.raises(ModelLoadError) as exc:
        LLM(path)
    msg = str(exc.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg


def test_unknown_quant_method_names_it_and_the_supported(quantized, tmp_path):
    path = _copy(quantized("deepseek-v3", "fp8")[0], tmp_path / "m")
    _edit_config(path, lambda c: c["quantization_config"].update(quant_method="awq"))
    _one_line_error(path, "'awq'", "fp8", "mxfp4", "gptq", "compressed-tensors")


def test_fp8_tensors_without_quantization_config_are_refused(quantized, tmp_path):
    """The bug this guards: FP8 values cast as if they were weights, scales skipped."""
    path = _copy(quantized("deepseek-v3", "fp8")[0], tmp_path / "m")
    _edit_config(path, lambda c: c.pop("quantization_config"))
    _one_line_error(path, "weight_scale_inv", "no quantization_config")


@pytest.mark.parametrize(
    ("edit", "needles"),
    [
        (lambda c: c["quantization_config"].update(activation_scheme="static"), ["static"]),
        (lambda c: c["quantization_config"].update(weight_block_size=None), ["block"]),
    ],
)
def test_fp8_options_we_do_not_read_are_refused(quantized, tmp_path, edit, needles):
    path = _copy(quantized("deepseek-v3", "fp8")[0], tmp_path / "m")
    _edit_config(path, edit)
    _one_line_error(path, *needles)


def test_gptq_act_order_and_unknown_tensors_are_refused(quantized, tmp_path):
    path = _copy(quantized("qwen3-moe", "gptq")[0], tmp_path / "m")
    _edit_config(path, lambda c: c["quantization_config"].update(desc_act=True))
    _one_line_error(path, "desc_act")
    path = _copy(quantized("qwen3-moe", "gptq")[0], tmp_path / "n")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(path / "model.safetensors"))
    _one_line_error(path, "o_proj.weight_scale_inv", "'gptq'")


def test_integer_tensor_in_a_plain_checkpoint_is_refused(tiny_model, tmp_path):
    path = _copy(tiny_model("qwen3-moe"), tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, str(path / "model.safetensors"))
    _one_line_error(path, name, "int8")


def test_incomplete_quantized_weight_names_the_missing_part(quantized, tmp_path):
    path = _copy(quantized("deepseek-v3", "compressed-tensors")[0], tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    tensors.pop("model.layers.1.mlp.experts.2.up_proj.weight_scale")
    save_file(tensors, str(path / "model.safetensors"))
    _one_line_error(path, "experts.2.up_proj.weight", "scale")
