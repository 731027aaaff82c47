"""Every tool and reasoning parser on what its family's chat template renders (the tiny
checkpoints carry the templates): the parse gives back the calls, thinking and answer that
were rendered, and a stream cut at random places adds up to the parse of the whole text."""

import json
import random

import pytest

from hetserve.model.tokenizer import Tokenizer
from hetserve.server.tools import Streamer, default_parsers, output_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Lyon 7"})]
USER = [{"role": "user", "content": "weather in Paris and Lyon?"}]
# family -> (tool parser, reasoning parser) the template should select, and whether the
# template renders a reply's thinking (else the test writes the thinking itself, as R1 does).
FAMILIES = {
    "qwen3-moe": ("hermes", "deepseek_r1", True),
    "deepseek-v3": ("deepseek_v3", "deepseek_r1", False),
    "glm4-moe": ("glm45", "deepseek_r1", True),
    "kimi-k2": ("kimi_k2", None, False),
    "gpt-oss": ("openai", "openai", True),
    "llama": ("llama3_json", None, False),
}
ENDS = ("<|im_end|>", "<｜end▁of▁sentence｜>", "<|eot_id|>", "<|call|>", "<|end|>", "<|user|>")


def assistant(content: str, calls, reasoning: str | None) -> dict:
    msg = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [
            {
                "id": f"functions.{name}:{i}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            for i, (name, args) in enumerate(calls)
        ]
    return msg


def reply_text(tok: Tokenizer, msg: dict, renders_thinking: bool) -> tuple[str, str]:
    """(prompt, the reply a model would generate) as the template renders them."""
    prompt = tok.apply_chat_template(USER, True, tools=TOOLS)
    full = tok.apply_chat_template([*USER, msg], False, tools=TOOLS)
    base = prompt.removesuffix("<think>\n")  # R1's prompt opens the thinking
    common = 0
    while common < min(len(base), len(full)) and base[common] == full[common]:
        common += 1
    reply = full[common:].rstrip("\n")
    for end in ENDS:  # the end-of-turn token ends generation: not part of the text
        reply = reply.removesuffix(end)
    thinking = prompt[common:]  # what the generation prompt adds (R1's "<think>\n")
    if msg.get("reasoning_content") and not renders_thinking:
        reply = f"{msg['reasoning_content']}</think>\n\n{reply}"
    elif thinking and not renders_thinking:
        reply = f"</think>\n\n{reply}"
    return prompt, reply


def check_stream(parser_args, reply: str, whole) -> None:
    rng = random.Random(len(reply))
    for round_ in range(21):
        streamer = Streamer(output_parser(*parser_args))
        cuts = sorted(rng.sample(range(1, len(reply)), min(8, len(reply) - 1)))
        if round_ == 20:  # a character at a time: every place a stream can be cut
            cuts = list(range(1, len(reply)))
        content, reasoning, calls = "", "", {}
        for end in [*cuts, len(reply)]:
            c, r, deltas = streamer.feed(reply[:end], final=end == len(reply))
            content, reasoning = content + c, reasoning + r
            for d in deltas:
                call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
                call["name"] = d.get("name") or call["name"]
                call["arguments"] += d["arguments"]
        # as the reply's message has it: beside calls, whitespace alone is no content
        want = whole.content if whole.content.strip() or not whole.calls else ""
        assert content == want and reasoning == whole.reasoning
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (c.name, c.arguments) for c in whole.calls
        ]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["calls", "answer", "both"])
def test_parser_reads_what_the_template_renders(tiny_model, family, case):
    tool_name, reasoning_name, renders_thinking = FAMILIES[family]
    tok = Tokenizer(tiny_model(family))
    assert default_parsers(tok.chat_template) == (tool_name, reasoning_name)
    calls = CALLS if case != "answer" else []
    if family in ("llama", "gpt-oss") and case == "both":
        calls = CALLS[:1]  # one call per turn, and no answer beside it, in these formats
    content = "It is sunny." if case != "calls" else ""
    if family in ("llama", "gpt-oss") and calls:
        content = ""
    thinking = "Paris first, then Lyon." if reasoning_name and case != "answer" else None
    prompt, reply = reply_text(tok, assistant(content, calls, thinking), renders_thinking)
    args = (tool_name, reasoning_name, TOOLS, prompt)
    whole = output_parser(*args).parse(reply, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls, reply
    assert whole.content.strip() == content, reply
    assert whole.reasoning.strip() == (thinking or ""), reply
    if family == "kimi-k2" and calls:
        assert [c.id for c in whole.calls] == ["functions.get_weather:0", "functions.get_weather:1"]
    check_stream(args, reply, whole)


def test_parallel_tool_calls_false_answers_the_first_call_streamed_or_not(tiny_model):
    from hetserve.server.tool_calls import choice_parser, plan_tools

    tok = Tokenizer(tiny_model("qwen3-moe"))
    prompt, reply = reply_text(tok, assistant("", CALLS, None), True)
    plan = plan_tools({"tools": TOOLS, "parallel_tool_calls": False})
    whole = choice_parser(plan, "hermes", None, prompt).parse(reply, True)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == CALLS[:1]
    streamer = Streamer(choice_parser(plan, "hermes", None, prompt))
    indices = set()
    for end in range(1, len(reply) + 1):
        _, _, deltas = streamer.feed(reply[:end], final=end == len(reply))
        indices |= {d["index"] for d in deltas}
    assert indices == {0}
    both = choice_parser(plan_tools({"tools": TOOLS}), "hermes", None, prompt)
    assert len(both.parse(reply, True).calls) == 2


def test_tool_choice_none_leaves_the_text_as_content(tiny_model):
    tok = Tokenizer(tiny_model("qwen3-moe"))
    prompt, reply = reply_text(tok, assistant("", CALLS, None), True)
    parsed = output_parser("hermes", None, None, prompt).parse(reply, True)
    assert not parsed.calls and "<tool_call>" in parsed.content


def test_thinking_switched_off_is_all_answer(tiny_model):
    tok = Tokenizer(tiny_model("qwen3-moe"))
    prompt = tok.apply_chat_template(USER, True, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    parsed = output_parser("hermes", "qwen3", TOOLS, prompt).parse("Hi <b>there</b>", True)
    assert parsed.content == "Hi <b>there</b>" and parsed.reasoning == ""


@pytest.mark.parametrize(
    "parser,text",
    [
        ("hermes", "<tool_call>\n{not json at all\n</tool_call>"),
        ("hermes", "<tool_call>"),
        ("deepseek_v3", "<｜tool▁calls▁begin｜>garbage"),
        ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>"),
        ("glm45", "<tool_call>"),
        ("openai", "<|channel|>analysis"),
        ("llama3_json", '{"name": 5'),
    ],
)
def test_broken_output_never_raises(parser, text):
    for end in range(1, len(text) + 1):
        output_parser(parser, None, TOOLS, "").parse(text[:end], end == len(text))
