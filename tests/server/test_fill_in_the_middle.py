"""/v1/completions `suffix`: fill in the middle with the model's own FIM tokens (Qwen-Coder's
<|fim_prefix|> / <|fim_suffix|> / <|fim_middle|>, DeepSeek-Coder's, StarCoder's), what code
completion clients send. It was refused as unsupported. The prompt is prefix-suffix-middle
(the tiny Qwen3 tokenizer has Qwen's FIM tokens, as the published one does); a model without
FIM tokens, echo, or several prompts with a suffix are 400s."""

import httpx
import pytest

from hetserve.config import EngineConfig
from hetserve.engine.async_llm import AsyncLLM
from tests.server.conftest import LiveServer

GREEDY = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}  # fmt: skip


def post(srv, body):
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=60)


def test_the_middle_is_completed_between_prefix_and_suffix(server):
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    r = post(server, {**GREEDY, "prompt": prefix, "suffix": suffix})
    assert r.status_code == 200, r.text
    fim = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    plain = post(server, {**GREEDY, "prompt": fim}).json()
    got = r.json()["choices"][0]
    assert got["prompt_token_ids"] == plain["choices"][0]["prompt_token_ids"]
    assert got["text"] == plain["choices"][0]["text"]
    tok = engine_tokenizer(server)
    markers = [tok.token_to_id(m) for m in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")]
    assert [t for t in got["prompt_token_ids"] if t in markers] == markers  # one token each
    # An empty suffix (the end of a file) is still a fill in the middle.
    end = post(server, {**GREEDY, "prompt": prefix, "suffix": ""}).json()
    assert end["choices"][0]["prompt_token_ids"][-1] == markers[2]


def engine_tokenizer(server):
    return server.engine.tokenizer


@pytest.mark.parametrize(
    "extra",
    [{"echo": True}, {"prompt": ["a", "b"]}, {"prompt": [1, 2, 3]}],
)
def test_what_a_suffix_cannot_go_with(server, extra):
    r = post(server, {**GREEDY, "prompt": "x", "suffix": "y", **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text


def test_a_model_without_fim_tokens_says_so(tiny_model):
    engine = AsyncLLM(EngineConfig(model=str(tiny_model("deepseek-v3")), max_model_len=256))
    srv = LiveServer(engine)
    try:
        r = post(srv, {**GREEDY, "prompt": "x", "suffix": "y"})
        assert r.status_code == 400 and "needs a code model" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/api/generate", json={"model": "tiny", "prompt": "x",
                                                        "suffix": "y"}, timeout=60)  # fmt: skip
        assert r.status_code == 400 and "does not support insert" in r.json()["error"]
    finally:
        srv.stop()
        engine.shutdown()


def test_ollamas_insert_and_raw_prompts(server):
    """Ollama's /api/generate refused `suffix` (its insert mode) and `raw`."""
    import ollama

    client = ollama.Client(host=server.url)
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    same = {"max_tokens": 6, "temperature": 0, "model": "tiny"}
    options = {"num_predict": 6, "temperature": 0}
    fim = post(server, {**same, "prompt": prefix, "suffix": suffix}).json()["choices"][0]
    got = client.generate(model="tiny", prompt=prefix, suffix=suffix, options=options)
    assert got.response == fim["text"] and got.done
    streamed = "".join(p.response for p in client.generate(
        model="tiny", prompt=prefix, suffix=suffix, options=options, stream=True))  # fmt: skip
    assert streamed == fim["text"]
    raw_text = "the model serves tokens"
    plain = post(server, {**same, "prompt": raw_text}).json()["choices"][0]
    raw = client.generate(model="tiny", prompt=raw_text, raw=True, options=options)
    assert raw.response == plain["text"] and raw.prompt_eval_count > 0


def test_raw_with_a_suffix_is_as_written_and_fim_stops_at_a_new_file(server):
    """Ollama sends a raw prompt as written, suffix or not; the middle also ends where the
    model pads or starts another file (llama.cpp stops there too)."""
    tok = engine_tokenizer(server)
    _, stops = tok.fim_prompt("a", "b")
    assert tok.token_to_id("<|fim_pad|>") in stops
    body = {"model": "tiny", "prompt": "the model serves", "raw": True, "stream": False,
            "options": {"num_predict": 2, "temperature": 0}}  # fmt: skip
    alone = httpx.post(server.url + "/api/generate", json=body, timeout=60).json()
    both = httpx.post(server.url + "/api/generate", json={**body, "suffix": "tokens"},
                      timeout=60).json()  # fmt: skip
    assert both["prompt_eval_count"] == alone["prompt_eval_count"]
    assert both["response"] == alone["response"]
