"""vLLM's extensions of the OpenAI API that were refused as unsupported: /tokenize and
/detokenize (a chat body rendered as /v1/chat/completions renders it; behind the API key),
return_token_ids, cache_salt, prompt_logprobs, truncate_prompt_tokens, allowed_token_ids and
bad_words. Mistakes are 400s naming the field."""

import json

import httpx
import pytest
from transformers import AutoTokenizer

from hetserve.config import EngineConfig
from hetserve.engine.async_llm import AsyncLLM
from tests.server.conftest import LiveServer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
KEY = {"Authorization": "Bearer sesame"}


@pytest.fixture(scope="module")
def served(tiny_model):
    model = str(tiny_model("qwen3-moe"))
    engine = AsyncLLM(EngineConfig(model=model, max_model_len=512))
    srv = LiveServer(engine, api_key="sesame")
    yield srv, model
    srv.stop()
    engine.shutdown()


def post(srv, path, body, headers=KEY):
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def test_a_prompt_as_transformers_tokenizes_it(served):
    srv, model = served
    hf = AutoTokenizer.from_pretrained(model)
    text = "The quick brown fox jumps over the lazy dog"
    r = post(srv, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == hf.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 512
    assert got["token_strs"] == hf.convert_ids_to_tokens(got["tokens"])
    back = post(srv, "/detokenize", {"model": "tiny", "tokens": got["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    assert post(srv, "/tokenize", {"prompt": text}).json()["token_strs"] is None


def test_a_chat_counts_what_the_chat_route_prompts(served):
    srv, _ = served
    for extra in ({}, {"tools": [TOOL]}, {"chat_template_kwargs": {"enable_thinking": False}}):
        body = {"messages": MESSAGES, **extra}
        counted = post(srv, "/tokenize", body).json()["count"]
        r = post(srv, "/v1/chat/completions", {**body, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert counted == r.json()["usage"]["prompt_tokens"]
    begun = [*MESSAGES, {"role": "assistant", "content": "Hi, I am"}]
    cont = post(srv, "/tokenize", {"messages": begun, "add_generation_prompt": False,
                                   "continue_final_message": True})  # fmt: skip
    text = post(srv, "/detokenize", {"tokens": cont.json()["tokens"]}).json()["prompt"]
    assert text.endswith("Hi, I am")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [("/tokenize", {}, "prompt"),
     ("/tokenize", {"prompt": 5}, "prompt"),
     ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
     ("/tokenize", {"messages": []}, "messages"),
     ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": True,
                    "continue_final_message": True}, "continue_final_message"),
     ("/detokenize", {"tokens": "abc"}, "tokens"),
     ("/detokenize", {"tokens": [1, True]}, "tokens"),
     ("/detokenize", {"tokens": [1, 10**9]}, "tokens.1"),
     ("/detokenize", {"tokens": [-1]}, "tokens.0")],
)  # fmt: skip
def test_mistakes_are_400s_naming_the_field(served, path, body, param):
    srv, _ = served
    r = post(srv, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_behind_the_key_and_the_model_name(served):
    srv, _ = served
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert post(srv, path, body, headers={}).status_code == 401
        r = post(srv, path, {**body, "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(srv.url + "/tokenize", content=b"{", headers=KEY)
    assert r.status_code == 400


def _events(srv, path, body):
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, headers=KEY,
                      timeout=60) as s:  # fmt: skip
        lines = [ln.removeprefix("data: ") for ln in s.iter_lines() if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"]


def test_return_token_ids_gives_the_prompts_and_the_replys_ids(served):
    """vLLM's return_token_ids (RL rollouts keep the ids the model saw and wrote) was refused
    as unsupported."""
    from hetserve.model.tokenizer import Tokenizer

    srv, model = served
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    text = "The quick brown fox"
    r = post(srv, "/v1/completions", {"prompt": text, **greedy}).json()
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == post(srv, "/tokenize", {"prompt": text}).json()["tokens"]
    assert len(choice["token_ids"]) == r["usage"]["completion_tokens"] == 6
    # The text skips special tokens (/detokenize keeps them, as vLLM's does).
    assert Tokenizer(model).decode(choice["token_ids"]) == choice["text"]
    chunks = [c["choices"][0] for c in _events(srv, "/v1/completions", {"prompt": text, **greedy})
              if c["choices"]]  # fmt: skip
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]

    chat = post(srv, "/v1/chat/completions", {"messages": MESSAGES, **greedy}).json()
    assert chat["prompt_token_ids"] == post(srv, "/tokenize", {"messages": MESSAGES}).json()[
        "tokens"
    ]
    assert len(chat["choices"][0]["token_ids"]) == 6
    events = _events(srv, "/v1/chat/completions", {"messages": MESSAGES, **greedy})
    assert events[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == chat["choices"][0]["token_ids"]
    plain = post(srv, "/v1/completions", {"prompt": text, "max_tokens": 2}).json()
    assert "token_ids" not in plain["choices"][0]  # not asked, not sent


def test_cache_salt_shares_a_prefix_only_under_the_same_salt(served):
    """vLLM's cache_salt was refused as unsupported: tenants sharing a server could not keep
    their prefixes (and the timing that reveals them) apart."""
    srv, _ = served
    prompt = "the tenants each send the same long preamble " * 6

    def cached(**extra):
        body = {"prompt": prompt, "max_tokens": 1, **extra}
        r = post(srv, "/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="a" * 43) == 0  # first seen
    assert cached(cache_salt="a" * 43) > 0  # the same tenant: its prefix
    assert cached(cache_salt="b" * 43) == 0  # another tenant's: nothing shared
    assert cached() == 0  # nor with requests without a salt
    assert cached() > 0
    for bad in ("", 5):
        r = post(srv, "/v1/completions", {"prompt": "x", "cache_salt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_prompt_logprobs_are_the_echoed_prompts_logprobs(served):
    """vLLM's prompt_logprobs (evaluation and RL frameworks score prompts with it) was refused
    as unsupported; the engine already computed them for echo."""
    srv, _ = served
    text = "The quick brown fox jumps over the lazy dog"
    ids = post(srv, "/tokenize", {"prompt": text}).json()["tokens"]
    r = post(srv, "/v1/completions", {"prompt": text, "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["prompt_logprobs"]
    echo = post(srv, "/v1/completions", {"prompt": text, "max_tokens": 1, "echo": True,
                                         "logprobs": 2}).json()  # fmt: skip
    want = echo["choices"][0]["logprobs"]["token_logprobs"][: len(ids)]
    assert rows[0] is None and len(rows) == len(ids)
    for tid, row, lp in zip(ids[1:], rows[1:], want[1:], strict=True):
        assert row[str(tid)]["logprob"] == pytest.approx(lp, abs=1e-5)
        ranks = [v["rank"] for v in row.values()]
        assert ranks == sorted(ranks) and {1, 2} <= set(ranks)  # the top 2 ...
        assert len(row) == (2 if row[str(tid)]["rank"] <= 2 else 3)  # ... and the prompt's own
    chat = post(srv, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                              "prompt_logprobs": 0}).json()  # fmt: skip
    rows = chat["prompt_logprobs"]
    assert len(rows) == chat["usage"]["prompt_tokens"] and rows[0] is None
    assert all(len(row) == 1 for row in rows[1:])  # k = 0: the prompt's own alone
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": True},
                {"prompt_logprobs": 1, "stream": True}):  # fmt: skip
        r = post(srv, "/v1/completions", {"prompt": text, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_truncate_prompt_tokens_keeps_the_last_ones(served):
    srv, _ = served
    text = "The quick brown fox jumps over the lazy dog"
    ids = post(srv, "/tokenize", {"prompt": text}).json()["tokens"]
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    cut = post(srv, "/v1/completions", {"prompt": text, "truncate_prompt_tokens": 3, **greedy})
    assert cut.status_code == 200, cut.text
    same = post(srv, "/v1/completions", {"prompt": ids[-3:], **greedy}).json()
    assert cut.json()["usage"]["prompt_tokens"] == 3
    assert cut.json()["choices"][0]["text"] == same["choices"][0]["text"]
    long = post(srv, "/v1/completions", {"prompt": text, "truncate_prompt_tokens": 500,
                                         **greedy}).json()  # fmt: skip
    assert long["usage"]["prompt_tokens"] == len(ids)  # shorter already: as it is
    chat = post(srv, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                              "truncate_prompt_tokens": 5}).json()  # fmt: skip
    assert chat["usage"]["prompt_tokens"] == 5
    r = post(srv, "/v1/completions", {"prompt": text, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    whole = post(srv, "/v1/completions", {"prompt": text, "truncate_prompt_tokens": -1,
                                          **greedy}).json()  # fmt: skip
    assert whole["usage"]["prompt_tokens"] == len(ids)  # vLLM's -1: the context's worth
    r = post(srv, "/v1/completions", {"prompt": text, "prompt_logprobs": -1})
    assert r.status_code == 400 and "whole vocabulary" in r.json()["error"]["message"]
    r = post(srv, "/v1/completions", {"prompt": text, "add_special_tokens": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"


def test_allowed_token_ids_and_bad_words(served):
    srv, _ = served
    base = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    free = post(srv, "/v1/completions", base).json()["choices"][0]
    allowed = sorted(set(free["token_ids"][1:4]) | {7})  # not the greedy first token
    r = post(srv, "/v1/completions", {**base, "allowed_token_ids": allowed})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["token_ids"]
    assert set(got) <= set(allowed) and got != free["token_ids"]
    # A word the model wrote, banned: spelled either way it appears nowhere in the reply.
    word = post(srv, "/detokenize", {"tokens": free["token_ids"][:2]}).json()["prompt"]
    spellings = [post(srv, "/tokenize", {"prompt": w, "add_special_tokens": False}).json()[
        "tokens"] for w in (word.lstrip(), " " + word.lstrip())]  # fmt: skip
    r = post(srv, "/v1/completions", {**base, "bad_words": [word]})
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    for seq in spellings:
        assert not any(ids[i : i + len(seq)] == seq for i in range(len(ids)))
    for bad, param in (({"allowed_token_ids": []}, "allowed_token_ids"),
                       ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
                       ({"allowed_token_ids": ["a"]}, "allowed_token_ids"),
                       ({"bad_words": [" "]}, "bad_words"),
                       ({"bad_words": "the"}, "bad_words")):  # fmt: skip
        r = post(srv, "/v1/completions", {**base, **bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"].startswith(param), r.text


def test_llm_takes_bad_words_too(tiny_model):
    from hetserve import LLM, SamplingParams

    llm = LLM(str(tiny_model("qwen3-moe")), max_model_len=256)
    greedy = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    free = llm.generate("The quick brown fox", SamplingParams(**greedy))[0].outputs[0]
    word = llm.tokenizer.decode(free.token_ids[:1], skip_special_tokens=False)
    out = llm.generate("The quick brown fox", SamplingParams(**greedy, bad_words=[word]))[0]
    banned = {s[0] for s in llm.tokenizer.bad_word_ids([word]) if len(s) == 1}
    assert banned and not banned & set(out.outputs[0].token_ids)


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(served):
    srv, _ = served
    base = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "return_tokens_as_token_ids": True}  # fmt: skip
    r = post(srv, "/v1/completions", {"prompt": "The quick", "logprobs": 2, **base}).json()
    choice = r["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"]
               for k in top)  # fmt: skip
    named = post(srv, "/v1/completions", {"prompt": "The quick", "logprobs": 2, **base,
                                          "return_tokens_as_token_ids": False}).json()  # fmt: skip
    assert choice["logprobs"]["text_offset"] == named["choices"][0]["logprobs"]["text_offset"]
    chat = post(srv, "/v1/chat/completions", {"messages": MESSAGES, "logprobs": True,
                                              "top_logprobs": 2, **base}).json()  # fmt: skip
    content = chat["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [
        f"token_id:{t}" for t in chat["choices"][0]["token_ids"]
    ]
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])


def test_chat_echo_starts_the_reply_with_the_begun_turn(served):
    srv, _ = served
    begun = [*MESSAGES, {"role": "assistant", "content": "Hi, I am"}]
    body = {"messages": begun, "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 4, "temperature": 0, "ignore_eos": True}  # fmt: skip
    plain = post(srv, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = post(srv, "/v1/chat/completions", {**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "Hi, I am" + plain
    events = _events(srv, "/v1/chat/completions", {**body, "echo": True})
    deltas = [c["delta"].get("content") for e in events for c in e["choices"]]
    assert deltas[1] == "Hi, I am" and "".join(d or "" for d in deltas) == "Hi, I am" + plain
    # The last message is the user's: nothing of it is the reply's.
    # greedy: sampled, the reply itself began with "hello" about once in a thousand
    ask = {"messages": MESSAGES, "echo": True, "max_tokens": 2, "temperature": 0}
    asked = post(srv, "/v1/chat/completions", ask).json()
    assert not asked["choices"][0]["message"]["content"].startswith("hello")


def test_add_special_tokens_adds_the_tokenizers_bos(tiny_model, tmp_path):
    """A tokenizer that adds a BOS (Llama's, DeepSeek's): completions add it unless told not
    to; chat does not (templates write their own) unless told to. The tiny checkpoints'
    tokenizers add none, so this one gets a post-processor that does."""
    import shutil

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    model = tmp_path / "bos"
    shutil.copytree(tiny_model("qwen3-moe"), model)
    tok = HFTokenizer.from_file(str(model / "tokenizer.json"))
    bos = tok.token_to_id("<|im_start|>")
    tok.post_processor = TemplateProcessing(single="<|im_start|> $A", pair="<|im_start|> $A $B",
                                            special_tokens=[("<|im_start|>", bos)])  # fmt: skip
    tok.save(str(model / "tokenizer.json"))
    engine = AsyncLLM(EngineConfig(model=str(model), max_model_len=256))
    srv = LiveServer(engine)
    try:
        one = {"max_tokens": 1, "return_token_ids": True}
        with_bos = post(srv, "/v1/completions", {"prompt": "hello there", **one}, {}).json()
        without = post(srv, "/v1/completions", {"prompt": "hello there",
                                                "add_special_tokens": False, **one}, {}).json()
        ids = with_bos["choices"][0]["prompt_token_ids"]
        assert ids[0] == bos and ids[1:] == without["choices"][0]["prompt_token_ids"]
        chat = post(srv, "/v1/chat/completions", {"messages": MESSAGES, **one}, {}).json()
        doubled = post(srv, "/v1/chat/completions", {"messages": MESSAGES, **one,
                                                     "add_special_tokens": True}, {}).json()
        assert doubled["prompt_token_ids"] == [bos, *chat["prompt_token_ids"]]
    finally:
        srv.stop()
        engine.shutdown()


def test_thinking_token_budget_forces_the_end_of_thinking(served):
    """vLLM's thinking_token_budget was refused. Here the client opens the thinking itself
    (the random tiny model would never write <think>), and the budget closes it."""
    srv, _ = served
    begun = [*MESSAGES, {"role": "assistant", "content": "<think>\nlet me see"}]
    body = {"messages": begun, "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "thinking_token_budget": 3}  # fmt: skip
    r = post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    forced = post(srv, "/tokenize", {"prompt": "\n</think>\n\n",
                                     "add_special_tokens": False}).json()["tokens"]  # fmt: skip
    ids = r.json()["choices"][0]["token_ids"]
    assert ids[3 : 3 + len(forced)] == forced
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] is not None and message["content"]
    free = post(srv, "/v1/chat/completions", {**body, "thinking_token_budget": None}).json()
    assert free["choices"][0]["message"]["content"] in (None, "")  # it never stops thinking
    r = post(srv, "/v1/chat/completions", {**body, "thinking_token_budget": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
    r = post(srv, "/v1/completions", {"prompt": "x", "thinking_token_budget": 3})
    assert r.status_code == 400  # a chat request's: the format is the template's
    # With a grammar from the first token there is no thinking to cap: a 400, not the 500 a
    # forced </think> against the grammar was.
    json_only = {**body, "response_format": {"type": "json_object"}}
    r = post(srv, "/v1/chat/completions", json_only)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"


def test_an_oversized_text_is_counted_and_truncated_not_refused(served):
    """The first review: the server's guard against texts too long to fit the context refused
    them before /tokenize could count them or truncate_prompt_tokens could cut them."""
    srv, _ = served
    text = "the model serves tokens " * 2000  # ~48k characters, far past a 512-token context
    r = post(srv, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert r.status_code == 400  # as before: it cannot fit
    counted = post(srv, "/tokenize", {"prompt": text}).json()["count"]
    assert counted > 4000
    cut = post(srv, "/v1/completions", {"prompt": text, "max_tokens": 1,
                                        "truncate_prompt_tokens": 10}).json()  # fmt: skip
    assert cut["usage"]["prompt_tokens"] == 10
