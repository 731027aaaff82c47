"""The GPU side end to end (issue 40 part B): routed experts on the host beside attention on
CUDA (hot experts, deferral), swap preemption, a prefix reloaded from the DRAM tier into the GPU
cache. Run where CUDA exists, skipped elsewhere.

In fp32 on CUDA, so that the outputs can be held to the CPU's (max |delta logprob| < 1e-3, the
bound of tests/model/test_cuda.py) and tokens compared exactly: in bf16 a different batch shape
alone flips greedy tokens of these tiny models with scaled logits."""

import json

import pytest

from hetserve import LLM, SamplingParams

from .test_cuda import IDS, ours, prompt_logprobs

pytestmark = pytest.mark.gpu

EXPERTS = r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts"
FP32_CUDA = {"device": "cuda", "dtype": "float32"}


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3"])
def test_cuda_hybrid_host_experts_hot_and_deferred(tiny_model, tmp_path, family):
    """Routed experts on the host, the rest on the GPU, decode through CUDA graphs split at the
    host calls; two hot experts per layer on the GPU; deferral d = 1 changes decode only.
    deepseek-v3's shared experts run while the host computes the routed ones (another thread,
    which must order its copies after the router's kernels on the caller's stream)."""
    path = tiny_model(family, lm_head_scale=8.0, overrides={"num_experts_per_tok": 4})
    ref = ours(path, device="cpu", placement="device")
    stats = tmp_path / "stats.json"
    cfg = json.loads((path / "config.json").read_text())
    layers, experts = cfg["num_hidden_layers"], cfg.get("num_experts") or cfg["n_routed_experts"]
    hot = {str(i): [experts - e for e in range(experts)] for i in range(layers)}
    stats.write_text(json.dumps({"version": 1, "layers": hot}))
    rules = tmp_path / "rules.yaml"  # the routed experts on the host in fp32, the rest on CUDA
    rules.write_text(json.dumps({"rules": [
        {"name": "experts", "match": EXPERTS, "device": "cpu", "backend": "cpu-fp32"},
        {"name": "rest", "match": ".*", "device": "auto"},
    ]}))  # fmt: skip
    for extra in ({}, {"gpu_experts": 2, "routing_stats": str(stats)}):
        out = ours(path, **FP32_CUDA, placement=str(rules), **extra)
        delta = (prompt_logprobs(out) - prompt_logprobs(ref)).abs()
        assert delta.max() < 1e-3, (extra, delta.max().item())
        assert out.token_ids == ref.token_ids, extra
    out = ours(path, **FP32_CUDA, placement=str(rules), max_deferred_experts_per_token=1)
    # Prefill never defers: the prompt's logprobs track the reference as closely as above.
    assert (prompt_logprobs(out) - prompt_logprobs(ref)).abs().max() < 1e-3
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3"])
def test_cuda_deferred_host_experts_equal_the_cpu_deferral(tiny_model, tmp_path, family):
    """Deferral d = 1, 2 with the routed experts on the host: a layer's late experts (deferral
    thread) and its on-time ones (the engine thread, or the overlap thread beside deepseek's
    shared experts) are in one DeviceBridge at once; its pinned buffers were shared, so one
    call's ids, weights or result could be the other's. Teacher-forced decode logprobs must be
    the CPU's under the same deferral."""
    from hetserve.bench.deferral import decode_logprobs

    path = tiny_model(family, lm_head_scale=8.0, overrides={"num_experts_per_tok": 4})
    rules = tmp_path / "rules.yaml"
    rules.write_text(json.dumps({"rules": [
        {"name": "experts", "match": EXPERTS, "device": "cpu", "backend": "cpu-fp32"},
        {"name": "rest", "match": ".*", "device": "auto"},
    ]}))  # fmt: skip
    cpu = LLM(path, device="cpu", dtype="float32", placement="device")
    gpu = LLM(path, **FP32_CUDA, placement=str(rules))
    try:
        for d in (1, 2):
            assert cpu.model.set_expert_deferral(d) == gpu.model.set_expert_deferral(d) == d
            for _ in range(3):  # a race shows in some runs, not every one
                ref = decode_logprobs(cpu.model, IDS[:20], IDS[20:60])
                out = decode_logprobs(gpu.model, IDS[:20], IDS[20:60]).cpu()
                assert (out - ref).abs().max() < 1e-3, (d, (out - ref).abs().max().item())
    finally:
        cpu.close()
        gpu.close()


