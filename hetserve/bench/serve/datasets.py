"""Workloads for `hetserve bench serve`: random, structured, ShareGPT and multi-turn.

A workload is a list of conversations; single-turn datasets have one request per conversation.
The Mooncake trace lives in `trace.py`. Datasets know nothing of HTTP: the client turns a
`BenchRequest` into a payload.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from hetserve.bench.model_facts import FIRST_SAFE_TOKEN_ID, TokenSpace
from hetserve.bench.serve.workload import (
    BenchRequest,
    Workload,
    fit_lengths,
    words_from_ids,
)
from hetserve.errors import InvalidInputError


def _length_range(mean: int, ratio: float, name: str) -> tuple[int, int]:
    if mean < 1:
        raise InvalidInputError(f"--random-{name}-len must be >= 1, got {mean}")
    low = max(1, math.floor(mean * (1.0 - ratio)))
    return low, max(low, math.ceil(mean * (1.0 + ratio)))


def random_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_ratio: float,
    space: TokenSpace,
    seed: int,
    max_model_len: int | None = None,
    fit_mode: str = "clip",
) -> Workload:
    """Token-id prompts with lengths uniform in mean*(1 +- range_ratio).

    With `prefix_ratio` p, the first p * (shortest input) tokens are the same in every prompt, so
    a prefix cache can serve that part: the knob for prefix-caching experiments.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise InvalidInputError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if not 0.0 <= prefix_ratio <= 1.0:
        raise InvalidInputError(f"--random-prefix-ratio must be in [0, 1], got {prefix_ratio}")
    rng = np.random.default_rng(seed)
    in_lo, in_hi = _length_range(input_len, range_ratio, "input")
    out_lo, out_hi = _length_range(output_len, range_ratio, "output")
    requests = [
        BenchRequest(prompt_len=int(i), output_len=int(o))
        for i, o in zip(
            rng.integers(in_lo, in_hi + 1, num_prompts),
            rng.integers(out_lo, out_hi + 1, num_prompts),
            strict=True,
        )
    ]
    notes = fit_lengths(requests, max_model_len, fit_mode)
    shortest = min((r.prompt_len for r in requests), default=0)
    prefix = space.draw(rng, int(shortest * prefix_ratio)).tolist()
    for r in requests:
        r.token_ids = prefix + space.draw(rng, r.prompt_len - len(prefix)).tolist()
    if prefix:
        notes.append(f"shared prefix: {len(prefix)} tokens in every prompt")
    return Workload("random", [[r] for r in requests], ignore_eos=True, notes=notes)


def structured_workload(base: Workload, ratio: float) -> Workload:
    """The random workload with every request whose position falls in the first `ratio` of
    each block of ten under `response_format: json_schema` (the 50 schemas of
    hetserve/testing/schemas.py in turn); the rest as they were."""
    from hetserve.testing.schemas import schema_set

    if not 0.0 <= ratio <= 1.0:
        raise InvalidInputError(f"--structured-ratio must be in [0, 1], got {ratio}")
    schemas = schema_set(50)
    marked = 0
    for i, conv in enumerate(base.conversations):
        if (i % 10) < round(ratio * 10):
            schema = schemas[marked % len(schemas)]
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{marked % 50}",
                   "schema": schema, "strict": True}}  # fmt: skip
            conv[0].response_format = fmt
            marked += 1
    base.name = "structured"
    base.notes.append(f"{marked} of {base.num_requests} requests under json_schema")
    return base


def without_grammars(workload: Workload) -> Workload:
    """The same requests with no response_format: the baseline the structured run is
    compared with."""
    convs = [[replace(r, response_format=None) for r in c] for c in workload.conversations]
    return replace(workload, name="structured-baseline", conversations=convs, notes=[])


def _word_ids(rng: np.random.Generator, n: int) -> list[int]:
    # Only picks words (see words_from_ids); the range is kept so seeds give the texts they gave.
    return rng.integers(FIRST_SAFE_TOKEN_ID, 1 << 20, n).tolist()


class _Lengths:
    """Token counts from a tokenizer.json when given, else estimated at 4 characters a token."""

    def __init__(self, tokenizer_path: str | None) -> None:
        self.tokenizer = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer

            path = Path(tokenizer_path)
            path = path / "tokenizer.json" if path.is_dir() else path
            if not path.is_file():
                raise InvalidInputError(f"--tokenizer: no tokenizer.json at {tokenizer_path}")
            self.tokenizer = Tokenizer.from_file(str(path))

    @property
    def note(self) -> str | None:
        return None if self.tokenizer else "text lengths estimated at 4 characters per token"

    def __call__(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return max(1, round(len(text) / 4))


def _load_sharegpt(path: str) -> list[list[str]]:
    """Each conversation as its alternating message texts, human first."""
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(f"--dataset-path: file not found: {path}")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"--dataset-path: {path} is not JSON ({exc})") from exc
    if not isinstance(data, list):
        raise InvalidInputError(f"--dataset-path: {path} is not a ShareGPT list of conversations")
    convs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            continue
        texts = [t.get("value", "") for t in turns if isinstance(t, dict)]
        # Skip conversations that open with the assistant: there is no prompt to send.
        if texts and isinstance(turns[0], dict) and turns[0].get("from") in ("human", "user"):
            convs.append(texts)
    return convs


