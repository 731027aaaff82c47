"""One request failing inside the engine fails that request only.

Faults are injected into one request of a running batch at each place a step can fail (the
batched forward, prompt logprobs, logits processing, sampling, detokenization); the other
requests must finish exactly as they do alone, KV blocks must all come back, and the engine
must keep serving. Admission validates every field against the model.
"""

import asyncio
from dataclasses import replace

import pytest

from hetserve import SamplingParams
from hetserve.config import CacheConfig, EngineConfig
from hetserve.core.request import NewRequest
from hetserve.engine.async_llm import AsyncLLM
from hetserve.engine.core import EngineCore
from hetserve.engine.errors import EngineRequestError
from hetserve.errors import InvalidInputError

POISON = 499  # a prompt starting [3, POISON] fails wherever the fault is injected
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)
PROMPTS = [list(range(3, 40)), list(range(50, 61)), [3, POISON] + list(range(100, 133))]


@pytest.fixture(scope="module")
def core(tiny_model):
    path = tiny_model("qwen3-moe", lm_head_scale=4.0)
    # No prefix cache: a fault injected at the poisoned prompt's prefill must meet that prefill
    # in every test, not a cached copy from an earlier one.
    cfg = EngineConfig(model=str(path), max_model_len=128)
    return EngineCore(replace(cfg, cache=CacheConfig(enable_prefix_caching=False)))


def run(core: EngineCore, prompts, params) -> dict:
    outs = {}
    for i, p in enumerate(prompts):
        core.submit(NewRequest(f"r{i}", p, params[i] if isinstance(params, list) else params))
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                outs[out.request_id] = out
        core.check_integrity()
    stats = core.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    return outs


def solo(core, prompt, params):
    return run(core, [prompt], params)["r0"]


def assert_isolated(core, params=GREEDY):
    outs = run(core, PROMPTS, params)
    bad = outs["r2"]
    assert bad.finished and bad.error and "injected fault" in bad.error
    assert bad.outputs[0].finish_reason == "error"
    for i in (0, 1):
        alone = solo(core, PROMPTS[i], params)
        assert alone.error is None
        assert outs[f"r{i}"].token_ids == alone.token_ids and len(alone.token_ids) == 10


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_fault_in_batched_forward_fails_one_request(core, monkeypatch, params):
    forward = core.runner.forward
    monkeypatch.setattr(
        core.runner, "forward", lambda seqs: _forward_unless_poisoned(forward, seqs)
    )
    assert_isolated(core, params)
    assert core.stats().failed_requests >= 1


def _forward_unless_poisoned(forward, seqs):
    # The poisoned request's prompt enters in its prefill chunk: fail there, batched or alone.
    if any(s.num_computed == 0 and s.token_ids[:2] == [3, POISON] for s in seqs):
        raise RuntimeError("injected fault")
    return forward(seqs)


def test_fault_while_detokenizing_fails_one_request(core, monkeypatch):
    from hetserve.engine import detokenizer

    add = detokenizer.IncrementalDetokenizer.add

    def faulty(self, token_id):
        if self.ids[:5] == PROMPTS[2][-5:]:  # the detokenizer keeps the prompt's tail
            raise RuntimeError("injected fault")
        return add(self, token_id)

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "add", faulty)
    assert_isolated(core)


def test_fault_while_sampling_fails_one_request(core, monkeypatch):
    from hetserve.layers import sampler

    filt = sampler._filter

    def faulty(logits, top_k, top_p, min_p):
        if top_k == 13:  # only the poisoned request asks for top_k 13
            raise RuntimeError("injected fault")
        return filt(logits, top_k, top_p, min_p)

    monkeypatch.setattr(sampler, "_filter", faulty)
    poisoned_params = SamplingParams(
        temperature=0.9, top_k=13, seed=1, max_tokens=10, ignore_eos=True
    )
    outs = run(core, PROMPTS, [SAMPLED, SAMPLED, poisoned_params])
    assert "injected fault" in outs["r2"].error
    for i in (0, 1):
        assert outs[f"r{i}"].token_ids == solo(core, PROMPTS[i], SAMPLED).token_ids


def test_fault_in_logits_processing_fails_one_request(core, monkeypatch):
    from hetserve.layers import sampler

    process = sampler._process_row

    def faulty(row_logits, row, banned):
        if row.prompt_token_ids[:2] == [3, POISON]:
            raise RuntimeError("injected fault")
        return process(row_logits, row, banned)

    monkeypatch.setattr(sampler, "_process_row", faulty)
    penalized = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.2
    )
    outs = run(core, PROMPTS, penalized)
    assert "injected fault" in outs["r2"].error
    for i in (0, 1):
        assert outs[f"r{i}"].token_ids == solo(core, PROMPTS[i], penalized).token_ids


def test_n_sequences_fail_together(core, monkeypatch):
    forward = core.runner.forward
    monkeypatch.setattr(
        core.runner, "forward", lambda seqs: _forward_unless_poisoned(forward, seqs)
    )
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    outs = run(core, PROMPTS, params)
    assert outs["r2"].error and [c.finish_reason for c in outs["r2"].outputs] == ["error"] * 3
    assert all(len(c.token_ids) == 6 for c in outs["r0"].outputs)


@pytest.mark.parametrize(
    "params,field",
    [
        (SamplingParams(stop_token_ids=[1_000_000_000]), "stop_token_ids"),
        (SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
        (SamplingParams(max_tokens=500), "max_tokens"),
    ],
)
def test_admission_checks_fields_against_the_model(core, params, field):
    with pytest.raises(InvalidInputError) as err:
        core.submit(NewRequest("bad", [1, 2, 3], params))
    assert err.value.param == field
    assert not core.has_unfinished()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seed": 2**64},
        {"seed": -(2**63) - 1},
        {"temperature": float("nan")},
        {"top_p": float("inf")},
        {"presence_penalty": 3.0},
        {"repetition_penalty": 0.0},
        {"logprobs": 21},
        {"min_tokens": 5, "max_tokens": 4},
        {"logit_bias": {3: float("nan")}},
    ],
)
def test_sampling_params_reject_out_of_range(kwargs):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)).split("_")[0] in str(err.value)


def test_extreme_seeds_are_accepted(core):
    for seed in (2**64 - 1, -(2**63), 0):
        params = SamplingParams(seed=seed, n=2, max_tokens=3, ignore_eos=True)
        assert run(core, [[5, 6, 7]], params)["r0"].error is None


def test_async_stream_ends_with_error_and_others_continue(tiny_model, monkeypatch):
    llm = AsyncLLM(EngineConfig(model=str(tiny_model("qwen3-moe", lm_head_scale=4.0))))
    forward = llm.engine.runner.forward
    monkeypatch.setattr(
        llm.engine.runner, "forward", lambda seqs: _forward_unless_poisoned(forward, seqs)
    )

    async def consume(rid, prompt):
        tokens = []
        async for out in llm.submit(NewRequest(rid, prompt, GREEDY)):
            tokens = out.token_ids
        return tokens

    async def main():
        return await asyncio.gather(
            *(consume(f"a{i}", p) for i, p in enumerate(PROMPTS)), return_exceptions=True
        )

    try:
        good0, good1, bad = asyncio.run(main())
        assert isinstance(bad, EngineRequestError) and "injected fault" in str(bad)
        assert len(good0) == len(good1) == 10
        assert asyncio.run(main())[0] == good0  # the engine keeps serving
        assert llm.is_alive
    finally:
        llm.shutdown()
