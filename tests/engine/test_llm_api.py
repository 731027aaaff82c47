"""The offline `LLM` as a user calls it: from several threads, with wrong arguments."""

import threading

import pytest

from hetserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model("qwen3-moe"))


def test_threads_sharing_one_llm_take_turns(llm):
    # Found in a trial: four threads calling generate at once stepped the EngineCore together;
    # requests were lost (KeyError), some threads never returned, and the engine stayed broken.
    prompts = [[3 + i, 7, 11, 13] for i in range(4)]
    want = [llm.generate(prompt_token_ids=p, sampling_params=GREEDY)[0] for p in prompts]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(3):
                out = llm.generate(prompt_token_ids=prompts[i], sampling_params=GREEDY)[0]
                got.setdefault(i, out.outputs[0].token_ids)
                assert out.outputs[0].token_ids == got[i]
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread never returned"
    assert errors == []
    assert [got[i] for i in range(4)] == [w.outputs[0].token_ids for w in want]
    assert llm.stats().num_running == 0 and llm.stats().num_waiting == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        # Found in a trial: these were AttributeError / "'int' object is not iterable" /
        # "TextInputSequence must be str" from deep inside, or (both given) prompts ignored.
        ({"prompts": ["a"], "sampling_params": {"max_tokens": 2}}, TypeError, "sampling_params"),
        ({"prompts": ["a"], "sampling_params": [{"max_tokens": 2}]}, TypeError, "sampling_params"),
        ({"prompts": 5}, TypeError, "prompts"),
        ({"prompts": [[1, 2, 3]]}, TypeError, "prompt_token_ids"),
        ({"prompt_token_ids": [1.5]}, TypeError, "prompt_token_ids"),
        ({"prompts": ["a"], "prompt_token_ids": [1, 2]}, ValueError, "not both"),
    ],
)
def test_wrong_generate_arguments_name_the_argument(llm, kwargs, error, names):
    with pytest.raises(error, match=names):
        llm.generate(**kwargs)
    assert llm.generate(prompt_token_ids=[3, 4], sampling_params=GREEDY)[0].finished


@pytest.mark.parametrize(
    ("messages", "error", "names"),
    [
        # Found in a trial: each of these generated from a prompt without the user's message
        # (the chat template drops an unknown role, renders a string or [] as no messages).
        ("hi", TypeError, "messages"),
        ([], TypeError, "messages"),
        (["hi"], TypeError, r"messages\[0\]"),
        ([{"role": "bogus", "content": "hi"}], ValueError, "role 'bogus'"),
        ([{"content": "hi"}], ValueError, "role None"),
        ([{"role": "user"}], ValueError, "needs content"),
        (
            [[{"role": "user", "content": "a"}], [{"role": "usr", "content": "b"}]],
            ValueError,
            "usr",
        ),
    ],
)
def test_malformed_chat_messages_are_refused(llm, messages, error, names):
    with pytest.raises(error, match=names):
        llm.chat(messages, GREEDY)


def test_chat_accepts_every_openai_role(llm):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ]  # fmt: skip
    assert llm.chat(messages, GREEDY)[0].finished
    assert llm.chat(tuple(messages), GREEDY)[0].finished


def test_a_max_model_len_past_the_models_context_is_said(tiny_model, caplog):
    """It was lowered to the model's context in silence (vLLM refuses it)."""
    import json
    import logging

    path = tiny_model("qwen3-moe")
    context = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    with caplog.at_level(logging.WARNING, logger="hetserve.engine.setup"):
        llm = LLM(path, max_model_len=context * 2)
    try:
        assert llm.max_model_len == context
        assert f"max_model_len {context * 2} is past the model's context" in caplog.text
    finally:
        llm.close()
