"""The 2026 families through the engine: linear-attention models (Qwen3-Next, Qwen3.5-MoE,
Kimi-Linear) with chunked prefill at any chunk size, mixed batches and preemption, each equal to
one plain pass; DeepSeek-V3.2's indexer really selecting. Parity against transformers is in
test_parity.py."""

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.core.request import NewRequest
from tests.model.test_parity import random_ids

HYBRID = ["qwen3-next", "qwen3.5-moe", "kimi-linear"]
PROMPT_LP = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def chosen(entries, ids):
    return torch.tensor([e[t].logprob for e, t in zip(entries[1:], ids[1:], strict=True)])


@pytest.mark.parametrize("family", HYBRID)
def test_chunked_prefill_at_any_chunk_size_equals_one_pass(tiny_model, family):
    path = tiny_model(family)
    ids = random_ids(150, seed=9)
    whole = LLM(path, placement="device").generate(prompt_token_ids=ids, sampling_params=PROMPT_LP)[
        0
    ]
    for budget in (7, 16, 61):
        llm = LLM(path, max_num_batched_tokens=budget, placement="device")
        out = llm.generate(prompt_token_ids=ids, sampling_params=PROMPT_LP)[0]
        assert llm.stats().steps > 150 // budget  # it really ran in chunks
        torch.testing.assert_close(
            chosen(out.prompt_logprobs, ids), chosen(whole.prompt_logprobs, ids), atol=1e-4, rtol=0
        )
        assert out.token_ids == whole.token_ids


def test_chunked_prefill_under_all_int8_stays_within_rounding_flips(tiny_model):
    """Under all-int8 the activations are rounded to int16 per row (linears and routed experts
    alike), the same at any chunking: layer 0, whose inputs are equal, differs by 7e-7 between
    61 tokens alone and the first 61 of 150 (what the chunked delta rule's fp32 sums change),
    where a per-call scale would move it by whole quanta. From there on such differences cross
    rounding boundaries of later quantized linears and experts (a whole quantum each), and the
    delta rule's recurrence carries them down the sequence: layer 1's linear attention differs
    by 3.8e-4 under all-int8 against 7e-6 under placement device. Measured on this model: max
    5e-4, mean 1e-4 over 149 positions at budgets 7, 16 and 61 (1.6e-3 / 3e-4 before the tiny
    model's norms scaled by 1 and linear attention's inputs kept an int8 residual; the hybrid
    placement, int8 experts only: 1.4e-4 / 2.5e-5; device: 4e-6 / 6e-7); the bound leaves
    room for other CPUs' kernel paths."""
    from hetserve.native import native_unavailable_reason

    if native_unavailable_reason() is not None:  # fbgemm's per-call scales: another bound
        pytest.skip(f"native kernels unavailable: {native_unavailable_reason()}")
    path = tiny_model("qwen3-next")
    ids = random_ids(150, seed=9)
    int8 = {"placement": "all-int8"}
    whole = LLM(path, **int8).generate(prompt_token_ids=ids, sampling_params=PROMPT_LP)[0]
    for budget in (7, 61):
        llm = LLM(path, max_num_batched_tokens=budget, **int8)
        out = llm.generate(prompt_token_ids=ids, sampling_params=PROMPT_LP)[0]
        diff = (chosen(out.prompt_logprobs, ids) - chosen(whole.prompt_logprobs, ids)).abs()
        assert float(diff.max()) <= 5e-3 and float(diff.mean()) <= 1e-3, budget


@pytest.mark.parametrize(
    "family", ["qwen3-next", "qwen3.5-moe", "kimi-linear", "deepseek-v3.2", "minimax-m2"]
)
def test_each_family_serves_under_the_cpu_default(tiny_model, family):
    """all-int8 (what --placement auto picks without an accelerator) runs every module of the
    family, V3.2's indexer included (its head-weight projection is an int8 linear there).
    Closeness with top-k routing is loose on these tiny random models: a token whose expert
    choice flips at a near-tie of the random router moves by up to 0.9 nats (V3.2's selection
    moves with its inputs too), so only a loose mean is held here; the linear-attention
    families' stated bound, with routing that cannot flip, is in test_hybrid_int8.py."""
    path = tiny_model(family)
    ids = random_ids(40, seed=3)
    exact = LLM(path, placement="device").generate(prompt_token_ids=ids, sampling_params=PROMPT_LP)
    int8 = LLM(path, placement="all-int8").generate(prompt_token_ids=ids, sampling_params=PROMPT_LP)
    diff = chosen(int8[0].prompt_logprobs, ids) - chosen(exact[0].prompt_logprobs, ids)
    assert len(int8[0].token_ids) == 6 and bool(torch.isfinite(diff).all())
    assert float(diff.abs().mean()) <= 0.5, (family, float(diff.abs().mean()))


