"""Logit parity against transformers (the reference) for every supported family, in fp32."""

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.testing import FAMILIES

transformers = pytest.importorskip("transformers")

ALL = sorted(FAMILIES)
MOE = ["qwen2-moe", "qwen3-moe", "mixtral", "deepseek-v2", "deepseek-v3", "gpt-oss", "qwen3-next",
       "qwen3.5-moe", "kimi-linear", "deepseek-v3.2", "minimax-m2"]  # fmt: skip


def hf_model(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    # Our checkpoint writer must produce exactly what transformers expects.
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def chosen_logprobs(entries) -> torch.Tensor:
    return torch.tensor([e[t].logprob for e, t in entries])


def random_ids(n: int, seed: int, vocab: int = 500) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", ALL)
def test_prompt_logprobs_match_transformers(tiny_model, family):
    path = tiny_model(family)
    ref_model = hf_model(path)
    llm = LLM(path, placement="device")
    for n in (2, 17, 64, 130):
        ids = random_ids(n, seed=n)
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        out = llm.generate(prompt_token_ids=ids, sampling_params=params)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
        ours = chosen_logprobs(zip(out.prompt_logprobs[1:], ids[1:], strict=True))
        ref = hf_logprobs(ref_model, ids)[:-1].gather(1, torch.tensor(ids[1:]).view(-1, 1))[:, 0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ALL)
def test_decode_logprobs_match_transformers(tiny_model, family):
    """The KV-cached decode path: logprobs of sampled tokens equal a full forward's."""
    path = tiny_model(family)
    ref_model = hf_model(path)
    llm = LLM(path, placement="device")
    ids = random_ids(23, seed=5)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, logprobs=0, ignore_eos=True)
    out = llm.generate(prompt_token_ids=ids, sampling_params=params)[0]
    full = ids + out.token_ids
    ref = hf_logprobs(ref_model, full)[len(ids) - 1 : -1]
    ref = ref.gather(1, torch.tensor(out.token_ids).view(-1, 1))[:, 0]
    ours = chosen_logprobs(zip(out.logprobs, out.token_ids, strict=True))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ALL)
def test_greedy_generation_matches_transformers_generate(tiny_model, family):
    path = tiny_model(family, lm_head_scale=8.0)
    ref_model = hf_model(path)
    llm = LLM(path, placement="device")
    for seed in (0, 1):
        ids = random_ids(12, seed=seed)
        with torch.no_grad():
            ref = ref_model.generate(
                torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False
            )[0, len(ids) :].tolist()
        params = SamplingParams(max_tokens=32, min_tokens=32, temperature=0)
        out = llm.generate(prompt_token_ids=ids, sampling_params=params)[0]
        assert out.token_ids == ref
        assert out.finish_reason == "length"


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral", "deepseek-v3"])
def test_fused_and_per_expert_layouts_agree(tiny_model, family):
    per_expert = LLM(tiny_model(family, seed=7), placement="device")
    fused = LLM(tiny_model(family, seed=7, layout="fused"), placement="device")
    assert sorted(p.name for p in tiny_model(family, seed=7, layout="fused").iterdir()) == sorted(
        p.name for p in tiny_model(family, seed=7).iterdir()
    )
    ids = random_ids(40, seed=11)
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)
    a = per_expert.generate(prompt_token_ids=ids, sampling_params=params)[0]
    b = fused.generate(prompt_token_ids=ids, sampling_params=params)[0]
    assert a.token_ids == b.token_ids
    assert a.prompt_logprobs == b.prompt_logprobs


def test_loads_checkpoint_saved_by_transformers(tmp_path):
    """A checkpoint written by transformers' save_pretrained (Mixtral w1/w2/w3 names)."""
    cfg = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    from hetserve.testing import make_tiny_checkpoint  # noqa: F401  (same tokenizer cache)
    from hetserve.testing.tiny import cache_dir
    from hetserve.testing.tiny_tokenizer import write_tokenizer_files

    write_tokenizer_files(tmp_path, cache_dir())
    llm = LLM(tmp_path, placement="device")
    ids = random_ids(20, seed=2, vocab=128)
    out = llm.generate(
        prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0)
    )[0]
    ref = hf_logprobs(model, ids)[:-1].gather(1, torch.tensor(ids[1:]).view(-1, 1))[:, 0]
    ours = chosen_logprobs(zip(out.prompt_logprobs[1:], ids[1:], strict=True))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", MOE)
def test_routing_matters(tiny_model, family):
    """Guard against a parity test that passes because experts contribute nothing."""
    llm = LLM(tiny_model(family), placement="device")
    ids = random_ids(16, seed=4)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    before = llm.generate(prompt_token_ids=ids, sampling_params=params)[0].prompt_logprobs
    for _, experts in llm.model.routed_experts():
        experts.w2.data.mul_(0.0)
    after = llm.generate(prompt_token_ids=ids, sampling_params=params)[0].prompt_logprobs
    assert before[1:] != after[1:]
