"""The step-time model: shapes, the two-part non-negative fit, its windows and its clipping."""

import math

import pytest

from hetserve.core.least_squares import NormalEquations
from hetserve.kv.step_time import (
    CLIP,
    GROWTH,
    MIN_STEPS,
    SLICE_FOLLOW,
    WINDOW,
    StepKind,
    StepShape,
    StepTimeModel,
    chunk_pairs,
)

# A machine: 2 ms per step, 0.5 ms per decode, 1 us per decode K/V row; 50 us per prompt
# token, 20 ns per attention pair, 3 us per gathered K/V row, 2 ms per chunk, 30 ms to read
# every routed expert (64 experts, top-6).
DECODE = (0.002, 0.0005, 0.001)
CHUNK = (0.05, 0.02, 0.003, 0.002, 0.030)


def true_time(m: StepTimeModel, shape: StepShape) -> float:
    t = sum(c * x for c, x in zip(DECODE, m.decode_features(shape), strict=True))
    if shape.chunks:
        t += sum(c * x for c, x in zip(CHUNK, m.chunk_features(shape), strict=True))
    return t


def decodes(n: int, context: int) -> StepShape:
    shape = StepShape()
    for _ in range(n):
        shape = shape.plus(1, context)
    return shape


def observe_all(m: StepTimeModel, shapes) -> None:
    for s in shapes:
        m.observe(s, true_time(m, s))


def test_shape_counts_decodes_and_chunks_apart():
    assert chunk_pairs(1, 99) == 100  # a decode reads its whole context and itself
    assert chunk_pairs(4, 0) == 10  # causal: 1 + 2 + 3 + 4
    assert chunk_pairs(4, 10) == 50
    s = StepShape().plus(1, 99).plus(4, 10)
    assert (s.decodes, s.decode_context, s.chunk_tokens, s.chunk_pairs) == (1, 100, 4, 50)
    assert (s.chunk_context, s.chunks, s.tokens) == (14, 1, 5)
    assert s.kind is StepKind.MIXED
    assert decodes(3, 5).kind is StepKind.DECODE
    assert StepShape().plus(8, 0).kind is StepKind.PREFILL


def test_fit_recovers_the_machine_from_each_kind_of_step():
    m = StepTimeModel(experts=64, top_k=6)
    assert m.predict(decodes(1, 10)) is None  # nothing seen yet
    observe_all(m, [decodes(n, c) for n in (1, 3, 8) for c in (10, 500)])
    assert m.predict(StepShape().plus(64, 0)) is None  # no prompt chunk seen yet
    observe_all(m, [StepShape().plus(k, c) for k in (8, 64, 512) for c in (0, 1024)])
    observe_all(m, [decodes(3, 200).plus(k, c) for k in (4, 32) for c in (0, 2048)])
    dec, chunk = m.coef
    assert dec == pytest.approx(DECODE, rel=1e-6) and chunk == pytest.approx(CHUNK, rel=1e-6)
    # Shapes never seen: 5 decodes beside a 300-token chunk after 1,500 cached; two chunks.
    for s in (decodes(5, 700).plus(300, 1500), decodes(2, 50).plus(16, 0).plus(100, 900)):
        assert m.predict(s) == pytest.approx(true_time(m, s), rel=1e-6)
    assert m.prefill_time(100, 50) == pytest.approx(true_time(m, StepShape().plus(100, 50)))


def test_prompt_chunks_cost_more_per_token_when_few_and_deep():
    m = StepTimeModel(experts=64, top_k=6)
    observe_all(m, [decodes(n, c) for n in (1, 3, 8) for c in (10, 500)])
    observe_all(m, [StepShape().plus(k, c) for k in (8, 64, 512) for c in (0, 1024)])
    observe_all(m, [decodes(3, 200).plus(k, c) for k in (4, 32) for c in (0, 2048)])
    base = decodes(3, 200)

    def per_token(k: int, c: int) -> float:
        return (m.predict(base.plus(k, c)) - m.predict(base)) / k

    assert per_token(4, 0) > 2 * per_token(512, 0)  # the experts a few tokens add
    assert per_token(64, 3000) > per_token(64, 0)  # attention over a longer context