@pytest.mark.parametrize("family", ["qwen3-next", "kimi-linear"])
def test_mixed_batch_equals_solo_runs(tiny_model, family):
    """Requests of different lengths in one batch (prefill chunks beside decodes, each with its
    own state slot) produce what each produces alone."""
    llm = LLM(tiny_model(family, lm_head_scale=8.0), max_num_batched_tokens=40, placement="device")
    prompts = [random_ids(n, seed=n) for n in (3, 90, 17, 45, 1, 64)]
    together = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for p, out in zip(prompts, together, strict=True):
        assert (
            out.token_ids == llm.generate(prompt_token_ids=p, sampling_params=GREEDY)[0].token_ids
        )
    eng = llm.engine
    eng.check_integrity()
    assert not eng.kv.states.working  # every working slot came back


def test_preemption_by_recompute_restarts_the_state(tiny_model):
    path = tiny_model("qwen3-next", lm_head_scale=8.0)
    prompts = [random_ids(n, seed=n) for n in (20, 31, 25, 38, 22, 29)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [
        o.token_ids
        for o in LLM(path, placement="device").generate(
            prompt_token_ids=prompts, sampling_params=params
        )
    ]
    tight = LLM(path, max_model_len=64, num_kv_blocks=6, placement="device")
    got = [o.token_ids for o in tight.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert tight.stats().preemptions > 0
    assert got == ref
    tight.engine.check_integrity()


def test_state_slots_bound_the_running_requests(tiny_model):
    llm = LLM(tiny_model("kimi-linear"), max_num_seqs=2, placement="device")
    eng = llm.engine
    assert eng.kv.states.num_working == 2 and eng.runner.state.num_slots == 5  # + 2 ckpts
    for i in range(4):
        eng.submit(NewRequest(f"r{i}", random_ids(30, seed=i), GREEDY))
    while eng.has_unfinished():
        eng.step()
        assert len(eng.scheduler.running) <= 2
        eng.check_integrity()


def test_v32_indexer_selects(tiny_model):
    """With top-k below the context the indexer's choice changes the result; with top-k above
    it, it is plain MLA over every token (so the parity tests do exercise the selection)."""
    ids = random_ids(130, seed=1)
    sparse = LLM(tiny_model("deepseek-v3.2"), placement="device")
    dense = LLM(tiny_model("deepseek-v3.2", overrides={"index_topk": 4096}), placement="device")
    a = sparse.generate(prompt_token_ids=ids, sampling_params=PROMPT_LP)[0]
    b = dense.generate(prompt_token_ids=ids, sampling_params=PROMPT_LP)[0]
    la, lb = chosen(a.prompt_logprobs, ids), chosen(b.prompt_logprobs, ids)
    torch.testing.assert_close(la[:15], lb[:15], atol=1e-5, rtol=0)  # <= 16 keys: all taken
    assert (la[20:] - lb[20:]).abs().max() > 1e-3


def test_v32_serves_under_the_cpu_default_placement(tiny_model):
    """all-int8 quantizes the indexer's head-weight projection too (it has no `weight` then);
    the prompt's logprobs stay within int8's error of the exact run (0.02-0.13 nats mean
    measured on tiny V3.2 models; a wrong projection would be nats off)."""
    ids = random_ids(40, seed=2)
    path = tiny_model("deepseek-v3.2")
    exact = LLM(path, placement="device").generate(prompt_token_ids=ids, sampling_params=PROMPT_LP)
    int8 = LLM(path, placement="all-int8").generate(prompt_token_ids=ids, sampling_params=PROMPT_LP)
    diff = chosen(exact[0].prompt_logprobs, ids) - chosen(int8[0].prompt_logprobs, ids)
    assert diff.abs().mean() < 0.3


def test_qwen35_loads_the_published_vision_language_layout(tiny_model, tmp_path):
    """Qwen3.5-MoE is published as a vision-language model: config under text_config, the text
    model under model.language_model., a vision tower beside it. Its text model serves as is."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    flat = tiny_model("qwen3.5-moe")
    out = tmp_path / "vl"
    shutil.copytree(flat, out)
    cfg = json.loads((flat / "config.json").read_text())
    text = {k: v for k, v in cfg.items() if k != "architectures"}
    vl = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 8},
    }
    (out / "config.json").write_text(json.dumps(vl))
    tensors = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in load_file(flat / "model.safetensors").items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    ids = random_ids(40, seed=2)
    a = LLM(flat, placement="device").generate(prompt_token_ids=ids, sampling_params=PROMPT_LP)[0]
    b = LLM(out, placement="device").generate(prompt_token_ids=ids, sampling_params=PROMPT_LP)[0]
    assert a.prompt_logprobs == b.prompt_logprobs and a.token_ids == b.token_ids
