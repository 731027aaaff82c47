"""LoRA/DoRA on hetserve's model classes against transformers + PEFT on the same weights
(fp32): forward logits and the adapters' gradients, and the saved adapter file read by PEFT."""

import pytest
import torch

from hetserve.finetune.model import (
    add_lora,
    hidden_states,
    load_for_training,
    lora_parameters,
    save_adapter,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

FAMILIES = ["qwen3-moe", "deepseek-v3", "llama", "qwen3-next"]
# Gated DeltaNet's chunked delta rule sums in another order than transformers' reference
# kernel does (fp32 both): the hybrid family agrees to 1e-4, as its serving parity does.
TOL = {"qwen3-next": 1e-4}


def randomize_lora(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in lora_parameters(model):
        p.data = torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0)


def seqs(lengths, seed=0, vocab=500):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def ours(path, use_dora=False, **kw):
    model = load_for_training(path, device="cpu", dtype="float32", **kw)
    add_lora(model, "all", rank=4, alpha=8, dropout=0.0, use_dora=use_dora)
    randomize_lora(model)
    return model


def reference(path, adapter_dir):
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    return model.train()


def grads_by_name(model, prefix=""):
    return {
        n.removeprefix(prefix): p.grad.clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("use_dora", [False, True])
def test_lora_forward_and_grads_match_peft(tiny_model, tmp_path, family, use_dora):
    path = tiny_model(family)
    model = ours(path, use_dora)
    save_adapter(model, tmp_path)
    ref = reference(path, tmp_path)
    lengths = [13, 7]
    batch = seqs(lengths)
    g = torch.Generator().manual_seed(1)
    probe = [torch.randn(n, model.config.vocab_size, generator=g) for n in lengths]

    logits = model.compute_logits(hidden_states(model, torch.cat(batch), lengths))
    (logits * torch.cat(probe)).sum().backward()
    ref_logits = torch.cat([ref(ids[None]).logits[0] for ids in batch])
    (ref_logits * torch.cat(probe)).sum().backward()
    ref_logits = ref_logits.detach()
    tol = TOL.get(family, 1e-5)
    torch.testing.assert_close(logits.detach(), ref_logits, rtol=tol, atol=tol)
    mine, theirs = grads_by_name(model), grads_by_name(ref, "base_model.model.")
    assert mine.keys() == theirs.keys() and mine
    for name in mine:
        scale = theirs[name].abs().max().clamp(min=1e-3)
        err = (mine[name] - theirs[name]).abs().max() / scale
        assert err < tol, (name, err)
