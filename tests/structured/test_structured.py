"""Structured output in the engine: a random model under a grammar returns what the grammar
allows; grammar rows and plain rows in one batch get what they get alone; a grammar that does
not compile is refused at validation naming its field, and compiled once per content."""

import json

import jsonschema_rs
import pytest

from hetserve.config import EngineConfig
from hetserve.core.grammar import GrammarKind, GrammarSpec
from hetserve.core.request import NewRequest
from hetserve.core.sampling import SamplingParams
from hetserve.engine.core import EngineCore
from hetserve.errors import InvalidInputError
from hetserve.testing.schemas import schema_set


@pytest.fixture(scope="module")
def engine(tiny_model):
    return EngineCore(
        EngineConfig(model=str(tiny_model("qwen3-moe", lm_head_scale=4.0)), max_model_len=1024)
    )


def run(engine: EngineCore, requests: list[NewRequest]) -> dict[str, object]:
    for new in requests:
        engine.submit(new)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
    return done


def schema_spec(schema: dict) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))


def test_random_model_output_validates_against_50_schemas(engine):
    schemas = schema_set(50)
    prompt = engine.tokenizer.encode("hello the model")
    reqs = [
        NewRequest(
            f"s{i}",
            prompt,
            SamplingParams(max_tokens=400, temperature=1.0, seed=i),
            grammar=schema_spec(s),
        )
        for i, s in enumerate(schemas)
    ]
    outs = run(engine, reqs)
    for i, schema in enumerate(schemas):
        out = outs[f"s{i}"]
        assert out.finish_reason == "stop", (i, out.text)
        doc = json.loads(out.text)
        jsonschema_rs.validate(schema, doc)  # raises with the path of what is wrong


@pytest.mark.parametrize(
    "spec,check",
    [
        (GrammarSpec(GrammarKind.REGEX, r"[0-9]{3}-[a-z]{2}"), r"^[0-9]{3}-[a-z]{2}$"),
        (GrammarSpec(GrammarKind.CHOICE, json.dumps(["yes", "no way"])), r"^(yes|no way)$"),
        (GrammarSpec(GrammarKind.LARK, 'start: "a" B\nB: /[xy]{2}/\n'), r"^a[xy]{2}$"),
        (GrammarSpec(GrammarKind.LARK, 'root ::= "n" [0-9] [0-9]'), r"^n[0-9]{2}$"),  # GBNF
        (GrammarSpec(GrammarKind.JSON_OBJECT, ""), r"^\{.*\}$"),
    ],
)
def test_each_grammar_kind_constrains_a_random_model(engine, spec, check):
    import re

    prompt = engine.tokenizer.encode("hello")
    outs = run(
        engine, [NewRequest("k", prompt, SamplingParams(max_tokens=300, seed=5), grammar=spec)]
    )
    text = outs["k"].text
    assert re.match(check, text, re.S), text
    if spec.kind is GrammarKind.JSON_OBJECT:
        assert isinstance(json.loads(text), dict)


def test_grammar_and_plain_rows_in_one_batch_match_their_solo_runs(engine):
    prompt = engine.tokenizer.encode("hello the")
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    }

    def reqs(tag: str) -> list[NewRequest]:
        return [
            NewRequest(
                f"g{tag}",
                prompt,
                SamplingParams(max_tokens=30, seed=7),
                grammar=schema_spec(schema),
            ),
            NewRequest(f"p{tag}", prompt, SamplingParams(max_tokens=30, seed=8, ignore_eos=True)),
            NewRequest(
                f"q{tag}", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
            ),
        ]

    batch = run(engine, reqs("b"))
    solo = {}
    for new in reqs("s"):
        solo.update(run(engine, [new]))
    for kind in "gpq":
        assert batch[f"{kind}b"].token_ids == solo[f"{kind}s"].token_ids, kind
    json.loads(batch["gb"].text)


def test_unmasked_rows_differ_from_masked_ones(engine):
    """The mask really reaches the sampler: without it the same seed writes no JSON."""
    prompt = engine.tokenizer.encode("hello the")
    spec = GrammarSpec(GrammarKind.CHOICE, json.dumps(["yes", "no"]))
    outs = run(
        engine,
        [
            NewRequest("m", prompt, SamplingParams(max_tokens=8, seed=3), grammar=spec),
            NewRequest("u", prompt, SamplingParams(max_tokens=8, seed=3, ignore_eos=True)),
        ],
    )
    assert outs["m"].text in ("yes", "no")
    assert outs["u"].text not in ("yes", "no")


@pytest.mark.parametrize(
    "spec,text",
    [
        (
            GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "strnig"}', param="response_format.x"),
            "cannot be compiled",
        ),
        (GrammarSpec(GrammarKind.JSON_SCHEMA, "[1]", param="guided_json"), "must be an object"),
        (
            GrammarSpec(GrammarKind.REGEX, "(ab", param="guided_regex"),
            "cannot be compiled: .*regex parse error: unclosed group$",
        ),
        (
            GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "string", "pattern": "(a"}'),
            "cannot be compiled: regex parse error: unclosed group$",
        ),
        (
            GrammarSpec(GrammarKind.LARK, "start: undefined_rule", param="guided_grammar"),
            "cannot be compiled",
        ),
        (GrammarSpec(GrammarKind.CHOICE, "[]", param="guided_choice"), "non-empty list"),
    ],
)
def test_grammar_that_does_not_compile_is_refused_naming_its_field(engine, spec, text):
    new = NewRequest("bad", engine.tokenizer.encode("x"), SamplingParams(), grammar=spec)
    with pytest.raises(InvalidInputError, match=text) as err:
        engine.validate(new)
    assert err.value.param == spec.param
    assert not engine.has_unfinished()


def test_strict_refuses_what_lenient_ignores(engine):
    schema = json.dumps({"type": "object", "dependentRequired": {"a": ["b"]}})
    for strict in (True, False):
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=strict)
        new = NewRequest("st", [5], SamplingParams(), grammar=spec)
        if strict:
            with pytest.raises(InvalidInputError):
                engine.validate(new)
        else:
            engine.validate(new)


def test_compiled_once_per_content(engine):
    spec = GrammarSpec(GrammarKind.REGEX, "z{1,4}q", param="a")
    before = engine.grammars.compiles
    for param in ("a", "b", "c"):  # the field it came from is not part of its identity
        engine.validate(
            NewRequest(
                "c",
                [5],
                SamplingParams(),
                grammar=GrammarSpec(GrammarKind.REGEX, "z{1,4}q", param=param),
            )
        )
    outs = run(engine, [NewRequest("c1", [5], SamplingParams(max_tokens=8), grammar=spec)])
    assert engine.grammars.compiles == before + 1
    assert outs["c1"].text.startswith("z") and outs["c1"].text.endswith("q")


@pytest.mark.parametrize("extra", [{"min_tokens": 12}, {"ignore_eos": True}])
def test_a_complete_grammar_ends_the_output(engine, extra):
    """min_tokens and ignore_eos cannot hold the output open once its grammar is complete:
    the grammar allows only its end, which was drawn again and again until max_tokens."""
    prompt = engine.tokenizer.encode("hello the")
    spec = GrammarSpec(GrammarKind.CHOICE, json.dumps(["yes", "no"]))
    params = SamplingParams(max_tokens=16, seed=3, **extra)
    out = run(engine, [NewRequest("c", prompt, params, grammar=spec)])["c"]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.token_ids) <= len(engine.tokenizer.encode(out.text)) + 1
