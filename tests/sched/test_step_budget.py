"""The step budget (pure policy): prompt chunks sized by the predicted time of the step."""

import pytest

from hetserve.kv.step_time import StepShape
from hetserve.sched.step_budget import (
    EFFICIENCY,
    FLOOR_SHARE,
    MIN_CHUNK,
    SLO_SHARE,
    StepBudget,
    step_limit_s,
)


class Linear:
    """A fake step time: 10 ms per step, 1 ms per token, 1 us per attention pair."""

    def predict(self, shape: StepShape) -> float:
        return 0.010 + 0.001 * shape.tokens + 1e-6 * (shape.chunk_pairs + shape.decode_context)

    def max_chunk(self) -> int | None:
        return None


def with_decodes(budget: StepBudget, n: int, context: int = 100) -> StepBudget:
    for _ in range(n):
        assert budget.grant(1, context) == 1
        budget.take(1, context)
    return budget


def test_without_decodes_a_prompt_takes_whole_chunks():
    b = StepBudget(Linear(), 0.020, tokens=2048)
    assert b.grant(5000, 0) == 2048  # the token budget bounds it, time does not
    b = StepBudget(Linear(), 0.020, tokens=2048)
    assert b.grant(300, 0) == 300


def test_beside_decodes_a_chunk_fills_the_step_limit_and_no_more():
    model = Linear()
    b = with_decodes(StepBudget(model, 0.100, tokens=2048), 3)
    n = b.grant(5000, 1000)
    assert model.predict(b.shape.plus(n, 1000)) <= 0.100
    assert model.predict(b.shape.plus(n + 1, 1000)) > 0.100
    b.take(n, 1000)
    m = b.grant(5000, 1000)  # a second prompt gets what is left, if anything
    assert m < n and model.predict(b.shape.plus(m, 1000)) <= 0.100
    assert b.grant(1, 50) == 1  # a decode never waits


def test_later_chunks_of_a_long_prompt_are_smaller():
    """Attention is quadratic: the same time buys fewer tokens deep into a prompt."""
    early = with_decodes(StepBudget(Linear(), 0.100, tokens=2048), 2).grant(5000, 0)
    late = with_decodes(StepBudget(Linear(), 0.100, tokens=2048), 2).grant(5000, 3000)
    assert late < early


def alone_share(model, n: int, computed: int, whole: int, total: int) -> float:
    """By brute force: the time of the prompt's chunk (of `whole` tokens) that holds tokens
    [computed, computed + n) when it runs alone, split over its tokens as the model's terms
    split it: the step's and the chunk's fixed costs evenly, each token's attention its own."""
    start = computed - computed % whole
    size = min(whole, total - start)
    chunk = model.predict(StepShape().plus(size, start))
    pairs = StepShape().plus(size, start).chunk_pairs
    fixed = chunk - 0.001 * size - 1e-6 * pairs  # Linear's per-token and per-pair terms
    return fixed * n / size + 0.001 * n + 1e-6 * StepShape().plus(n, computed).chunk_pairs


def test_by_default_the_shortest_step_that_keeps_the_prompt_efficient():
    """Without a limit the chunk is the smallest whose step, decodes included, costs at most
    1 / EFFICIENCY of what its tokens cost in the prompt's run alone."""
    model = Linear()
    for computed, total in ((0, 5000), (1000, 5000), (3000, 3500)):
        b = with_decodes(StepBudget(model, None, tokens=2048), 4)
        n = b.grant(total - computed, computed)
        share = alone_share(model, n, computed, 2048, total)
        assert share >= EFFICIENCY * model.predict(b.shape.plus(n, computed)) - 1e-12
        less = alone_share(model, n - 1, computed, 2048, total)
        assert less < EFFICIENCY * model.predict(b.shape.plus(n - 1, computed))
        assert b.until_s == model.predict(b.shape.plus(n, computed))


