"""Clear, typed errors for user mistakes, each naming the fix."""

import json
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file

from hetserve import LLM, SamplingParams
from hetserve.errors import (
    MissingTensorError,
    ModelNotFoundError,
    PromptTooLongError,
    TensorShapeError,
    UnsupportedArchitectureError,
)


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(tiny_model("qwen3-moe"), dst)
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        LLM(tmp_path / "nowhere")


def test_missing_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        LLM(tmp_path)


def test_unsupported_architecture_lists_supported(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError) as exc:
        LLM(model_copy)
    msg = str(exc.value)
    assert "GPTBigCodeForCausalLM" in msg and "Qwen3MoeForCausalLM" in msg
    assert "DeepseekV3ForCausalLM" in msg and "\n" not in msg


def _rewrite(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_tensor_is_named(model_copy):
    _rewrite(model_copy, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        LLM(model_copy)


def test_missing_expert_tensor_is_named(model_copy):
    _rewrite(model_copy, lambda t: t.pop("model.layers.0.mlp.experts.5.up_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"layers\.0\.mlp\.experts\.5\.up_proj\.weight"):
        LLM(model_copy)


def test_shape_mismatch_names_tensor_expected_and_found(model_copy):
    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:10].clone()

    _rewrite(model_copy, shrink)
    with pytest.raises(TensorShapeError) as exc:
        LLM(model_copy)
    msg = str(exc.value)
    assert "model.norm.weight" in msg and "(10,)" in msg and "(64,)" in msg


def test_prompt_longer_than_context(tiny_model):
    llm = LLM(tiny_model("qwen3-moe"), max_model_len=32)
    with pytest.raises(PromptTooLongError, match="33 tokens.*context is 32"):
        llm.generate(prompt_token_ids=list(range(33)))
    # The engine still works after the rejected prompt.
    assert llm.generate(
        prompt_token_ids=list(range(8)), sampling_params=SamplingParams(max_tokens=2)
    )[0].token_ids


def test_invalid_sampling_params():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="stop takes a list, got int 5"):  # a TypeError
        SamplingParams(stop=5)
    with pytest.raises(ValueError, match="stop_token_ids takes a list"):
        SamplingParams(stop_token_ids=7)


@pytest.mark.parametrize(
    "name",
    ["model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"],
)
def test_a_tensor_of_the_wrong_rank_names_itself(model_copy, name):
    """All-int8 (the CPU default) rounds experts and linears as they are read: a tensor of
    another rank is the same one-line error, not the rounding's failure."""
    _rewrite(model_copy, lambda t: t.__setitem__(name, t[name].flatten().clone()))
    with pytest.raises(TensorShapeError, match=re.escape(name)):
        LLM(model_copy)
