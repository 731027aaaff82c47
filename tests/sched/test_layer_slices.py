"""Layer slices end to end on a tiny MoE with a fake step time (deterministic): beside decodes a
prompt chunk runs a few decoder layers a step, under a step limit when that advances the prompt
further than a chunk through every layer, without one when that keeps the prompt's efficiency
in a shorter step; each such step is predicted within the limit (or runs the one layer a slice
must progress by) or within its allowance, every request finishes, and every output equals the
unchunked run's (greedy)."""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetserve import LLM, SamplingParams
from hetserve.core.request import NewRequest
from hetserve.engine.step_log import shape_of
from hetserve.kv.step_time import StepShape
from hetserve.sched.scheduler import SchedulerOutput
from hetserve.sched.step_budget import EFFICIENCY, StepBudget
from tests.sched.mixed_runs import long_prompt, reference, run, stream

MAX_LEN = 256
LIMIT_S = 0.005
LAYERS = 3  # the tiny deepseek-v3: MLA, a dense first layer, then MoE layers
_RUNS = itertools.count()


class FakeStepTime:
    """A CPU MoE's shape: a fixed cost a step, a cost a token, and 2 ms for any prompt chunk
    (the experts its tokens read), which a few layers of a long chunk share."""

    def __init__(self, step_s: float = 1e-3, token_s: float = 1e-4) -> None:
        self.step_s, self.token_s = step_s, token_s

    def predict(self, shape: StepShape) -> float:
        return self.step_s + self.token_s * shape.tokens + 2e-3 * shape.chunks

    def max_chunk(self) -> int | None:
        return None

    def layer_time(self, tokens: int, computed: int) -> float | None:
        return (2e-3 + self.token_s * tokens) / LAYERS


# Without a limit a slice must keep the prompt's efficiency: tokens dear beside a cheap step,
# so that the tiny prompts' chunks are long enough for it.
FAKES = {"limit": FakeStepTime(), "default": FakeStepTime(1e-4, 1e-3)}


@pytest.fixture(scope="module")
def engines(tiny_model):
    path = tiny_model("deepseek-v3", lm_head_scale=8.0)
    unchunked = LLM(path, max_model_len=MAX_LEN, max_step_ms=float("inf"), placement="device")
    timed = LLM(
        path, max_model_len=MAX_LEN, max_step_ms=LIMIT_S * 1e3, max_num_seqs=8, placement="device"
    )
    default = LLM(path, max_model_len=MAX_LEN, max_num_seqs=8, placement="device")
    engines = {"limit": timed.engine, "default": default.engine}
    for mode, eng in engines.items():
        assert eng.scheduler.slice_layers == LAYERS
        eng.scheduler.step_time = FAKES[mode]
    yield unchunked, engines, {}
    for llm in (timed, default, unchunked):
        llm.close()


@pytest.mark.parametrize("mode", list(FAKES))
@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    st.lists(st.tuples(stream, st.integers(0, 5)), min_size=1, max_size=4),
    st.lists(st.tuples(long_prompt, st.integers(0, 12)), min_size=1, max_size=3),
)
def test_slices_stay_within_the_limit_and_outputs_match(engines, mode, streams, prompts):
    eng, fake = engines[1][mode], FAKES[mode]
    reqs = [(p, m, at) for (p, m), at in streams + prompts]
    schedule = eng.scheduler.schedule

    def checked_schedule():
        out = schedule()
        sliced = [s for s in out.scheduled if s.layers is not None]
        assert len(sliced) <= 1  # one slice a step
        if sliced:
            batch = [s for s in out.scheduled if s.layers is None]
            shape = shape_of(batch)
            assert not shape.chunks  # never beside an ordinary chunk
            (s,) = sliced
            a, b = s.layers
            assert 0 <= a < b <= LAYERS
            cost = (b - a) * fake.layer_time(s.num_new_tokens, s.request.num_computed_tokens)
            step = fake.predict(shape) + cost
            if mode == "limit" and shape.decodes and b - a > 1:  # beyond the one layer it must
                assert step <= max(LIMIT_S, fake.predict(shape) / 0.75)
            if mode == "default":
                assert s.allowance_s is not None
                if shape.decodes and b < LAYERS:  # not the rest at once: efficient
                    assert step + s.request.prefill_debt_s <= s.allowance_s * (1 + 1e-9)
        return out

    eng.scheduler.schedule = checked_schedule
    tag = f"s{next(_RUNS)}-"
    try:
        finished = run(eng, reqs, tag)
    finally:
        del eng.scheduler.schedule
        for rid in list(eng.parents):
            eng.abort_request(rid)
    assert set(finished) == {f"{tag}{i}" for i in range(len(reqs))}
    for rid, tokens in finished.items():
        prompt, max_tokens, _ = reqs[int(rid.removeprefix(tag))]
        assert tokens == reference(engines[0], engines[2], prompt, max_tokens), rid


