"""`hetserve export` against PEFT itself: an adapter PEFT trained on the transformers model,
merged by us, equals `merge_and_unload()` (weights and logits; LoRA and DoRA); the merged
directory loads in transformers and in hetserve, and `hetserve convert` takes it. Serving that
adapter unmerged equals PEFT's own forward."""

import json

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.cli import main
from hetserve.model.convert import convert
from hetserve.model.export import export_merged
from tests.lora_util import prompt_logprobs, run, write_random_adapter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.arange(3, 40)


def peft_model(base, use_dora: bool):
    """transformers + PEFT with random (nonzero) adapter weights."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_dora=use_dora)
    model = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(3)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0)
    return model.eval()


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_export_equals_peft_merge_and_unload(tiny_model, tmp_path, use_dora):
    base = tiny_model("llama")
    model = peft_model(base, use_dora)
    model.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        unmerged = model(IDS[None]).logits[0]
    out = export_merged(base, tmp_path / "adapter", tmp_path / "merged", progress=False)
    reference = model.merge_and_unload()
    ours = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    theirs = reference.state_dict()
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-6, atol=1e-6, msg=name)
    with torch.no_grad():
        logits = ours(IDS[None]).logits[0]
    torch.testing.assert_close(logits, reference(IDS[None]).logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, unmerged, rtol=1e-4, atol=1e-4)
    # hetserve serves the merged directory as any model
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    served = prompt_logprobs(
        LLM(out, placement="device").generate(
            prompt_token_ids=IDS.tolist(), sampling_params=params
        )[0]
    )
    expected = logits.log_softmax(-1)[:-1].gather(1, IDS[1:, None]).squeeze(1)
    assert (served - expected).abs().max() <= 1e-4
    if not use_dora:  # and serves the adapter itself as PEFT runs it
        engine = LLM(base, lora_modules={"a": str(tmp_path / "adapter")}, placement="device").engine
        lora = prompt_logprobs(run(engine, [IDS.tolist()], params, ["a"])[0])
        assert (lora - expected).abs().max() <= 1e-4


def test_convert_takes_the_merged_moe(tiny_model, tmp_path):
    base = tiny_model("qwen3-moe")
    adapter = write_random_adapter(base, tmp_path / "adapter")
    merged = export_merged(base, adapter, tmp_path / "merged", progress=False)
    assert sorted(p.name for p in merged.iterdir()) == sorted(p.name for p in base.iterdir())
    converted = convert(merged, tmp_path / "int8", "int8")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    a, b = (
        LLM(d, placement="device").generate(prompt_token_ids=IDS.tolist(), sampling_params=params)[
            0
        ]
        for d in (merged, converted)
    )
    assert (prompt_logprobs(a) - prompt_logprobs(b)).abs().max() < 0.1  # int8 experts


def test_export_mistakes_exit_2_with_one_line(tiny_model, tmp_path, capsys):
    base = tiny_model("qwen3-moe")
    adapter = write_random_adapter(base, tmp_path / "adapter")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    cfg = json.loads((base / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**cfg, "quantization_config": {}}))
    other = write_random_adapter(tiny_model("llama"), tmp_path / "llama", match="mlp")
    cases = [
        (["--model", str(base), "--adapter", str(adapter), "--out", str(busy)], "is not empty"),
        (["--model", str(quantized), "--adapter", str(adapter), "--out", "x"], "quantized"),
        (["--model", str(base), "--adapter", str(base), "--out", "x"], "adapter_config.json"),
        (
            ["--model", str(base), "--adapter", str(other), "--out", str(tmp_path / "o")],
            "targets model.layers.0.mlp.down_proj, which the model's checkpoint does not have",
        ),
    ]
    for argv, message in cases:
        assert main(["export", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o").exists()  # nothing written on failure


def test_a_shape_mismatch_in_a_later_shard_writes_nothing(tmp_path, monkeypatch, capsys):
    # Found in a trial: the mismatch was found while merging its shard, after the earlier
    # shards were written; the partial --out was then refused on retry as "not empty".
    from safetensors.torch import load_file, save_file

    import hetserve.testing.tiny as tiny
    from hetserve.testing import make_tiny_checkpoint

    monkeypatch.setattr(tiny, "SHARD_BYTES", 1 << 16)
    base = make_tiny_checkpoint("qwen3-moe", tmp_path / "base")
    assert len(list(base.glob("*.safetensors"))) > 2
    adapter = write_random_adapter(base, tmp_path / "adapter")
    weights = load_file(adapter / "adapter_model.safetensors")
    last = sorted(k for k in weights if "q_proj.lora_A" in k)[-1]
    weights[last] = weights[last][:, :-1].contiguous()  # one input column short
    save_file(weights, adapter / "adapter_model.safetensors")
    out = tmp_path / "out"
    assert main(["export", "--model", str(base), "--adapter", str(adapter), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was it trained for another model?" in err[0], err
    assert not out.exists()