class Demo:
    """A fake shaped like the demo model served on two cores: a step costs 2 ms, a decode
    0.5 ms, a prompt chunk 3 ms however short, its tokens 50 us each and 20 ns per attention
    pair (so a prompt's later tokens cost more than its first)."""

    def predict(self, shape: StepShape) -> float:
        return (
            0.002
            + 0.0005 * shape.decodes
            + 0.003 * shape.chunks
            + 50e-6 * shape.chunk_tokens
            + 20e-9 * shape.chunk_pairs
        )

    def max_chunk(self) -> int | None:
        return None


@pytest.mark.parametrize("decodes", [1, 3, 16])
@pytest.mark.parametrize("prompt", [600, 3000, 7000])
def test_by_default_a_prompt_beside_decodes_keeps_its_efficiency_overall(decodes, prompt):
    """The steps a long prompt runs in beside streams take at most 1 / EFFICIENCY of its time
    alone (in chunks of the whole budget), plus its last step, which is as short as what is
    left of it. (Judged against the rest of the prompt in one chunk, the rest's attention
    counted as a cost per token: small chunks looked efficient, and this came to 1.6-2.5x.)"""
    model, whole = Demo(), 2048
    alone = sum(
        model.predict(StepShape().plus(min(whole, prompt - c), c)) for c in range(0, prompt, whole)
    )
    done, steps, last = 0, 0.0, 0.0
    while done < prompt:
        b = with_decodes(StepBudget(model, None, tokens=whole), decodes)
        n = b.grant(prompt - done, done)
        assert n > 0
        b.take(n, done)
        last = model.predict(b.shape)
        steps += last
        done += n
    assert steps - last <= alone / EFFICIENCY


def test_more_decodes_make_the_efficient_chunk_larger():
    alone = with_decodes(StepBudget(Linear(), None, tokens=2048), 1).grant(5000, 0)
    crowd = with_decodes(StepBudget(Linear(), None, tokens=2048), 40).grant(5000, 0)
    assert crowd > alone


def test_a_short_prompt_that_cannot_be_efficient_goes_whole():
    assert with_decodes(StepBudget(Linear(), None, tokens=2048), 4).grant(5, 0) == 5


def test_a_crowd_of_decodes_leaves_the_prompt_its_floor_share():
    model = Linear()
    b = with_decodes(StepBudget(model, 0.020, tokens=2048), 60)  # 60 decodes: 76 ms > 20 ms
    alone = model.predict(b.shape)
    n = b.grant(5000, 0)
    step = model.predict(b.shape.plus(n, 0))
    assert n > 1 and (step - alone) / step >= FLOOR_SHARE - 0.01
    assert (step - alone) / model.predict(b.shape.plus(n + 1, 0)) > FLOOR_SHARE - 0.01


def test_the_first_chunk_gets_its_floor_of_tokens_even_when_nothing_fits():
    class Slow(Linear):
        def predict(self, shape: StepShape) -> float:
            return 0.010 * shape.tokens if shape.tokens <= 2 else 10.0  # any prompt: 10 s

    b = with_decodes(StepBudget(Slow(), 0.050, tokens=2048), 2)
    assert b.grant(5000, 0) == MIN_CHUNK
    b.take(MIN_CHUNK, 0)
    assert b.grant(5000, 0) == 0  # a second prompt does wait
    short = with_decodes(StepBudget(Slow(), 0.050, tokens=2048), 2)
    assert short.grant(3, 0) == 3  # never more than the prompt needs


def test_no_model_or_no_prediction_falls_back_to_tokens():
    assert with_decodes(StepBudget(None, 0.001, tokens=100), 3).grant(5000, 0) == 97

    class Unknown(Linear):
        def predict(self, shape: StepShape) -> None:  # type: ignore[override]
            return None

    assert with_decodes(StepBudget(Unknown(), 0.001, tokens=100), 3).grant(5000, 0) == 97


def test_limits_from_the_flags():
    assert step_limit_s(None, None) is None
    assert step_limit_s(250.0, None) == 0.25
    assert step_limit_s(None, 100.0) == pytest.approx(SLO_SHARE * 0.1)
    assert step_limit_s(50.0, 100.0) == 0.05  # --max-step-ms wins
    b = with_decodes(StepBudget(Linear(), float("inf"), tokens=2048), 3)
    assert b.grant(5000, 0) == 2045  # inf: chunks by tokens alone