def test_the_decode_part_comes_from_decode_steps_alone():
    """Probe chunks timed on a quiet machine do not drag down decodes timed while serving."""
    m = StepTimeModel()
    for k in (8, 64):
        m.observe(StepShape().plus(k, 0), 0.001 * k / 8, probe=True)
    for i in range(WINDOW):
        m.observe(decodes(3, 100 + i), 0.007)  # served steps: 7 ms each
    assert m.predict(decodes(3, 120)) == pytest.approx(0.007, rel=0.02)


def test_probes_stand_in_until_real_steps_of_their_kind_arrive():
    """The probe ran on an idle engine; serving, the same decodes take 4x as long (another
    thread's turn at the interpreter). After MIN_STEPS real decodes the probe is gone, and
    no real step was clipped toward it."""
    m = StepTimeModel()
    m.observe(decodes(1, 10), 0.002, probe=True)
    m.observe(decodes(2, 10), 0.003, probe=True)
    assert m.predict(decodes(1, 10)) == pytest.approx(0.002, rel=1e-6)
    for _ in range(MIN_STEPS):
        m.observe(decodes(1, 10), 0.008)
    assert m.predict(decodes(1, 10)) == pytest.approx(0.008, rel=1e-6)


def test_decodes_of_one_width_and_drifting_speed_do_not_invent_a_context_cost():
    """Served decode steps often all have the same decodes over a narrow range of contexts
    while the machine drifts (7 -> 9 ms as another job starts): alone, they fit the drift as
    a cost per K/V row and predict steps far longer at longer contexts (seen serving: the
    same three streams predicted at 16 ms after 100 steps, a long prompt's first decode at
    106 ms for 13 ms measured). The probe's decodes, scaled to the served speed, keep the
    terms the served steps cannot tell apart where the probe measured them."""
    m = StepTimeModel()
    for n, c in ((1, 128), (1, 8), (2, 136)):  # the probe: 1 ms a step, 0.5 ms a decode
        m.observe(decodes(n, c), 0.001 + 0.0005 * n + 1e-7 * c, probe=True)
    for i in range(WINDOW):
        m.observe(decodes(3, 200 + 3 * i), 0.007 + 0.002 * i / WINDOW)
    assert m.predict(decodes(3, 300)) == pytest.approx(0.008, rel=0.15)
    assert m.predict(decodes(3, 600)) < 0.011  # not extrapolated from the drift
    assert m.predict(decodes(4, 3600)) < 0.02


def test_probe_chunks_stand_in_as_slow_as_the_decodes_became():
    """Before any real chunk, a chunk is predicted from the probe's chunks, scaled by how much
    slower the real decodes run than the probe's."""
    m = StepTimeModel()
    for n in (1, 2):
        m.observe(decodes(n, 10), 0.001 * n, probe=True)
    m.observe(StepShape().plus(64, 0), 0.010, probe=True)
    for _ in range(MIN_STEPS):
        m.observe(decodes(1, 10), 0.003)  # 3x the probe
    assert m.prefill_time(64) == pytest.approx(0.030, rel=1e-6)


def test_a_term_the_steps_deny_is_zero_not_negative():
    """Steps that cost less the more decodes they have would fit a negative per-decode cost;
    the model never predicts a bigger step to be faster."""
    m = StepTimeModel()
    for n, seconds in ((1, 0.010), (4, 0.009), (16, 0.008)):
        m.observe(decodes(n, 10), seconds, probe=True)
    dec, _ = m.coef
    assert dec is not None and min(dec) >= 0
    assert m.predict(decodes(16, 10)) >= m.predict(decodes(1, 10))


def test_one_stalled_step_moves_the_prediction_by_at_most_the_clip():
    m = StepTimeModel()
    shape = decodes(2, 100)
    for _ in range(WINDOW):
        m.observe(shape, 0.010)
    m.observe(shape, 10.0)  # another process held the CPU for 10 s
    predicted = m.predict(shape)
    assert predicted is not None and predicted < 0.010 * CLIP