@pytest.mark.parametrize("mode", list(FAKES))
def test_the_examples_did_slice(engines, mode):
    """Runs after the property test of this module: chunks really ran over several steps."""
    eng = engines[1][mode]
    if eng.stats().steps == 0:
        pytest.skip("only meaningful after the property test of this module")
    assert eng.stats().layer_slices == eng.scheduler.slices_started > 5
    assert eng.stats().step_kinds["mixed"].chunk_tokens.count > 5


def test_a_slice_survives_an_abort_and_a_failed_slice_frees_its_blocks(engines):
    eng = engines[1]["limit"]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng.submit(NewRequest("stream", [5, 6, 7], params))
    for _ in range(3):
        eng.step()
    eng.submit(NewRequest("long", list(range(1, 121)), SamplingParams(max_tokens=2)))
    for _ in range(30):
        eng.step()
        req = eng.scheduler.requests.get("long")
        if req is not None and req.prefill_slice is not None:
            break
    else:
        pytest.fail("the long prompt never started a slice")
    eng.check_integrity()
    assert eng.abort_request("long")
    eng.check_integrity()
    while eng.has_unfinished():
        eng.step()
    assert eng.kv.pool.num_free == eng.kv.pool.num_usable

    # A slice whose forward raises fails its request alone; its blocks come back.
    runner = eng.runner
    real = runner.forward_layers

    def broken(*args):
        raise RuntimeError("boom")

    eng.submit(NewRequest("stream2", [8, 9], params))
    for _ in range(3):
        eng.step()
    runner.forward_layers = broken
    try:
        eng.submit(NewRequest("long2", list(range(1, 121)), SamplingParams(max_tokens=2)))
        failed = []
        for _ in range(30):
            failed += [o for o in eng.step() if o.request_id == "long2" and o.finished]
            if failed:
                break
    finally:
        runner.forward_layers = real
    assert failed and failed[0].error is not None
    while eng.has_unfinished():
        eng.step()
    eng.check_integrity()
    assert eng.kv.pool.num_free == eng.kv.pool.num_usable