def test_beside_decodes_chunks_stay_within_what_the_model_has_seen():
    class Seen(Linear):
        def max_chunk(self) -> int | None:
            return 100  # longer chunks would be extrapolated

    b = with_decodes(StepBudget(Seen(), 10.0, tokens=2048), 2)  # the limit fits 2,000 tokens
    assert b.grant(5000, 0) == 100
    b.take(100, 0)
    assert b.grant(5000, 0) == 0  # a second prompt: the step already carries the bound
    # Without a time limit (--max-step-ms inf) chunks go by tokens alone.
    assert with_decodes(StepBudget(Seen(), float("inf"), tokens=2048), 2).grant(5000, 0) == 2046
    # Without decodes whole chunks still go: they are what teach the model longer ones.
    assert StepBudget(Seen(), 10.0, tokens=2048).grant(5000, 0) == 2048

    # The floor of tokens holds even where the bound is below it.
    class Tiny(Linear):
        def max_chunk(self) -> int | None:
            return 2

    assert with_decodes(StepBudget(Tiny(), 10.0, tokens=2048), 2).grant(5000, 0) == MIN_CHUNK


def test_the_bound_does_not_lower_the_efficient_step():
    """By default the step's limit comes from the prompt's speed in whole chunks, not in
    bounded ones: else a small bound makes small chunks look efficient, each step's chunk
    bounds the next, and chunks ratchet down to the floor (seen serving the demo model)."""

    class Seen(Linear):
        def max_chunk(self) -> int | None:
            return 16

    free = with_decodes(StepBudget(Linear(), None, tokens=2048), 40)
    bounded = with_decodes(StepBudget(Seen(), None, tokens=2048), 40)
    assert free.grant(5000, 0) > 16
    assert bounded.grant(5000, 0) == 16
    assert bounded.until_s == free.until_s


def test_a_prompt_in_debt_gets_a_larger_chunk_and_is_not_held_to_the_sizes_seen():
    """Without a step limit the chunk must also make up what the prompt's earlier steps took
    beyond their allowance (the scheduler's ledger): a larger, more efficient chunk."""
    model = Demo()
    free = with_decodes(StepBudget(model, None, tokens=2048), 3).grant(5000, 500)
    owing = with_decodes(StepBudget(model, None, tokens=2048), 3).grant(5000, 500, debt_s=0.01)
    assert owing > free

    class Seen(Demo):
        def max_chunk(self) -> int | None:
            return 16

    assert with_decodes(StepBudget(Seen(), None, tokens=2048), 3).grant(5000, 500) == 16
    lifted = with_decodes(StepBudget(Seen(), None, tokens=2048), 3).grant(5000, 500, 0.01)
    assert lifted == owing
    # A debt is made up a decode step's worth at most a step (all at once, serving the 1.7 B
    # MoE, a 207 ms debt made a 768-token chunk beside three decodes: a 2.2 s step).
    b = with_decodes(StepBudget(model, None, tokens=2048), 3)
    decodes = model.predict(b.shape)
    deep = with_decodes(StepBudget(model, None, tokens=2048), 3).grant(5000, 500, debt_s=1.0)
    assert deep == with_decodes(StepBudget(model, None, tokens=2048), 3).grant(
        5000, 500, debt_s=decodes
    )
    assert owing == deep < 2048  # 10 ms owed, a 3.5 ms decode step made up
    # Under a step limit the debt changes nothing: the limit rules.
    limited = with_decodes(StepBudget(Seen(), 0.050, tokens=2048), 3)
    assert limited.grant(5000, 500, debt_s=0.01) == 16
    assert limited.allowance(16, 500, 5500) is None


def test_the_allowance_is_the_tokens_cost_alone_over_the_efficiency():
    model = Demo()
    b = with_decodes(StepBudget(model, None, tokens=2048), 3)
    for n, computed, total in ((100, 0, 3000), (300, 2500, 3000), (2048, 0, 2048)):
        want = alone_share_demo(model, n, computed, 2048, total) / EFFICIENCY
        assert b.allowance(n, computed, total) == pytest.approx(want, rel=1e-9)
    assert StepBudget(None, None, tokens=2048).allowance(10, 0, 100) is None


