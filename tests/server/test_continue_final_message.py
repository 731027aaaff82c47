"""vLLM's `continue_final_message`: the reply continues an assistant turn the client began
(a prefill of the answer) instead of opening a new turn. It was refused as unsupported. The
prompt is the template's text cut right after the final message, as transformers renders it
(the reference here), and the reply equals a completion of that prompt text."""

import httpx
import pytest
from transformers import AutoTokenizer

from hetserve import LLM, SamplingParams
from hetserve.errors import InvalidInputError
from hetserve.model.tokenizer import Tokenizer

BEGUN = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is "},
]


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3", "glm4-moe", "gpt-oss"])
def test_the_prompt_is_transformers_continued_chat(tiny_model, family):
    model = tiny_model(family)
    ours = Tokenizer(str(model)).apply_chat_template(
        BEGUN, add_generation_prompt=False, continue_final_message=True
    )
    theirs = AutoTokenizer.from_pretrained(str(model)).apply_chat_template(
        BEGUN, tokenize=False, continue_final_message=True
    )
    assert ours == theirs and ours.rstrip().endswith("The capital of France is")


def test_a_template_that_changes_the_text_is_an_error(tiny_model, tmp_path):
    tok = Tokenizer(str(tiny_model("qwen3-moe")))
    tok.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    tok._template = None
    with pytest.raises(InvalidInputError, match="did not render the final message"):
        tok.apply_chat_template(BEGUN, add_generation_prompt=False, continue_final_message=True)


def test_the_reply_continues_the_begun_turn(server):
    prompt = server.engine.tokenizer.apply_chat_template(
        BEGUN, add_generation_prompt=False, continue_final_message=True
    )
    greedy = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        **greedy, "messages": BEGUN, "continue_final_message": True,
        "add_generation_prompt": False}, timeout=60)  # fmt: skip
    assert chat.status_code == 200, chat.text
    plain = httpx.post(server.url + "/v1/completions", json={
        **greedy, "prompt": prompt}, timeout=60)  # fmt: skip (Qwen3 adds no BOS)
    assert plain.status_code == 200, plain.text
    assert chat.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    assert chat.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["text"]
    # Without it the turn is closed and a new one opened: another prompt.
    closed = httpx.post(server.url + "/v1/chat/completions", json={
        **greedy, "messages": BEGUN, "add_generation_prompt": False}, timeout=60)  # fmt: skip
    assert closed.json()["usage"]["prompt_tokens"] > chat.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("fields", "needle"),
    [({"continue_final_message": True}, "set add_generation_prompt to false"),
     ({"continue_final_message": True, "add_generation_prompt": False,
       "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
      "final message with text"),
     ({"chat_template_kwargs": {"continue_final_message": True}},
      "request's continue_final_message")],
)  # fmt: skip
def test_its_mistakes_are_400s(server, fields, needle):
    body = {"model": "tiny", "messages": BEGUN, "max_tokens": 2, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert r.json()["error"]["param"].endswith("continue_final_message")


def test_llm_chat_continues_too(tiny_model):
    llm = LLM(str(tiny_model("qwen3-moe")), max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.chat(BEGUN, params, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.rstrip().endswith("The capital of France is")
    assert out.outputs[0].text == llm.generate(out.prompt, params)[0].outputs[0].text
    with pytest.raises(InvalidInputError, match="add_generation_prompt=False"):
        llm.chat(BEGUN, params, continue_final_message=True)