def test_cuda_prefix_reloaded_from_dram_into_the_gpu_cache(tiny_model):
    """A prefix evicted from the GPU cache comes back from the DRAM tier: cached tokens counted
    from "dram", the output the same as computing it."""
    from hetserve.core.request import NewRequest

    path = tiny_model("qwen3-moe", lm_head_scale=8.0)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    a, b = IDS[:100], IDS[100:] + IDS[:50]
    llm = LLM(path, **FP32_CUDA, placement="device", max_model_len=128, num_kv_blocks=12,
              kv_store="local://?dram=64M")  # fmt: skip
    try:
        cost = llm.engine.tiers.cost
        cost.prefill_tokens_per_s = 1.0  # every load looks worth it, whatever the GPU measures
        cost.observe_prefill = lambda *a: None

        def run(prompt, rid):
            llm.engine.submit(NewRequest(rid, prompt, params))
            done = None
            while llm.engine.has_unfinished():
                for o in llm.engine.step():
                    if o.finished:
                        done = o
                llm.engine.check_integrity()
            return done

        first = run(a, "a")
        assert llm.engine.tiers.flush()
        run(b, "b")  # evicts a's blocks from the 12-block GPU cache
        assert llm.engine.tiers.flush()
        again = run(a, "a2")
        assert again.cached_tokens_by_tier.get("dram", 0) > 0, again.cached_tokens_by_tier
        assert again.token_ids == first.token_ids
        assert llm.stats().tiers.load_bytes > 0
    finally:
        llm.close()


def test_cuda_swap_preemption_resumes(tiny_model):
    """Preemption by swap on CUDA: blocks go to pinned host memory and back, every request ends
    with the tokens it produces alone."""
    path = tiny_model("qwen3-moe", lm_head_scale=8.0)
    prompts = [IDS[i : i + n] for i, n in ((0, 40), (5, 33), (9, 45), (20, 28), (31, 37))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = LLM(path, **FP32_CUDA, placement="device", enable_prefix_caching=False)
    want = [alone.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids
            for p in prompts]  # fmt: skip
    alone.close()
    tight = LLM(path, **FP32_CUDA, placement="device", max_model_len=96, num_kv_blocks=9,
                enable_prefix_caching=False, preemption_mode="swap")  # fmt: skip
    try:
        got = tight.generate(prompt_token_ids=prompts, sampling_params=params)
        assert tight.stats().preemptions > 0
        assert [o.token_ids for o in got] == want
    finally:
        tight.close()


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3"])
def test_cuda_drafted_rows_equal_decoding(tiny_model, family):
    """Speculative decoding on CUDA: a decode's drafts run as decode rows of the GPU's
    attention metadata (GQA's and MLA's kernels, the graphs' eager fallback for such steps),
    routed experts on the host; the tokens are decoding's, with a right and an edited
    prediction as with ngram drafts."""
    path = tiny_model(family, lm_head_scale=8.0)
    prompts = [IDS[:24] * 2, IDS[5:30]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM(path, **FP32_CUDA, placement="device")
    want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    plain.close()
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "adaptive": False}  # fmt: skip
    drafting = LLM(path, **FP32_CUDA, placement="device", speculative_config=spec)
    try:
        got = drafting.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in got] == want
        edited = [w[:10] + [(t + 1) % 50 for t in w[10:14]] + w[14:] for w in want]
        got = drafting.generate(prompt_token_ids=prompts, sampling_params=params,
                                predictions=edited)  # fmt: skip
        assert [o.token_ids for o in got] == want
        assert sum(o.outputs[0].accepted_draft_tokens for o in got) > 0
    finally:
        drafting.close()