def test_the_model_follows_a_machine_that_got_slower():
    m = StepTimeModel()
    shape = decodes(2, 100)
    for _ in range(WINDOW):
        m.observe(shape, 0.010)
    for _ in range(2 * WINDOW):
        m.observe(shape, 0.030)  # a neighbour took half the cores
    assert m.predict(shape) == pytest.approx(0.030, rel=0.01)


def test_a_long_run_of_decodes_keeps_what_prefills_taught():
    m = StepTimeModel(experts=64, top_k=6)
    observe_all(m, [StepShape().plus(k, c) for k in (16, 256, 2048) for c in (0, 2048)])
    observe_all(m, [decodes(3, 100).plus(k, c) for k in (8, 64) for c in (0, 1024)])
    observe_all(m, [decodes(1 + i % 8, 100 + i % 500) for i in range(50 * WINDOW)])
    s = StepShape().plus(1024, 512)
    assert m.predict(s) == pytest.approx(true_time(m, s), rel=1e-3)


def test_the_overhead_around_each_batch_is_added_and_bounded():
    m = StepTimeModel()
    m.observe(decodes(1, 10), 0.004, probe=True)
    for _ in range(40):
        m.observe_overhead(0.002)
    assert m.predict(decodes(1, 10)) == pytest.approx(0.006, rel=0.01)
    m.observe_overhead(5.0)  # the server thread held the interpreter once
    assert m.overhead_s < 0.002 * CLIP


def test_running_sums_drop_observations_exactly():
    eq = NormalEquations(2)
    eq.add((1.0, 2.0), 3.0)
    eq.add((1.0, 5.0), 1.0)
    eq.add((1.0, 5.0), 1.0, sign=-1.0)
    alone = NormalEquations(2)
    alone.add((1.0, 2.0), 3.0)
    assert sum(eq.a, []) == pytest.approx(sum(alone.a, []))
    assert eq.b == pytest.approx(alone.b)


def test_describe_names_each_term():
    m = StepTimeModel(experts=8, top_k=2)
    assert m.describe() == "step time: not measured"
    m.observe(decodes(1, 8), 0.002, probe=True)
    m.observe(StepShape().plus(8, 0), 0.01, probe=True)
    assert "ms/decode" in m.describe() and "experts" in m.describe()


def test_a_chunk_has_a_fixed_cost_however_few_its_tokens():
    """Seen serving the demo model: an 8-token chunk beside three decodes cost ~3.5 ms more
    than the decodes, the time of ~50 of its tokens in a long chunk. Without a term per chunk
    the fit charges that to every token, and long chunks are predicted far too slow."""
    m = StepTimeModel(experts=64, top_k=6)
    observe_all(m, [decodes(n, c) for n in (1, 3, 8) for c in (10, 500)])
    observe_all(m, [decodes(3, 200).plus(k, c) for k in (8, 16, 64) for c in (0, 300)])
    observe_all(m, [StepShape().plus(k, 0) for k in (8, 64)])
    dec, chunk = m.coef
    assert chunk is not None and chunk[3] == pytest.approx(CHUNK[3], rel=1e-6)
    long = decodes(3, 200).plus(1024, 0)  # 16x the longest chunk seen
    assert m.predict(long) == pytest.approx(true_time(m, long), rel=1e-6)


def test_chunks_beside_decodes_grow_from_the_latest_seen():
    m = StepTimeModel(experts=64, top_k=6)
    assert m.max_chunk() is None  # no chunk seen: nothing to bound by
    m.observe(StepShape().plus(64, 0), 0.01, probe=True)
    assert m.max_chunk() == math.ceil(GROWTH * 64)  # before any mixed step: the probe's
    observe_all(m, [decodes(3, 100) for _ in range(MIN_STEPS)])
    observe_all(m, [decodes(3, 100).plus(100, 0)])
    assert m.max_chunk() == math.ceil(GROWTH * 100)  # a served step taught a longer one
    # Deep in a prompt the chunks shrink: the bound follows the latest MIN_STEPS of them.
    observe_all(m, [decodes(3, 100).plus(40, 2000 + 40 * i) for i in range(MIN_STEPS)])
    assert m.max_chunk() == math.ceil(GROWTH * 40)


