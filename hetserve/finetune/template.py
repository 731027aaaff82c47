"""Conversations -> token ids and labels, with loss on assistant tokens only.

Who calls it: the trainer and the evaluation, once per example. `ChatFormat` renders messages
with the model's own chat template (tokenizer_config.json; `template` unset or "auto") or a
named one (`NAMED`, jinja sources of the common formats). `encode_example` renders the
conversation up to each assistant turn twice, with and without that turn; the difference is
the turn's text, whose tokens are the labels (-100 elsewhere); where the generation prompt ends
in a think tag the history leaves out (reasoning templates), the turn starts where the two part
ways. A template whose rendering of a shorter conversation is not a prefix of the longer one
cannot be split that way and is a `TemplateError`, as is an unknown template name or a
template that fails on a row.

Truncation to `cutoff_len` keeps the first tokens (prompt first, as it is rendered); an example
left with no label tokens after truncation is dropped and counted (the trainer reports it).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from hetserve.errors import InvalidInputError
from hetserve.finetune.data import Example

IGNORE = -100

_CHATML = (
    "{% if system %}<|im_start|>system\n{{ system }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_LLAMA3 = (
    "{{ bos_token }}{% if system %}<|start_header_id|>system<|end_header_id|>\n\n"
    "{{ system }}<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>"
    "{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_DEEPSEEK3 = (
    "{{ bos_token }}{% if system %}{{ system }}{% endif %}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
# LLaMA-Factory template names -> the format they render (thinking tags are not inserted).
NAMED = {
    "chatml": _CHATML,
    "qwen": _CHATML,
    "qwen2": _CHATML,
    "qwen3": _CHATML,
    "qwen3_nothink": _CHATML,
    "llama3": _LLAMA3,
    "deepseek3": _DEEPSEEK3,
}


class TemplateError(InvalidInputError):
    """The chat template cannot render or split a conversation."""


def _role(role: str) -> str:
    return {"observation": "tool", "function": "assistant"}.get(role, role)


@dataclass
class ChatFormat:
    tokenizer: object  # hetserve.model.tokenizer.Tokenizer
    name: str = "auto"

    def __post_init__(self) -> None:
        if self.name in ("auto", "model", None):
            self.name = "auto"
            if not self.tokenizer.chat_template:
                raise TemplateError(
                    "the model has no chat template; set 'template' to one of: "
                    + ", ".join(sorted(NAMED))
                )
            return
        if self.name not in NAMED:
            close = difflib.get_close_matches(self.name, list(NAMED), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TemplateError(
                f"unknown template {self.name!r}; {hint}known: auto (the model's own), "
                + ", ".join(sorted(NAMED))
            )
        from hetserve.model.tokenizer import _environment

        self._named = _environment().from_string(NAMED[self.name])

    def render(self, ex: Example, upto: int, add_generation_prompt: bool) -> str:
        messages = [{"role": _role(m["role"]), "content": m["content"]} for m in ex.messages]
        messages = messages[:upto]
        tok = self.tokenizer
        try:
            if self.name == "auto":
                if ex.system:
                    messages = [{"role": "system", "content": ex.system}, *messages]
                return tok.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt
                )
            return self._named.render(
                messages=messages, system=ex.system, add_generation_prompt=add_generation_prompt,
                bos_token=tok.bos_token or "", eos_token=tok.eos_token or "",
            )  # fmt: skip
        except Exception as exc:  # jinja errors of a user's template
            raise TemplateError(f"{ex.source}: the chat template failed: {exc}") from None

    def prompt_ids(self, ex: Example) -> list[int]:
        """The conversation without its last assistant turn, ready for generation."""
        return self.tokenizer.encode(
            self.render(ex, len(ex.messages) - 1, True), add_special_tokens=False
        )


def encode_example(fmt: ChatFormat, ex: Example, cutoff_len: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels) with labels only on assistant turns, truncated to cutoff_len."""
    ids: list[int] = []
    labels: list[int] = []
    done = ""
    for i, m in enumerate(ex.messages):
        if m["role"] not in ("assistant", "function"):
            continue
        prompt, full = _turn_start(fmt, ex, i, done)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise TemplateError(
                f"{ex.source}: template {fmt.name!r} renders turn {i + 1} so that the shorter "
                "conversation is not a prefix of the longer one; use another template"
            )
        new_prompt = fmt.tokenizer.encode(prompt[len(done) :], add_special_tokens=False)
        answer = fmt.tokenizer.encode(full[len(prompt) :], add_special_tokens=False)
        ids += new_prompt + answer
        labels += [IGNORE] * len(new_prompt) + answer
        done = full
    return ids[:cutoff_len], labels[:cutoff_len]


def _turn_start(fmt: ChatFormat, ex: Example, i: int, done: str) -> tuple[str, str]:
    """(the rendering up to where assistant turn i's own text begins, the rendering with it).

    Normally the generation prompt. Reasoning templates (DeepSeek-R1's, Qwen3's) open the
    generation prompt with a think tag that the rendered history leaves out, so there the turn
    starts where the generation prompt and the full rendering part ways, provided the history
    without the generation prompt comes before that point (else the caller refuses the template).
    """
    prompt = fmt.render(ex, i, add_generation_prompt=True)
    full = fmt.render(ex, i + 1, add_generation_prompt=False)
    if full.startswith(prompt):
        return prompt, full
    shared = prompt[: _common_prefix_len(prompt, full)]
    before = fmt.render(ex, i, add_generation_prompt=False)
    return (shared if shared.startswith(before) and shared.startswith(done) else prompt), full


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def encode_all(fmt: ChatFormat, examples: list[Example], cutoff_len: int):
    """Encoded examples with at least one label token, and how many were dropped."""
    out, dropped = [], 0
    for ex in examples:
        ids, labels = encode_example(fmt, ex, cutoff_len)
        # The label of position i is predicted from position i - 1: a lone first token
        # teaches nothing.
        if any(label != IGNORE for label in labels[1:]):
            out.append((ids, labels))
        else:
            dropped += 1
    return out, dropped