def sharegpt_workload(
    path: str,
    num_prompts: int,
    output_len: int | None,
    tokenizer: str | None,
    seed: int,
    max_model_len: int | None = None,
    fit_mode: str = "clip",
    vllm_filter: bool = True,
) -> Workload:
    """First human message as prompt; output length is that of the reply.

    `vllm_filter` drops prompts over 1024 tokens and pairs over 2048, as vLLM's benchmark does
    (so numbers compare); what is kept is then fitted to `max_model_len`.
    """
    if output_len is not None and output_len < 1:
        raise InvalidInputError(f"--sharegpt-output-len must be >= 1, got {output_len}")
    lengths = _Lengths(tokenizer)
    convs = [c for c in _load_sharegpt(path) if len(c) >= 2]
    np.random.default_rng(seed).shuffle(convs)
    requests: list[BenchRequest] = []
    for conv in convs:
        if len(requests) == num_prompts:
            break
        plen = lengths(conv[0])
        olen = output_len if output_len is not None else lengths(conv[1])
        # vLLM's benchmark drops tiny and over-long pairs; keep its rules so numbers compare.
        if plen < 4 or olen < 4 or (vllm_filter and (plen > 1024 or plen + olen > 2048)):
            continue
        requests.append(BenchRequest(prompt_len=plen, output_len=olen, text=conv[0]))
    if not requests:
        raise InvalidInputError(f"--dataset-path: no usable ShareGPT conversations in {path}")
    notes = [n for n in (lengths.note,) if n]
    if len(requests) < num_prompts:
        notes.append(f"only {len(requests)} usable conversations of the {num_prompts} asked for")
    originals = [r.prompt_len for r in requests]
    notes += fit_lengths(requests, max_model_len, fit_mode)
    for r, original in zip(requests, originals, strict=True):
        _cut_text(r, original)
    return Workload("sharegpt", [[r] for r in requests], ignore_eos=False, notes=notes)


def _cut_text(r: BenchRequest, original_len: int) -> None:
    """Shorten the text in proportion to a reduced prompt_len (exact only with a tokenizer)."""
    if r.text is not None and r.prompt_len < original_len:
        r.text = r.text[: max(1, len(r.text) * r.prompt_len // original_len)]


def multiturn_workload(
    num_conversations: int,
    turns: int,
    user_len: int,
    output_len: int,
    path: str | None,
    tokenizer: str | None,
    seed: int,
    max_model_len: int | None = None,
) -> Workload:
    """Conversations whose every turn resends the whole history (the prefix-cache workload).

    User messages come from ShareGPT human turns when a file is given, else random words. The
    assistant messages are the server's real replies, appended by the runner as it goes.
    """
    for name, value in (("turns", turns), ("user-len", user_len), ("output-len", output_len)):
        if value < 1:
            raise InvalidInputError(f"--multiturn-{name} must be >= 1, got {value}")
    rng = np.random.default_rng(seed)
    lengths = _Lengths(tokenizer)
    if path is not None:
        sources = [c[0::2] for c in _load_sharegpt(path) if len(c) >= 2]
        if not sources:
            raise InvalidInputError(f"--dataset-path: no ShareGPT conversations in {path}")
        rng.shuffle(sources)
    conversations: list[list[BenchRequest]] = []
    for i in range(num_conversations):
        if path is not None:
            users = sources[i % len(sources)][:turns]
        else:
            users = [words_from_ids(_word_ids(rng, user_len)) for _ in range(turns)]
        conversations.append(
            [
                BenchRequest(
                    prompt_len=lengths(u) if path is not None else user_len,
                    output_len=output_len,
                    text=u,
                )
                for u in users
            ]
        )
    notes = [n for n in (lengths.note,) if n and path is not None]
    notes.append("input tokens of a turn count its history only when the server reports usage")
    if max_model_len is not None:
        notes.append(_fit_conversations(conversations, max_model_len))
    return Workload("multiturn", conversations, ignore_eos=True, notes=notes)


def _fit_conversations(conversations: list[list[BenchRequest]], max_model_len: int) -> str:
    """Drop the turns whose history (estimated) would no longer fit the model."""
    changed = 0
    for conv in conversations:
        total, keep = 0, 0
        for r in conv:
            total += r.prompt_len + r.output_len
            if total > max_model_len:
                break
            keep += 1
        if keep < len(conv):
            changed += 1
            del conv[max(1, keep) :]
            first, original = conv[0], conv[0].prompt_len
            first.output_len = min(first.output_len, max(1, max_model_len // 2))
            first.prompt_len = min(first.prompt_len, max_model_len - first.output_len)
            _cut_text(first, original)
    return f"context {max_model_len}: cut turns from {changed} conversations"