def alone_share_demo(model, n: int, computed: int, whole: int, total: int) -> float:
    """Demo's alone share by hand: the chunk's fixed costs (step, chunk) split evenly over its
    tokens, each token's own cost and attention pairs."""
    start = computed - computed % whole
    size = min(whole, max(total - start, computed + n - start))
    fixed = 0.002 + 0.003
    return fixed * n / size + 50e-6 * n + 20e-9 * StepShape().plus(n, computed).chunk_pairs


class Underpredicted(Demo):
    """Demo, whose real steps beside decodes take 2 ms more than it predicts."""

    def real(self, shape: StepShape) -> float:
        return self.predict(shape) + (0.002 if shape.decodes and shape.chunks else 0.0)


@pytest.mark.parametrize("prompt", [3000, 7000])
def test_the_ledger_keeps_the_prompt_efficient_though_the_fit_underpredicts(prompt):
    """Each step judged alone would come to its prediction's efficiency but run slower; with
    the ledger (Scheduler.charge), the prompt's steps still take at most 1 / EFFICIENCY of
    its time alone, plus its last step."""
    from hetserve.core.request import Request
    from hetserve.core.sampling import SamplingParams
    from hetserve.sched.scheduler import ScheduledRequest, Scheduler

    model, whole = Underpredicted(), 2048
    alone = sum(
        model.predict(StepShape().plus(min(whole, prompt - c), c)) for c in range(0, prompt, whole)
    )
    req = Request("r", list(range(prompt)), SamplingParams(max_tokens=1))

    def run(ledger: bool) -> tuple[float, float]:
        req.prefill_debt_s = 0.0
        done, spent, last = 0, 0.0, 0.0
        while done < prompt:
            b = with_decodes(StepBudget(model, None, tokens=whole), 3)
            n = b.grant(prompt - done, done, req.prefill_debt_s)
            s = ScheduledRequest(req, n, b.allowance(n, done, prompt))
            b.take(n, done)
            last = model.real(b.shape)
            if ledger:
                Scheduler.charge([s], last)
            spent += last
            done += n
        return spent, last

    spent, last = run(ledger=True)
    assert spent - last <= alone / EFFICIENCY
    assert req.prefill_debt_s <= last
    unchecked, last = run(ledger=False)
    assert unchecked - last > alone / EFFICIENCY  # what the ledger corrects


def test_drafts_fit_a_configured_step_limit():
    """A speculative decode's drafts cost chunk tokens: with --max-step-ms they are cut to what
    the limit leaves beside what is scheduled; without one, all of them."""
    model = Linear()  # a step of 3 decodes ~13.3 ms, each draft token 1 ms more
    b = with_decodes(StepBudget(model, 0.0155, tokens=2048), 3)
    k = b.drafts_fit(100, 8)
    assert 0 < k < 8
    assert model.predict(b.shape.plus_drafts(k, 101)) <= 0.0155
    assert model.predict(b.shape.plus_drafts(k + 1, 101)) > 0.0155
    b.take_drafts(100, k)
    assert b.shape.decodes == 3 and b.shape.chunks == 0 and b.tokens == 2048 - 3 - k
    assert with_decodes(StepBudget(model, 0.0125, tokens=2048), 3).drafts_fit(100, 8) == 0
    assert StepBudget(model, None, tokens=2048).drafts_fit(100, 8) == 8
    assert StepBudget(model, float("inf"), tokens=2048).drafts_fit(100, 8) == 8


def test_nothing_joins_a_step_after_its_slice():
    """A layer slice is sized beside the decodes scheduled before it (all of a step's decodes
    run first); a one-token prompt admitted after it would take the time the slice was given
    (CI found a slice of every layer, sized without decodes, then a 1-token prompt: 6.4 ms
    against a 5 ms limit). It waits for the next step."""
    b = StepBudget(Linear(), 0.005, tokens=2048, layers=3)
    b.take_slice(100)
    assert b.grant(1, 0) == 0 and b.grant(1, 40) == 0 and b.grant(50, 0) == 0
