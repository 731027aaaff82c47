"""Speculative decoding (ngram drafts): the output is decoding's, token for token, greedy and
seeded sampling alike (penalties, logprobs, n > 1), wherever a stop, a stop string, max_tokens
or a small token budget cuts a step's drafts; grammar rows are not drafted; drafts do happen
and hold; a model with linear-attention state is refused."""

import itertools
import json

import pytest
import torch

from hetserve.config import EngineConfig
from hetserve.core.grammar import GrammarKind, GrammarSpec
from hetserve.core.request import NewRequest
from hetserve.core.sampling import SamplingParams
from hetserve.engine.core import EngineCore
from hetserve.engine.speculative import draft_rows, verify
from hetserve.errors import InvalidInputError
from hetserve.layers.sampler import SamplingRow, sample

# every draft found is checked (adaptive drafting would check few on a tiny model, whose
# steps cost their overhead): the mechanism under test is the check
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
PROMPTS = ["hello the model " * 6, "a b c d e f a b c d e f a b c", "one two three", "x"]


def make(model: str, **options) -> EngineCore:
    # fp32 K/V: a 16-bit cache rounds a token's own K/V on one path and not on another, which
    # can flip a near-tie (as chunk sizes can); in fp32 both paths give the same bits
    return EngineCore(EngineConfig.from_options(model=model, max_model_len=512,
                                                kv_cache_dtype="float32", **options))  # fmt: skip


@pytest.fixture(scope="module")
def engines(tiny_model):
    model = str(tiny_model("qwen3-moe"))
    return make(model), make(model, speculative_config=SPEC)


def run(engine: EngineCore, prompts, params, grammar=None, loras=None) -> list:
    """One batch: a prompt per request, one SamplingParams for all or one each (and an
    adapter name or None each)."""
    tok = engine.tokenizer
    each = params if isinstance(params, list) else [params] * len(prompts)
    adapters = loras or [None] * len(prompts)
    rows = zip(prompts, each, adapters, strict=True)
    news = [NewRequest(f"r{i}-{id(p)}", tok.encode(text), p, grammar=grammar, lora=lora)
            for i, (text, p, lora) in enumerate(rows)]  # fmt: skip
    for new in news:
        engine.submit(new)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
    return [done[n.request_id] for n in news]


def same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        for p, q in zip(x.outputs, y.outputs, strict=True):
            assert p.token_ids == q.token_ids
            assert p.text == q.text
            assert (p.finish_reason, p.stop_reason) == (q.finish_reason, q.stop_reason)
            if p.logprobs is not None or q.logprobs is not None:
                assert len(p.logprobs) == len(q.logprobs) == len(p.token_ids)
                for u, v in zip(p.logprobs, q.logprobs, strict=True):
                    assert u.keys() == v.keys()
                    for t in u:
                        assert u[t].rank == v[t].rank
                        assert u[t].logprob == pytest.approx(v[t].logprob, abs=1e-4)


PARAMS = [
    SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=5, max_tokens=60, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=7, max_tokens=40, presence_penalty=0.6,
                   frequency_penalty=0.3, repetition_penalty=1.2, logprobs=3),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=3, n=2, max_tokens=40),
    SamplingParams(temperature=0, max_tokens=50, min_tokens=20, logprobs=1),
]  # fmt: skip


@pytest.mark.parametrize("i", range(len(PARAMS)))
def test_drafted_output_is_decodings(engines, i):
    base, spec = engines
    before = spec.stats()
    same(run(spec, PROMPTS, PARAMS[i]), run(base, PROMPTS, PARAMS[i]))
    after = spec.stats()
    assert after.spec_draft_tokens > before.spec_draft_tokens  # drafts were checked
    if i in (0, 4):  # greedy: a random model's loops make drafts that hold
        assert after.spec_accepted_tokens > before.spec_accepted_tokens


def test_stops_inside_a_steps_drafts_end_where_decoding_ends(engines):
    base, spec = engines
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    (ref,) = run(base, PROMPTS[1:2], greedy)
    ids = ref.outputs[0].token_ids
    cuts = []
    for at in range(3, 50, 4):
        # a stop token, a stop string and max_tokens ending at `at`, whatever a step drafted
        cuts += [SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[ids[at]]),
                 SamplingParams(temperature=0, max_tokens=at, ignore_eos=True)]  # fmt: skip
        text = base.tokenizer.decode(ids[: at + 1])
        if text.strip():
            cuts.append(SamplingParams(temperature=0, max_tokens=60, stop=[text[-3:]],
                                       ignore_eos=True))  # fmt: skip
    prompts = PROMPTS[1:2] * len(cuts)
    outs = run(spec, prompts, cuts)
    same(outs, run(base, prompts, cuts))
    assert len({len(o.outputs[0].token_ids) for o in outs}) > 8  # cut in many places


def test_a_small_token_budget_cuts_drafts(tiny_model):
    model = str(tiny_model("qwen3-moe"))
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tight = make(model, speculative_config=SPEC, max_num_batched_tokens=6)
    # the same budget without drafts: prompts chunked alike
    same(run(tight, PROMPTS, greedy), run(make(model, max_num_batched_tokens=6), PROMPTS, greedy))
    assert tight.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("options", [
    {},  # the default 16-bit KV cache, many sequences: steps past the fused step's rows
    {"max_deferred_experts_per_token": 1},  # expert deferral at decode (top-4 experts)
])  # fmt: skip
def test_drafted_tokens_are_computed_as_decodes(tiny_model, options):
    """A drafted row's tokens attend as decode rows and run the decode phase, so the numbers
    are decoding's: equal outputs with a 16-bit cache across 12 sequences (steps of more rows
    than the fused step takes), and with expert deferral, which only decodes apply."""
    model = str(tiny_model("qwen3-moe", overrides={"num_experts_per_tok": 4}))
    greedy = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompts = [f"{w} " * (3 + i % 5) + "the model" for i, w in enumerate("abcdefghijkl")]

    def engine(**more):
        return EngineCore(EngineConfig.from_options(model=model, max_model_len=512, **options,
                                                    **more))  # fmt: skip

    spec = engine(speculative_config=SPEC)
    same(run(spec, prompts, greedy), run(engine(), prompts, greedy))
    assert spec.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3"])
