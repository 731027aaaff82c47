"""Predicted outputs (a request's `prediction`): drafts follow the predicted text, through an
edit (a cursor that finds its place again); the output is decoding's whatever the prediction;
drafts that hold are counted per sequence; the adaptive length sees a prediction that matches
before any draft is checked; a prediction outside the vocabulary or the context is refused."""

import pytest

from hetserve.config import SpeculativeConfig
from hetserve.core.request import NewRequest, Request
from hetserve.core.sampling import SamplingParams
from hetserve.engine.core import EngineCore
from hetserve.engine.speculative import Drafter, _Cursor
from hetserve.errors import InvalidInputError
from tests.engine.test_speculative import make  # an fp32 KV cache: both paths' bits alike

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
PROMPT = "an edit of a file: rewrite it"
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_model):
    model = str(tiny_model("qwen3-moe"))
    return make(model), make(model, speculative_config=SPEC)


def run(engine: EngineCore, params: SamplingParams, prediction=None):
    new = NewRequest(f"p{id(params)}-{len(prediction or ())}", engine.tokenizer.encode(PROMPT),
                     params, prediction=prediction)  # fmt: skip
    engine.submit(new)
    done = None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            done = out if out.finished else done
        engine.check_integrity()
    assert done is not None
    return done


def test_a_right_prediction_holds_whole(engines):
    plain, spec = engines
    want = run(plain, GREEDY).outputs[0].token_ids
    out = run(spec, GREEDY, list(want))
    c = out.outputs[0]
    assert c.token_ids == want
    assert out.prediction_tokens == len(want)
    # every draft is the output's next token: none rejected, most tokens drafted
    assert c.accepted_draft_tokens == c.draft_tokens >= len(want) // 2


@pytest.mark.parametrize("edit", ["insert", "delete", "replace"])
def test_an_edited_prediction_gives_decodings_output_and_finds_its_place(engines, edit):
    plain, spec = engines
    want = run(plain, GREEDY).outputs[0].token_ids
    junk = [t for t in range(50, 90) if t not in want][:5]
    pred = {
        "insert": want[:16] + junk + want[16:],
        "delete": want[:16] + want[22:],
        "replace": want[:16] + junk + want[21:],
    }[edit]
    c = run(spec, GREEDY, pred).outputs[0]
    assert c.token_ids == want
    # after the edit the cursor finds its place again: drafts hold on both sides of it
    assert c.accepted_draft_tokens >= 20 and c.draft_tokens > c.accepted_draft_tokens


def test_sampled_output_is_decodings_with_any_prediction(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=40, ignore_eos=True, n=2,
                            logprobs=2)  # fmt: skip
    want = run(plain, params)
    got = run(spec, params, list(want.outputs[0].token_ids))
    for p, q in zip(want.outputs, got.outputs, strict=True):
        assert p.token_ids == q.token_ids and p.text == q.text
        assert [sorted(e) for e in p.logprobs] == [sorted(e) for e in q.logprobs]
    assert got.outputs[0].accepted_draft_tokens > 0  # its own output, predicted


def test_without_speculative_decoding_a_prediction_changes_nothing(engines):
    plain, _ = engines
    want = run(plain, GREEDY).outputs[0].token_ids
    out = run(plain, GREEDY, list(reversed(want)))
    assert out.outputs[0].token_ids == want
    assert out.prediction_tokens == len(want) and out.outputs[0].draft_tokens == 0


def test_predictions_outside_the_vocabulary_or_the_context_are_refused(engines):
    plain, _ = engines
    ids = plain.tokenizer.encode(PROMPT)
    vocab = plain.validator.vocab_size
    for bad, words in (([1, vocab], "outside the vocabulary"), ([-1], "outside the vocabulary"),
                       ([1] * 513, "more than the model's context")):  # fmt: skip
        with pytest.raises(InvalidInputError, match=words) as info:
            plain.validate(NewRequest("bad", ids, GREEDY, prediction=bad))
        assert info.value.param == "prediction"


# ---- the cursor and the adaptive length, on their own ----------------------------------------
def test_cursor_moves_with_matches_and_finds_its_place_after_an_edit():
    pred = list(range(100, 140))
    cur = _Cursor(pred)
    assert cur.drafts(3) == [100, 101, 102]
    assert cur.advance([100, 101]) == (2, 2) and cur.drafts(2) == [102, 103]
    out = [100, 101, 7]  # an edit: the next token is not the prediction's
    assert cur.advance(out) == (1, 0) and cur.drafts(4) == []  # lost its place
    out += [8, 110, 111]  # two new tokens, then the prediction again from 110
    assert cur.advance(out) == (0, 0) and cur.drafts(2) == []  # 2 tokens: too few to be sure
    out += [112]
    cur.advance(out)
    assert cur.drafts(3) == [113, 114, 115]
    out += [113, 114, 115, 116]  # several tokens a step (drafts that held)
    assert cur.advance(out) == (4, 4) and cur.drafts(2) == [117, 118]


class _Seq(Request):
    """A running request whose prompt is computed (the Drafter reads only these fields)."""

    def __init__(self, rid, prediction):
        super().__init__(rid, [1, 2, 3], SamplingParams(max_tokens=100), prediction=prediction)
        self.num_computed_tokens = 3

    def emit(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.num_computed_tokens = self.num_tokens - 1


def test_the_adaptive_length_sees_a_prediction_hold_before_drafting():
    # one draft costs 1.9 steps: at the prior acceptance no length pays, and a sequence without
    # a prediction would wait out its back-off (8 steps) before trying one
    costs = [1.0, 1.9, 2.5, 3.0, 3.4]
    cfg = SpeculativeConfig(num_speculative_tokens=4)
    pred = list(range(200, 260))
    seq, other = _Seq("a", pred), _Seq("b", None)
    drafter = Drafter(cfg, 512, costs)
    first = None
    for step in range(8):
        drafter.draft([seq, other], lambda _sid: False)
        if seq.spec_token_ids and first is None:
            first = step
            assert seq.spec_token_ids == pred[step : step + len(seq.spec_token_ids)]
        assert other.spec_token_ids == []
        seq.spec_token_ids = []
        seq.emit(pred[step])  # the output follows the prediction, undrafted
        other.emit(300 + step)  # nothing to look up
    assert first is not None and first <= 3
