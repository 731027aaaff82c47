"""Training end to end on tiny checkpoints: memorization, exact resume, outputs, PEFT reload."""

import json

import pytest
import torch

from hetserve.finetune.config import parse_config
from hetserve.finetune.trainer import run


def train(cfg_dict):
    cfg, _ = parse_config(cfg_dict)
    return run(cfg, say=lambda line: None)


def losses(out):
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize("use_kt", [False, True])
def test_memorization_drives_loss_below_a_tenth(base_config, tmp_path, use_kt):
    cfg = base_config(
        max_steps=30,
        learning_rate=3e-2,
        lora_rank=16,
        use_kt=use_kt,
        per_device_train_batch_size=4,
        plot_loss=True,
        lr_scheduler_type="constant",
    )
    train(cfg)
    out = tmp_path / "out"
    curve = losses(out)
    assert curve[-1] < curve[0] / 10, curve
    for name in (
        "adapter_config.json",
        "adapter_model.safetensors",
        "training_loss.png",
        "train_results.json",
        "trainer_log.jsonl",
    ):
        assert (out / name).is_file(), name


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(base_config, tmp_path):
    from safetensors.torch import load_file

    common = dict(
        max_steps=6,
        save_steps=3,
        lora_dropout=0.1,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=1,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        use_kt=True,
    )
    train(base_config(output_dir=str(tmp_path / "a"), **common))
    # Interrupted: the same run stopped after its step-3 checkpoint, then resumed.
    b = tmp_path / "b"
    train(base_config(output_dir=str(b), **common))
    for p in b.iterdir():
        if p.name != "checkpoint-3":
            if p.is_dir():
                import shutil

                shutil.rmtree(p)
            else:
                p.unlink()
    train(base_config(output_dir=str(b), resume_from_checkpoint=str(b / "checkpoint-3"), **common))
    wa = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    wb = load_file(str(b / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3", "qwen3-next"])
def test_trained_adapter_loaded_by_peft_reproduces_our_logits(base_config, tmp_path, family):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from hetserve.finetune.model import (
        add_lora,
        hidden_states,
        load_adapter_weights,
        load_for_training,
    )

    cfg = base_config(family, max_steps=3, use_kt=True)
    train(cfg)
    out = tmp_path / "out"
    ours = load_for_training(cfg["model_name_or_path"], "cpu", "float32")
    add_lora(ours, "all", 8, 16, 0.0, False)
    load_adapter_weights(ours, out)
    ids = torch.randint(0, 500, (21,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = ours.compute_logits(hidden_states(ours, ids, [21]))
    base = transformers.AutoModelForCausalLM.from_pretrained(
        cfg["model_name_or_path"], dtype=torch.float32
    )
    ref = peft.PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        theirs = ref(ids[None]).logits[0]
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-4)
    with torch.no_grad(), ref.disable_adapter():
        plain = ref(ids[None]).logits[0]
    assert (mine - plain).abs().max() > 1e-3  # the adapter did something


def test_eval_and_predict_write_what_llamafactory_writes(base_config, tmp_path):
    cfg = base_config(
        max_steps=2,
        val_size=1,
        do_eval=True,
        eval_steps=1,
        do_predict=True,
        predict_with_generate=True,
        max_new_tokens=4,
    )
    results = train(cfg)
    out = tmp_path / "out"
    assert "eval_loss" in results
    rows = [json.loads(x) for x in (out / "generated_predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and set(rows[0]) == {"prompt", "predict", "label"}
    metrics = json.loads((out / "predict_results.json").read_text())
    assert set(metrics) >= {"predict_bleu-4", "predict_rouge-l"}
    log = (out / "trainer_log.jsonl").read_text().splitlines()
    assert any("eval_loss" in json.loads(x) for x in log)


def test_gradient_checkpointing_and_quantized_experts_train(base_config, tmp_path):
    from safetensors.torch import load_file

    common = dict(max_steps=2, use_kt=True, chunk_size=16)
    train(base_config(output_dir=str(tmp_path / "a"), **common))
    train(base_config(output_dir=str(tmp_path / "b"), gradient_checkpointing=True, **common))
    wa = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
    for bits in (8, 4):
        out = tmp_path / f"q{bits}"
        train(base_config(output_dir=str(out), quantization_bit=bits, **common))
        assert all(torch.isfinite(torch.tensor(loss)) for loss in losses(out))


def test_predict_with_a_saved_adapter(base_config, tmp_path):
    train(base_config(max_steps=2))
    cfg = base_config(do_train=False, dataset=None, eval_dataset="tiny_alpaca", max_samples=1,
                      do_predict=True, predict_with_generate=True, max_new_tokens=3,
                      adapter_name_or_path=str(tmp_path / "out"),
                      output_dir=str(tmp_path / "pred"))  # fmt: skip
    results = train(cfg)
    assert "predict_rouge-l" in results
    assert (tmp_path / "pred" / "generated_predictions.jsonl").is_file()
