"""Prefix caching for linear-attention models: a prefix is resumed from the last state
checkpoint (kv/state_slots.py) and gives what transformers gives for the whole conversation;
checkpoints are kept every N blocks, evicted like blocks, and survive preemption."""

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.core.request import NewRequest
from tests.model.test_parity import chosen_logprobs, random_ids

transformers = pytest.importorskip("transformers")

SAMPLE = SamplingParams(max_tokens=12, temperature=1.0, seed=3, logprobs=0, ignore_eos=True)


@pytest.mark.parametrize("family", ["qwen3-next", "kimi-linear"])
def test_prefix_hit_mid_conversation_matches_transformers(tiny_model, family):
    from tests.model.test_parity import hf_logprobs, hf_model

    path = tiny_model(family)
    llm = LLM(path, state_checkpoint_every=2, placement="device")
    first = random_ids(75, seed=1)
    reply = llm.generate(prompt_token_ids=first, sampling_params=SAMPLE)[0].token_ids
    second = first + reply + random_ids(9, seed=2)  # the next turn: 96 tokens
    out = llm.generate(prompt_token_ids=second, sampling_params=SAMPLE)[0]
    assert out.num_cached_tokens == 64  # the last checkpoint (every 2 blocks of 16) it reaches
    ref = hf_logprobs(hf_model(path), second + out.token_ids)[len(second) - 1 : -1]
    ref = ref.gather(1, torch.tensor(out.token_ids).view(-1, 1))[:, 0]
    ours = chosen_logprobs(zip(out.logprobs, out.token_ids, strict=True))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    llm.engine.check_integrity()


def test_checkpoint_interval_and_slots(tiny_model):
    path = tiny_model("qwen3.5-moe")
    prompt = random_ids(110, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    solo = LLM(path, enable_prefix_caching=False, placement="device").generate(
        prompt_token_ids=prompt, sampling_params=greedy
    )[0]
    for every, cached in ((1, 96), (3, 96), (4, 64)):
        llm = LLM(path, state_checkpoint_every=every, placement="device")
        llm.generate(prompt_token_ids=prompt[:100], sampling_params=greedy)
        out = llm.generate(prompt_token_ids=prompt, sampling_params=greedy)[0]
        assert out.num_cached_tokens == cached, every
        assert out.token_ids == solo.token_ids
    # Without checkpoint slots no prefix can be resumed: blocks alone are not enough.
    llm = LLM(path, state_checkpoints=0, placement="device")
    llm.generate(prompt_token_ids=prompt[:100], sampling_params=greedy)
    assert llm.generate(prompt_token_ids=prompt, sampling_params=greedy)[0].num_cached_tokens == 0
    assert llm.engine.kv.hits == 0


def test_preempted_requests_resume_from_their_checkpoints(tiny_model):
    """Requests sharing a 48-token prefix under a block budget that forces preemption: what each
    produces equals a run without prefix caching, and resumed prefixes were really used."""
    path = tiny_model("qwen3-next", lm_head_scale=8.0)
    shared = random_ids(48, seed=7)
    prompts = [shared + random_ids(n, seed=n) for n in (5, 12, 9, 14, 3, 11)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = LLM(path, enable_prefix_caching=False, placement="device")
    want = [o.token_ids for o in ref.generate(prompt_token_ids=prompts, sampling_params=params)]
    tight = LLM(
        path, max_model_len=96, num_kv_blocks=9, state_checkpoint_every=1, placement="device"
    )
    got = tight.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == want
    assert tight.stats().preemptions > 0
    assert tight.engine.kv.hits > 0
    tight.engine.check_integrity()
    states = tight.engine.kv.states
    assert states.pool.num_free == states.pool.num_usable  # checkpoints are free, findable


@pytest.mark.parametrize("family", ["qwen3-next", "llama"])
def test_preemption_by_swap_resumes_with_the_state(tiny_model, family):
    """The same pressure with --preemption-mode swap: preempted requests carry their blocks and
    linear-attention state to host memory and back, resume without recomputing, and produce
    what they produce alone."""
    path = tiny_model(family, lm_head_scale=8.0)
    prompts = [random_ids(n, seed=n) for n in (40, 33, 45, 28, 37, 30)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = LLM(path, enable_prefix_caching=False, placement="device")
    want = [o.token_ids for o in ref.generate(prompt_token_ids=prompts, sampling_params=params)]
    tight = LLM(
        path, max_model_len=96, num_kv_blocks=9, enable_prefix_caching=False,
        preemption_mode="swap", placement="device",
    )  # fmt: skip
    eng = tight.engine
    for i, p in enumerate(prompts):
        eng.submit(NewRequest(f"r{i}", p, params))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.token_ids
        eng.check_integrity()
    assert [got[f"r{i}"] for i in range(len(prompts))] == want
    assert tight.stats().preemptions > 0 and eng.swap.swaps_in == eng.swap.swaps_out > 0
    # Nothing was recomputed: every prompt token was computed exactly once.
    assert tight.stats().prompt_tokens_computed == sum(len(p) for p in prompts)
    assert eng.swap.used == 0 and eng.swap.swapped() == set()
