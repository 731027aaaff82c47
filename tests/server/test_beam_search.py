"""vLLM's `use_beam_search` on /v1/completions: the search checked against brute force on small
trees, then the server's beams against the same search run on transformers' fp32 model of the
tiny checkpoint; what it does not combine with is a 400 naming the field."""

import asyncio
import itertools
import math
import random

import httpx
import pytest
import torch

from hetserve import BeamSearchParams
from hetserve.config import EngineConfig
from hetserve.core.beam_search import Beam, score, search
from hetserve.engine.async_llm import AsyncLLM
from hetserve.errors import InvalidInputError

from .conftest import LiveServer


def tree_expand(logprob_of):
    """`expand` over a made-up model: logprob_of(tokens) -> {next token: logprob}."""

    async def expand(beams, k):
        out = []
        for tokens in beams:
            nxt = logprob_of(tuple(tokens))
            out.append(sorted(nxt.items(), key=lambda kv: -kv[1])[:k])
        return out

    return expand


def test_beam_search_finds_the_path_greedy_misses():
    # Greedy takes 1 (0.6) then at best 0.4; 2 (0.4) then 0.9 is likelier in all.
    table = {(): {1: 0.6, 2: 0.4}, (1,): {3: 0.4, 4: 0.35, 5: 0.25}, (2,): {3: 0.9, 4: 0.1}}
    expand = tree_expand(lambda t: {k: math.log(p) for k, p in table[t].items()})
    beams = asyncio.run(search(expand, [], 2, 2, frozenset(), length_penalty=0.0))
    assert [b.tokens for b in beams] == [[2, 3], [1, 3]]
    assert beams[0].cum_logprob == pytest.approx(math.log(0.36))
    greedy = asyncio.run(search(expand, [], 1, 2, frozenset(), length_penalty=0.0))
    assert greedy[0].tokens == [1, 3]


@pytest.mark.parametrize("seed", range(6))
def test_a_beam_as_wide_as_the_tree_equals_brute_force(seed):
    """With room for every path (width >= vocab ** depth) the search is exhaustive: its best
    beams are brute force's ranking of every finished or full-length path by score."""
    rng = random.Random(seed)
    vocab, depth, stop, penalty = 3, 3, 2, rng.choice([0.0, 0.5, 1.0, 2.0])
    cache = {}

    def logprob_of(tokens):
        if tokens not in cache:
            w = [rng.random() + 0.05 for _ in range(vocab)]
            cache[tokens] = {t: math.log(x / sum(w)) for t, x in enumerate(w)}
        return cache[tokens]

    prompt = [7, 7]
    beams = asyncio.run(search(tree_expand(logprob_of), prompt, vocab**depth, depth,
                               frozenset({stop}), length_penalty=penalty))  # fmt: skip
    paths = []
    for n in range(1, depth + 1):
        for tail in itertools.product(range(vocab), repeat=n):
            if stop in tail[:-1]:
                continue  # it ended at its stop token
            lp = sum(logprob_of(tuple(prompt) + tail[:i])[t] for i, t in enumerate(tail))
            ended = tail[-1] == stop
            if ended or n == depth:
                beam = Beam([*prompt, *tail], lp, "stop" if ended else "length")
                paths.append(beam)
    best = sorted(paths, key=lambda b: score(b, penalty), reverse=True)[: vocab**depth]
    assert [b.tokens for b in beams] == [b.tokens for b in best]
    for got, want in zip(beams, best, strict=True):
        assert got.cum_logprob == pytest.approx(want.cum_logprob)
        assert got.finish_reason == want.finish_reason


@pytest.fixture(scope="module")
def exact(tiny_model):
    model = tiny_model("qwen3-moe", lm_head_scale=4.0)
    engine = AsyncLLM(EngineConfig(model=str(model), max_model_len=256, dtype="float32"))
    srv = LiveServer(engine)
    yield model, srv
    srv.stop()
    engine.shutdown()


