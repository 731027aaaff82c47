"""Prompt chunks sized by time, end to end on a tiny model with a fake step time
(deterministic): under every mix of decodes and long prompts, each step with decodes and a
prompt chunk is predicted within the step limit, every request finishes, and every output
equals the unchunked run's (greedy)."""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetserve import LLM
from hetserve.engine.step_log import shape_of
from hetserve.kv.step_time import StepKind, StepShape
from tests.sched.mixed_runs import long_prompt, reference, run, stream

MAX_LEN = 256
LIMIT_S = 0.005
_RUNS = itertools.count()  # request ids never repeat, even when a failing example is replayed


class FakeStepTime:
    """1 ms per step, 0.1 ms per token, 10 ns per attention pair: deep chunks cost more."""

    def predict(self, shape: StepShape) -> float:
        return 0.001 + 1e-4 * shape.tokens + 1e-8 * (shape.chunk_pairs + shape.decode_context)

    def max_chunk(self) -> int | None:
        return None

    def layer_time(self, tokens: int, computed: int) -> float | None:
        return None  # no layer slices here (tests/sched/test_layer_slices.py has them)


@pytest.fixture(scope="module")
def engines(tiny_model):
    path = tiny_model("llama", lm_head_scale=8.0)
    # fp32 attention products at prefill: where this CPU has AVX512-BF16 the prefill kernel
    # would multiply in bf16 (an approximation of its own) while a small chunk beside decodes
    # runs the fused step's fp32 attention; a 3-token prompt chunked one way or the other then
    # drew a different 15th token. Chunking is exact only path for path.
    exact = {"prefill_attention_dtype": "float32"}
    unchunked = LLM(path, max_model_len=MAX_LEN, max_step_ms=float("inf"), **exact)
    timed = LLM(path, max_model_len=MAX_LEN, max_step_ms=LIMIT_S * 1e3, max_num_seqs=8, **exact)
    timed.engine.scheduler.step_time = FakeStepTime()
    yield unchunked, timed.engine, {}
    timed.close()


@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    st.lists(st.tuples(stream, st.integers(0, 5)), min_size=0, max_size=5),
    st.lists(st.tuples(long_prompt, st.integers(0, 12)), min_size=1, max_size=3),
)
def test_mixed_steps_stay_within_the_limit_and_outputs_match(engines, streams, prompts):
    _, eng, _ = engines
    fake = FakeStepTime()
    reqs = [(p, m, at) for (p, m), at in streams + prompts]
    schedule = eng.scheduler.schedule

    def checked_schedule():
        out = schedule()
        shape = shape_of(out.scheduled)
        if shape.kind is StepKind.MIXED:
            assert fake.predict(shape) <= LIMIT_S, [s.num_new_tokens for s in out.scheduled]
        return out

    eng.scheduler.schedule = checked_schedule
    tag = f"t{next(_RUNS)}-"
    try:
        finished = run(eng, reqs, tag, max_steps=2000)
    finally:
        del eng.scheduler.schedule
        for rid in list(eng.parents):  # a failed example leaves the next one a clean engine
            eng.abort_request(rid)
    assert set(finished) == {f"{tag}{i}" for i in range(len(reqs))}  # every request finished
    for rid, tokens in finished.items():
        prompt, max_tokens, _ = reqs[int(rid.removeprefix(tag))]
        assert tokens == reference(engines[0], engines[2], prompt, max_tokens), rid


def test_the_examples_did_mix_decodes_and_chunks(engines):
    """Runs after the property test of this module: time really sized chunks beside decodes."""
    _, eng, _ = engines
    mixed = eng.stats().step_kinds["mixed"]
    if eng.stats().steps == 0:
        pytest.skip("only meaningful after the property test of this module")
    assert mixed.seconds.count > 10 and mixed.chunk_tokens.count > 10