def test_a_sliced_request_swapped_out_resumes_from_its_computed_blocks(tiny_model, engines):
    path = tiny_model("deepseek-v3", lm_head_scale=8.0)
    llm = LLM(
        path,
        max_model_len=MAX_LEN,
        max_step_ms=LIMIT_S * 1e3,
        placement="device",
        preemption_mode="swap",
        block_size=4,
    )
    eng = llm.engine
    eng.scheduler.step_time = FAKES["limit"]
    stream = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eng.submit(NewRequest("stream", [5, 6, 7], stream))
    for _ in range(3):
        eng.step()
    prompt = list(range(1, 201))
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.submit(NewRequest("long", prompt, greedy))
    sched = eng.scheduler
    for _ in range(60):
        eng.step()
        req = sched.requests.get("long")
        if req is not None and req.prefill_slice is not None and req.num_computed_tokens > 0:
            break
    else:
        pytest.fail("no slice after a computed chunk")
    computed = req.num_computed_tokens
    assert len(eng.kv.block_ids("long")) * 4 >= computed + req.prefill_slice.tokens
    sched._preempt(req, SchedulerOutput())  # as the scheduler does when blocks run out
    assert req.prefill_slice is None and req.num_computed_tokens == computed
    saved = eng.swap._held["long"][0][0].shape[0]
    assert saved == -(-computed // 4)  # its computed tokens' blocks, not the slice's
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        eng.check_integrity()
    ref = reference(engines[0], engines[2], tuple(prompt), 3)
    assert out["long"] == ref
    llm.close()


def test_budget_slices_only_when_they_advance_the_prompt_further():
    fake = FakeStepTime()
    budget = StepBudget(fake, LIMIT_S, 512, LAYERS)
    assert budget.slice(100, 0) is None  # no decodes: whole chunks
    for _ in range(3):
        budget.take(1, 10)
    n, k = budget.slice(200, 0)
    # Brute force: of every (chunk, layers) whose slice fits beside the decodes, the one that
    # advances the prompt furthest (tokens x layers), and more than a whole chunk would.
    slack = LIMIT_S - fake.predict(budget.shape)
    best = max(
        (c * j, c)
        for c in range(2, 201)
        for j in range(1, LAYERS)
        if j * fake.layer_time(c, 0) <= slack + 1e-12
    )
    assert (n * k, n) == best
    whole = StepBudget(fake, LIMIT_S, 512, LAYERS)
    for _ in range(3):
        whole.take(1, 10)
    assert n * k > whole.grant(200, 0) * LAYERS
    # Going on: as many layers as fit, at least one, all that are left without decodes.
    assert budget.slice_layers(n, 0, 1, 200) >= 1
    alone = StepBudget(fake, LIMIT_S, 512, LAYERS)
    assert alone.slice_layers(n, 0, 1, 200) == LAYERS - 1
    # With --max-step-ms inf (chunks by tokens alone), or without layers to slice, none.
    unlimited = float("inf")
    for b in (
        StepBudget(fake, unlimited, 512, LAYERS),
        StepBudget(fake, LIMIT_S, 512, None),
    ):
        b.take(1, 10)
        assert b.slice(200, 0) is None


def test_budget_without_a_limit_slices_for_a_shorter_step_at_the_same_efficiency():
    fake = FAKES["default"]
    budget = StepBudget(fake, None, 512, LAYERS)
    for _ in range(3):
        budget.take(1, 10)
    n, k = budget.slice(200, 0)
    assert k == 1
    decodes = fake.predict(budget.shape)
    step = decodes + fake.layer_time(n, 0)
    allowance = budget.slice_allowance(n, 0, 200, 1)
    assert step <= allowance  # efficient ...
    shorter = budget.slice_allowance(n - 1, 0, 200, 1)
    assert decodes + fake.layer_time(n - 1, 0) > shorter  # ... and the shortest that is
    chunk = StepBudget(fake, None, 512, LAYERS)
    for _ in range(3):
        chunk.take(1, 10)
    whole = chunk.grant(200, 0)
    assert step < fake.predict(chunk.shape.plus(whole, 0))  # a shorter step than the chunk's
    # Going on: the fewest layers that keep it. A debt is made up a decode step's worth at
    # most a step: by a longer chunk, or more layers.
    assert budget.slice_layers(n, 0, 1, 200) == 1
    behind = StepBudget(fake, None, 512, LAYERS)
    for _ in range(3):
        behind.take(1, 10)
    m, j = behind.slice(200, 0, debt_s=0.005)
    assert m * j > n * k
    assert behind.slice(200, 0, debt_s=1.0) == (m2 := behind.slice(200, 0, debt_s=decodes))
    assert m2 is not None and m2[0] * m2[1] >= m * j
    assert budget.slice_layers(n, 0, 1, 200, debt_s=1.0) > 1
    # A prompt's last tokens, too few for one efficient layer, get several layers a step:
    # a shorter step than their chunk through every layer.
    last = StepBudget(fake, None, 512, LAYERS)
    for _ in range(3):
        last.take(1, 10)
    piece = last.slice(40, 160)
    assert piece is not None and piece[0] <= 40 and 1 < piece[1] < LAYERS
    assert not last._efficient(40, 160, 200, 1, fake.predict(last.shape), 0.0)


class FreeLayers(FakeStepTime):
    """A model that predicts a layer of a chunk costs nothing (its chunk part fitted to 0)."""

    def layer_time(self, tokens: int, computed: int) -> float | None:
        return 0.0


def test_a_layer_predicted_free_never_divides_by_zero():
    for limit in (LIMIT_S, None):
        budget = StepBudget(FreeLayers(), limit, 512, LAYERS)
        budget.take(1, 10)
        piece = budget.slice(200, 0)
        assert piece is None or 0 < piece[1] < LAYERS
        assert budget.slice_layers(50, 0, 1, 200) == LAYERS - 1


class CheapSlices(FakeStepTime):
    """A fit whose whole chunks cost twice what measured slices say (layer_time is the
    slices' scaled cost): it over-predicts the prompt's time alone."""

    def predict(self, shape: StepShape) -> float:
        return self.step_s + self.token_s * shape.decodes + 2 * self.token_s * shape.chunk_tokens


def test_a_prompts_time_alone_is_never_above_its_cost_as_slices():
    fake = CheapSlices(1e-4, 1e-3)
    budget = StepBudget(fake, None, 512, LAYERS)
    for _ in range(3):
        budget.take(1, 10)
    for n, computed in ((50, 0), (200, 0), (100, 300)):
        share = fake.predict(StepShape().plus(512, 0)) * n / 512
        assert share > LAYERS * fake.layer_time(n, computed)
        assert budget._alone(n, computed, 512) == pytest.approx(
            LAYERS * fake.layer_time(n, computed)
        )
    # Where the fit's share is the cheaper, it stands.
    honest = FakeStepTime(1e-4, 1e-3)
    b = StepBudget(honest, None, 512, LAYERS)
    share = honest.predict(StepShape().plus(512, 0)) * 100 / 512
    assert share < LAYERS * honest.layer_time(100, 0)
    assert b._alone(100, 0, 512) == pytest.approx(share)
    # Efficiency is then judged against the slices' cost: the chosen slice's layers are at
    # least EFFICIENCY of its step, which an over-predicted share alone would have let a
    # shorter slice pass.
    n, k = budget.slice(400, 0)
    decodes = fake.predict(budget.shape)
    part = k * fake.layer_time(n, 0)
    assert part >= EFFICIENCY * (decodes + part) * (1 - 1e-9)
    assert budget.slice_allowance(n, 0, 400, k) == pytest.approx(part / EFFICIENCY)


class DearSlices(FakeStepTime):
    """A fit whose measured slices cost twice a whole chunk's share: no number of layers
    keeps the prompt's efficiency against its time alone."""

    def layer_time(self, tokens: int, computed: int) -> float | None:
        t = super().layer_time(tokens, computed)
        return None if t is None else 2 * t


def test_a_slice_no_layer_count_keeps_efficient_runs_a_steps_share_not_all_its_layers():
    fake = DearSlices(1e-4, 1e-3)
    budget = StepBudget(fake, None, 512, LAYERS)
    for _ in range(3):
        budget.take(1, 10)
    decodes = fake.predict(budget.shape)
    n, left = 50, LAYERS - 1
    assert not any(budget._efficient(n, 0, 512, k, decodes, 0.0) for k in range(1, left + 1))
    k = budget.slice_layers(n, 0, 1, 512)
    layer = fake.layer_time(n, 0)
    # Brute force: the fewest layers whose time is EFFICIENCY of the step beside the decodes
    # (before: all that were left, one step as long as the rest of the prompt's layers).
    want = min(j for j in range(1, left + 1) if j * layer >= EFFICIENCY * (decodes + j * layer)
               or j == left)  # fmt: skip
    assert k == want and 1 <= k < left
    # A debt (at most the decodes' time) asks for more layers; never more than are left.
    assert k < budget.slice_layers(n, 0, 1, 512, debt_s=1.0) <= left