def test_lora_rows_drafted_equal_decoding(tiny_model, tmp_path, family):
    """Adapters and the base in one batch: a drafted row's tokens take their adapter's slot
    as decode rows (one slot entry per row; MLA expands each decode row's cached rows with
    its own adapter)."""
    from hetserve.testing.tiny_lora import write_random_adapter

    model = str(tiny_model(family))
    adapter = str(write_random_adapter(model, tmp_path / "a", match=r"self_attn", std=0.5))
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engines = [make(model, lora_modules={"a": adapter}, **more)
               for more in ({"speculative_config": SPEC}, {})]  # fmt: skip
    same(*(run(eng, PROMPTS, greedy, loras=["a", None, "a", None]) for eng in engines))
    assert engines[0].stats().spec_accepted_tokens > 0


def test_a_step_limit_no_draft_fits_decodes_one_token(tiny_model):
    model = str(tiny_model("qwen3-moe"))
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    limited = make(model, speculative_config=SPEC, max_step_ms=0.001)  # below any prediction
    same(run(limited, PROMPTS, greedy), run(make(model), PROMPTS, greedy))
    assert limited.stats().spec_draft_tokens == 0


def test_adaptive_drafting_follows_the_costs(tiny_model):
    model = str(tiny_model("qwen3-moe"))
    eng = make(model, speculative_config={**SPEC, "adaptive": True})
    costs = eng.drafter.costs
    assert costs is not None and len(costs) == 5 and costs[0] == 1.0
    assert all(b >= a for a, b in itertools.pairwise(costs))  # measured at start, monotone
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ref = run(make(model), PROMPTS, greedy)
    eng.drafter.costs = [1.0] * 5  # free drafts: it checks what it finds
    same(run(eng, PROMPTS, greedy), ref)
    free = eng.stats()
    assert free.spec_draft_tokens > free.spec_drafts > 0
    eng.drafter.costs = [1.0, 50.0, 60.0, 70.0, 80.0]  # no drafts could pay: none checked
    same(run(eng, PROMPTS, greedy), ref)
    assert eng.stats().spec_drafts == free.spec_drafts
    eng.step()  # a step with nothing to run
    assert eng.drafter.records == {}  # finished sequences leave no record behind


def test_grammar_rows_are_not_drafted(engines):
    base, spec = engines
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}},
              "required": ["a"], "additionalProperties": False}  # fmt: skip
    grammar = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    p = SamplingParams(temperature=0, max_tokens=60)
    before = spec.stats().spec_drafts
    outs = run(spec, PROMPTS[:2], p, grammar)
    assert spec.stats().spec_drafts == before
    same(outs, run(base, PROMPTS[:2], p, grammar))
    assert all(json.loads(o.outputs[0].text) for o in outs)


def test_verify_draws_as_decoding_does():
    """Position by position from the same generator: the tokens and the generator's state
    after them equal those of drawing one token at a time; draws stop at the first miss."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    params = SamplingParams(temperature=0.8, seed=1)

    def row(gen):
        return SamplingRow(params, gen, [1, 2], [3])

    one = torch.Generator().manual_seed(11)
    decoded = [sample(logits[j : j + 1].clone(), [row(one)])[0][0] for j in range(5)]
    for held in range(5):  # drafts equal to decoding's first `held` tokens, then a miss
        drafts = decoded[:held] + [(decoded[held] + 1) % 50] * (4 - held)
        drafts = drafts[:4]
        gen = torch.Generator().manual_seed(11)
        v = verify(logits.clone(), draft_rows(row(gen), drafts), drafts, {})
        want = decoded[: held + 1] if held < 4 else decoded
        assert v.tokens == want and v.error is None
        ref = torch.Generator().manual_seed(11)
        for j in range(len(want)):
            sample(logits[j : j + 1].clone(), [row(ref)])
        assert torch.equal(gen.get_state(), ref.get_state())
    rows = draft_rows(row(None), [7, 8])
    assert [r.output_token_ids for r in rows] == [[3], [3, 7], [3, 7, 8]]


def test_metrics_and_config(engines):
    s = engines[1].stats()
    assert 0 < s.spec_acceptance_rate <= 1
    assert s.spec_accepted_tokens <= s.spec_draft_tokens
    with pytest.raises(InvalidInputError, match="num_speculative_tokens must be 1..16"):
        EngineConfig.from_options(speculative_config={"num_speculative_tokens": 0})
    with pytest.raises(InvalidInputError, match="not supported"):
        EngineConfig.from_options(speculative_config='{"method": "eagle"}')
    with pytest.raises(InvalidInputError, match="unknown key"):
        EngineConfig.from_options(speculative_config={"prompt_lookup": 3})
    assert EngineConfig.from_options(speculative_config="{}").speculative is None


def test_a_linear_attention_model_is_refused(tiny_model):
    with pytest.raises(InvalidInputError, match="linear-attention"):
        make(str(tiny_model("qwen3-next")), speculative_config=SPEC)