def test_probe_chunks_after_a_long_context_keep_gathered_rows_apart_from_pairs():
    """Served chunks of one size deep in a prompt grow their attention pairs and their
    gathered rows together, so alone they cannot tell the two costs apart, and a prompt's
    whole chunk alone (many pairs, few gathered rows) is mispredicted. The start-up probe's
    chunks (after a short and a long context) stay in the fit and keep them apart; the
    served steps run 1.5x slower than the probe, as the decodes say, and the served prompts
    alone were short ones (streams' 64-token prompts)."""
    m = StepTimeModel(64, 6)
    probe = [decodes(1, 128), decodes(1, 8), decodes(2, 136)]
    probe += [StepShape().plus(64, 0), StepShape().plus(64, 64), StepShape().plus(8, 0)]
    probe += [decodes(1, 128).plus(8, 0), StepShape().plus(8, 1024), StepShape().plus(64, 1024)]
    for shape in probe:
        m.observe(shape, true_time(m, shape), probe=True)
    for _ in range(MIN_STEPS):
        m.observe(StepShape().plus(64, 0), 1.5 * true_time(m, StepShape().plus(64, 0)))
    for i, c in enumerate(range(64, 64 + 60 * WINDOW, 60)):
        served = decodes(3, 200 + i).plus(60, c)
        m.observe(served, 1.5 * true_time(m, served) * (1.03 if i % 2 else 0.97))
        m.observe(decodes(3, 200 + i), 1.5 * true_time(m, decodes(3, 200 + i)))
    for whole in (StepShape().plus(2048, 0), StepShape().plus(2048, 2048)):
        assert m.predict(whole) == pytest.approx(1.5 * true_time(m, whole), rel=0.15)


def test_a_layer_slice_costs_the_chunk_part_over_the_layers_scaled_by_what_slices_took():
    m = StepTimeModel(experts=64, top_k=6, layers=8)
    assert m.layer_time(100, 0) is None  # no chunk seen yet
    observe_all(m, [decodes(n, c) for n in (1, 3, 8) for c in (10, 500)])
    observe_all(m, [StepShape().plus(k, c) for k in (8, 64, 512) for c in (0, 1024)])
    observe_all(m, [decodes(3, 200).plus(k, c) for k in (4, 32) for c in (0, 2048)])
    chunk = StepShape().plus(100, 300)
    part = sum(c * x for c, x in zip(CHUNK, m.chunk_features(chunk), strict=True))
    assert m.layer_time(100, 300) == pytest.approx(part / 8, rel=1e-6)  # no step costs
    # Slices twice as slow as predicted: each moves the scale by at most the clip's share.
    one = m.layer_time(100, 300)
    m.observe_slice(100, 300, 2, 4 * one)
    assert m.slice_scale == pytest.approx(0.8 + 0.2 * CLIP)
    for _ in range(40):
        m.observe_slice(100, 300, 2, 4 * one)
    assert m.slice_scale == pytest.approx(2.0, rel=1e-3)
    assert m.layer_time(100, 300) == pytest.approx(2 * one, rel=1e-3)
    # A slice faster than predicted moves the scale halfway there at once (no stall makes a
    # step faster), however far, to a quarter of the prediction at most.
    m.observe_slice(100, 300, 2, 2 * 2 * one * 0.5)
    assert m.slice_scale == pytest.approx(2.0 * (1 - SLICE_FOLLOW * 0.5), rel=1e-3)
    for _ in range(16):
        m.observe_slice(100, 300, 2, 2 * one * 0.4)
    assert m.slice_scale == pytest.approx(0.4, rel=1e-3)
    scale = m.slice_scale
    m.observe_slice(100, 300, 1, 1e-9)
    assert m.slice_scale == pytest.approx(scale * (1 - SLICE_FOLLOW * 0.75))
    before = m.slice_scale
    for bad in (0.0, -1.0, float("nan")):  # a slice that ran is never an error, nor a change
        m.observe_slice(100, 300, 2, bad)
    m.observe_slice(100, 300, 0, 1.0)
    assert m.slice_scale == before