def _reference(model_dir, prompt, width, steps, stops, penalty):
    """The same search on transformers' fp32 model, every step's log-probabilities its own."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    async def expand(beams, k):
        out = []
        for tokens in beams:
            with torch.no_grad():
                logits = hf(torch.tensor([tokens])).logits[0, -1]
            lps = torch.log_softmax(logits.double(), -1)
            top = torch.topk(lps, k)
            out.append([(int(t), float(v)) for v, t in zip(top.values, top.indices, strict=True)])
        return out

    return asyncio.run(search(expand, prompt, width, steps, frozenset(stops),
                              length_penalty=penalty))  # fmt: skip


def test_the_servers_beams_equal_the_search_on_transformers(exact):
    model, srv = exact
    prompt = [5, 17, 230, 41, 9, 88, 120, 3]
    body = {"prompt": prompt, "max_tokens": 5, "n": 3, "use_beam_search": True,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    want = _reference(model, prompt, 3, 5, (), 1.0)
    assert [c["token_ids"] for c in got["choices"]] == [b.tokens[len(prompt) :] for b in want]
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert {c["finish_reason"] for c in got["choices"]} == {"length"}
    assert got["usage"] == {"prompt_tokens": 8, "completion_tokens": 15, "total_tokens": 23}
    # A stop token that the search meets on its way: the beams that end there are "stop",
    # scored with the length penalty as the reference scores them.
    second = want[1].tokens[len(prompt)]
    body.update(stop_token_ids=[second], ignore_eos=False, length_penalty=0.5, max_tokens=3)
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    eos = set(srv.engine.engine.eos_ids)
    want = _reference(model, prompt, 3, 3, eos | {second}, 0.5)
    got = r.json()["choices"]
    assert [c["token_ids"] for c in got] == [b.tokens[len(prompt) :] for b in want]
    assert [c["finish_reason"] for c in got] == [b.finish_reason for b in want]
    assert "stop" in [c["finish_reason"] for c in got]
    assert srv.wait_idle().kv_blocks_used == 0  # every step's requests gave their blocks back


def test_the_offline_llms_beams_equal_the_search_on_transformers(exact):
    """vLLM's offline `LLM.beam_search(prompts, BeamSearchParams(...))`."""
    from hetserve import LLM

    model, _ = exact
    llm = LLM(model, dtype="float32", max_model_len=256)
    try:
        prompt = [5, 17, 230, 41, 9, 88, 120, 3]
        params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
        [out] = llm.beam_search(prompt_token_ids=[prompt], params=params)
        want = _reference(model, prompt, 2, 4, (), 1.0)
        assert [b.tokens for b in out.sequences] == [b.tokens for b in want]
        for got, ref in zip(out.sequences, want, strict=True):
            assert got.cum_logprob == pytest.approx(ref.cum_logprob, abs=1e-4)
            assert got.text == llm.tokenizer.decode(got.tokens[len(prompt) :],
                                                    skip_special_tokens=True)  # fmt: skip
        with pytest.raises(ValueError, match="beam_width must be 1 to 10"):
            BeamSearchParams(beam_width=11, max_tokens=4)
        with pytest.raises(TypeError, match="BeamSearchParams"):
            llm.beam_search(["hi"], {"beam_width": 2})
        assert llm.stats().kv_blocks_used == 0
    finally:
        llm.close()


def test_a_beam_search_truncates_checks_and_fits_as_sampling_does(exact):
    """Found in review: the beam path ignored truncate_prompt_tokens and priority, and a
    prompt filling the context came back as an empty 200."""
    _, srv = exact
    body = {"prompt": list(range(5, 45)), "max_tokens": 2, "n": 2, "use_beam_search": True,
            "return_token_ids": True, "truncate_prompt_tokens": 10}  # fmt: skip
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert r.json()["choices"][0]["prompt_token_ids"] == list(range(35, 45))
    assert r.json()["usage"]["prompt_tokens"] == 10
    for extra, param in (({"priority": 5}, "priority"), ({"length_penalty": 1e308}, None),
                         ({"prompt": list(range(5, 261))}, None)):  # fmt: skip
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={**body, "truncate_prompt_tokens": None, **extra})
        assert r.status_code == 400, (extra, r.text)
        if param:
            assert r.json()["error"]["param"] == param


def test_llm_beam_search_runs_inside_an_event_loop_and_within_the_context(exact):
    from hetserve import LLM

    model, _ = exact
    llm = LLM(model, dtype="float32", max_model_len=64)
    try:
        params = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)

        async def in_a_notebook():  # asyncio.run inside a running loop raised RuntimeError
            return llm.beam_search(prompt_token_ids=[list(range(5, 65 - 4))], params=params)

        [out] = asyncio.run(in_a_notebook())
        assert all(len(b.tokens) == 64 for b in out.sequences)  # capped at the context's room
        with pytest.raises(InvalidInputError, match="leaves no room"):
            llm.beam_search(prompt_token_ids=[list(range(5, 69))], params=params)
    finally:
        llm.close()


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"stream": True}, "stream"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"echo": True}, "echo"),
        ({"n": 11}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"use_beam_search": "yes"}, "use_beam_search"),
    ],
)
def test_what_beam_search_does_not_combine_with_is_a_400(server, extra, param):
    body = {"prompt": "hello", "max_tokens": 3, "use_beam_search": True, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_beams_are_the_completion_beams_of_the_rendered_prompt(exact):
    """vLLM's chat beam search: the chat template's prompt searched as completions search it,
    each beam read by the reply parser into a message."""
    _, srv = exact
    messages = [{"role": "user", "content": "name three colours"}]
    ids = httpx.post(srv.url + "/tokenize", json={"messages": messages}, timeout=30)
    ids = ids.json()["tokens"]
    common = {"max_tokens": 4, "n": 2, "use_beam_search": True, "ignore_eos": True,
              "return_token_ids": True}  # fmt: skip
    cmpl = httpx.post(srv.url + "/v1/completions", json={"prompt": ids, **common}, timeout=120)
    chat = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                      json={"messages": messages, **common})  # fmt: skip
    assert chat.status_code == 200, chat.text
    got = chat.json()
    assert got["prompt_token_ids"] == ids
    assert [c["token_ids"] for c in got["choices"]] == [
        c["token_ids"] for c in cmpl.json()["choices"]
    ]
    for c in got["choices"]:
        assert c["message"]["role"] == "assistant" and c["finish_reason"] == "length"
        text = srv.engine.engine.tokenizer.decode(c["token_ids"], skip_special_tokens=True)
        assert c["message"]["content"] == text  # no thinking or call in these random tokens
    for extra, param in (({"logprobs": True}, "logprobs"), ({"stream": True}, "stream"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}],
                           "tool_choice": "required"}, "tool_choice")):  # fmt: skip
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                       json={"messages": messages, **common, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
