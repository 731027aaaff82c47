"""Sampling behaviour: seeds, top-k/top-p, stop strings and stop token ids, logprobs, chat."""

import pytest

from hetserve import LLM, SamplingParams

PROMPT = list(range(3, 23))


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model("qwen3-moe", lm_head_scale=2.0))


def gen(llm, **kw):
    return llm.generate(prompt_token_ids=PROMPT, sampling_params=SamplingParams(**kw))[0]


def test_seed_reproducibility(llm):
    a = gen(llm, temperature=1.0, seed=42, max_tokens=24, ignore_eos=True)
    b = gen(llm, temperature=1.0, seed=42, max_tokens=24, ignore_eos=True)
    c = gen(llm, temperature=1.0, seed=43, max_tokens=24, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_equals_greedy(llm):
    greedy = gen(llm, temperature=0, max_tokens=16, ignore_eos=True)
    topk1 = gen(llm, temperature=1.5, top_k=1, seed=5, max_tokens=16, ignore_eos=True)
    assert greedy.token_ids == topk1.token_ids


def test_tiny_top_p_equals_greedy(llm):
    greedy = gen(llm, temperature=0, max_tokens=16, ignore_eos=True)
    nucleus = gen(llm, temperature=1.0, top_p=1e-6, seed=5, max_tokens=16, ignore_eos=True)
    assert greedy.token_ids == nucleus.token_ids


def test_stop_token_ids_end_output(llm):
    full = gen(llm, temperature=0, max_tokens=24, ignore_eos=True)
    stop_id = full.token_ids[6]
    first = full.token_ids.index(stop_id)
    out = gen(llm, temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id])
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_stop_string_ends_and_is_removed(llm):
    full = gen(llm, temperature=0, max_tokens=24, ignore_eos=True)
    text = full.text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip())
    cut = text.index(stop)
    out = gen(llm, temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    kept = gen(
        llm,
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=True,
    )
    assert kept.text == text[: cut + len(stop)]


def test_logprobs_hold_chosen_token_and_top_k(llm):
    out = gen(llm, temperature=1.0, seed=1, max_tokens=5, logprobs=3, ignore_eos=True)
    assert len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in entry
        top = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert top[0].logprob >= top[1].logprob >= top[2].logprob
        assert entry[tok].logprob <= top[0].logprob and entry[tok].rank >= 1


def test_n_returns_independent_samples(llm):
    out = gen(llm, temperature=1.0, seed=9, max_tokens=12, n=3, ignore_eos=True)
    assert len(out.outputs) == 3
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_text_prompts_and_chat(llm):
    out = llm.generate(["hello world", "the model"], SamplingParams(max_tokens=4))
    assert len(out) == 2 and all(o.prompt_token_ids for o in out)
    chat = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=3))[0]
    assert chat.prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert chat.prompt_token_ids == llm.tokenizer.encode(chat.prompt, add_special_tokens=False)
