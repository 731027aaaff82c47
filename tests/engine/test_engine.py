"""Engine behaviour: batch invariance, prefix caching, preemption, abort, integrity."""

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.core.block_hash import hash_prefix_blocks
from hetserve.core.request import NewRequest

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 120) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 500, (k,), generator=g).tolist() for k in lens]


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe", "deepseek-v3"])
def test_batch_invariance(tiny_model, family):
    path = tiny_model(family, lm_head_scale=8.0)
    # A small token budget forces chunked prefill and prefill+decode mixed in one step.
    llm = LLM(path, max_num_batched_tokens=48, enable_prefix_caching=False)
    ps = prompts(8, seed=1)
    together = llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)
    for p, out in zip(ps, together, strict=True):
        alone = llm.generate(prompt_token_ids=p, sampling_params=GREEDY)[0]
        assert out.token_ids == alone.token_ids
    assert llm.stats().steps > 0
    llm.engine.check_integrity()


def test_prefix_cache_hit_computes_only_new_tokens(tiny_model):
    path = tiny_model("qwen3-moe", lm_head_scale=8.0)
    llm = LLM(path, block_size=16)
    shared = prompts(1, seed=2, lo=64, hi=65)[0]
    a = shared + [7, 8, 9, 10, 11]
    b = shared + [20, 21, 22, 23, 24, 25, 26]
    llm.generate(prompt_token_ids=a, sampling_params=GREEDY)
    before = llm.stats().prompt_tokens_computed
    out_b = llm.generate(prompt_token_ids=b, sampling_params=GREEDY)[0]
    assert out_b.num_cached_tokens == 64
    assert llm.stats().prompt_tokens_computed - before == len(b) - 64
    cold = LLM(path, block_size=16, enable_prefix_caching=False)
    assert cold.generate(prompt_token_ids=b, sampling_params=GREEDY)[0].token_ids == out_b.token_ids
    llm.engine.check_integrity()


def test_cache_extra_separates_prefixes(tiny_model):
    llm = LLM(tiny_model("qwen3"), block_size=16)
    ids = prompts(1, seed=3, lo=70, hi=71)[0]
    llm.engine.submit(NewRequest("a", ids, GREEDY))
    llm.engine.submit(NewRequest("b", ids, GREEDY, cache_extra=("lora:1",)))
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.submit(NewRequest("c", ids, GREEDY, cache_extra=("lora:1",)))
    outs = []
    while llm.engine.has_unfinished():
        outs += llm.engine.step()
    assert outs[-1].num_cached_tokens == 64
    assert hash_prefix_blocks(ids, 16) != hash_prefix_blocks(ids, 16, extra=("lora:1",))


def test_preemption_under_small_kv_budget_keeps_outputs(tiny_model):
    path = tiny_model("qwen3-moe", lm_head_scale=8.0)
    ps = prompts(6, seed=4, lo=20, hi=40)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ample = LLM(path, max_model_len=64, enable_prefix_caching=False)
    ref = [o.token_ids for o in ample.generate(prompt_token_ids=ps, sampling_params=params)]
    tight = LLM(path, max_model_len=64, num_kv_blocks=6, enable_prefix_caching=False)
    got = [o.token_ids for o in tight.generate(prompt_token_ids=ps, sampling_params=params)]
    assert tight.stats().preemptions > 0
    assert got == ref
    assert tight.engine.kv.pool.num_free == tight.engine.kv.pool.num_usable


def test_abort_frees_blocks(tiny_model):
    llm = LLM(tiny_model("qwen3"))
    eng = llm.engine
    eng.submit(NewRequest("x", list(range(40)), SamplingParams(max_tokens=100, ignore_eos=True)))
    eng.submit(NewRequest("y", list(range(50, 90)), SamplingParams(max_tokens=3, ignore_eos=True)))
    eng.step()
    assert eng.kv.pool.num_free < eng.kv.pool.num_usable
    assert eng.abort_request("x") and not eng.abort_request("x")
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
    assert eng.kv.pool.num_free == eng.kv.pool.num_usable


def test_priority_policy_runs_urgent_first(tiny_model):
    llm = LLM(tiny_model("qwen3"), max_num_seqs=1, scheduling_policy="priority")
    eng = llm.engine
    p = SamplingParams(max_tokens=2, ignore_eos=True)
    eng.submit(NewRequest("late", [1, 2, 3], p, priority=5))
    eng.submit(NewRequest("urgent", [4, 5, 6], p, priority=0))
    first_done = None
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished and first_done is None:
                first_done = out.request_id
    assert first_done == "urgent"
