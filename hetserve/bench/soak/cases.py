"""What a soak sends: well-formed requests, requests it abandons, and hostile ones.

Each `Case` makes an `Attempt` (the bytes to POST and how to judge the answer). Good cases must
complete; disconnect cases are cut by the client on purpose; bad cases must be answered with a
4xx OpenAI error JSON (the statuses in `expect`). The bad ones are the defects of issue 12, so a
server that regresses on any of them shows it here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetserve.bench.model_facts import TokenSpace
from hetserve.bench.serve.workload import words_from_ids

GOOD, DISCONNECT, BAD = "good", "disconnect", "bad"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Room left in the context for a chat template around the prompt and for our word estimate.
_PROMPT_ROOM = 128
_UPLOAD_CHUNK = 64 << 10
# A 1x1 PNG: an image part a text-only server must refuse rather than silently drop.
_PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    "YPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)


@dataclass(frozen=True)
class Context:
    """What cases know of the server: model name, vocabulary and context (None: unknown)."""

    model: str
    vocab_size: int | None
    max_model_len: int | None
    space: TokenSpace | None  # token ids for prompts; None: text prompts only
    max_tokens: int = 32  # longest output of a good request
    oversized_bytes: int = 9 << 20


@dataclass
class Attempt:
    """One HTTP request and how to judge its answer."""

    endpoint: str
    body: bytes | Callable[[], AsyncIterator[bytes]]  # bytes, or a chunked upload
    stream: bool
    cut_after_chunks: int | None = None  # disconnect mid-stream after this many chunks
    cut_after_s: float | None = None  # disconnect if the answer has not come by then
    expect: tuple[int, ...] = ()  # bad requests: the right 4xx statuses


@dataclass(frozen=True)
class Case:
    name: str
    group: str  # GOOD, DISCONNECT or BAD
    weight: int  # how many of each deck of shuffled cases
    make: Callable[[Context, np.random.Generator], Attempt]
    max_in_flight: int | None = None  # heavy cases: at most this many at once


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _text(rng: np.random.Generator, n: int) -> str:
    return words_from_ids(rng.integers(0, 1 << 20, n).tolist())


def _prompt(ctx: Context, rng: np.random.Generator) -> str | list[int]:
    n = int(rng.integers(8, 65))
    if ctx.space is not None and rng.random() < 0.5:
        return ctx.space.draw(rng, n).tolist()
    return _text(rng, n)


def _out_len(ctx: Context, rng: np.random.Generator, longest: int) -> int:
    if ctx.max_model_len is not None:
        longest = min(longest, max(1, ctx.max_model_len - _PROMPT_ROOM))
    return int(rng.integers(1, longest + 1))


def _sampling(ctx: Context, rng: np.random.Generator, longest: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": ctx.model, "max_tokens": _out_len(ctx, rng, longest)}
    if rng.random() < 0.5:
        body |= {"temperature": 0.8, "seed": int(rng.integers(0, 1 << 31))}
    else:
        body["temperature"] = 0.0
    return body


def _completion(ctx: Context, rng: np.random.Generator, stream: bool, longest: int) -> dict:
    body = {**_sampling(ctx, rng, longest), "prompt": _prompt(ctx, rng), "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _chat(ctx: Context, rng: np.random.Generator, stream: bool, longest: int) -> dict:
    text = _text(rng, int(rng.integers(8, 65)))
    body = {**_sampling(ctx, rng, longest), "messages": [{"role": "user", "content": text}]}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _good(endpoint: str, stream: bool) -> Callable[[Context, np.random.Generator], Attempt]:
    build = _chat if endpoint == CHAT else _completion

    def make(ctx: Context, rng: np.random.Generator) -> Attempt:
        return Attempt(endpoint, _json(build(ctx, rng, stream, ctx.max_tokens)), stream)

    return make


# A small object schema: the tool's parameters and a response format.
_WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _constrained(extra: dict[str, Any]) -> Callable[[Context, np.random.Generator], Attempt]:
    """A chat request under a grammar (forced tool call or JSON schema): it must complete."""

    def make(ctx: Context, rng: np.random.Generator) -> Attempt:
        stream = bool(rng.random() < 0.5)
        return Attempt(CHAT, _json({**_chat(ctx, rng, stream, ctx.max_tokens), **extra}), stream)

    return make


def _long(ctx: Context) -> dict[str, Any]:
    """Output settings of a request that is still running when the client walks away."""
    room = 256 if ctx.max_model_len is None else ctx.max_model_len - _PROMPT_ROOM
    return {"max_tokens": max(1, min(256, room)), "ignore_eos": True}


def _stream_cut(ctx: Context, rng: np.random.Generator) -> Attempt:
    endpoint = CHAT if rng.random() < 0.5 else COMPLETIONS
    build = _chat if endpoint == CHAT else _completion
    body = {**build(ctx, rng, True, 1), **_long(ctx)}
    return Attempt(endpoint, _json(body), True, cut_after_chunks=int(rng.integers(2, 6)))


def _request_cut(ctx: Context, rng: np.random.Generator) -> Attempt:
    body = {**_completion(ctx, rng, False, 1), **_long(ctx)}
    return Attempt(COMPLETIONS, _json(body), False, cut_after_s=float(rng.uniform(0.05, 0.5)))


def _bad(endpoint: str, body: Callable[[Context], dict[str, Any] | bytes], *expect: int,
         stream: bool = False) -> Callable[[Context, np.random.Generator], Attempt]:  # fmt: skip
    def make(ctx: Context, rng: np.random.Generator) -> Attempt:
        made = body(ctx)
        data = made if isinstance(made, bytes) else _json(made)
        return Attempt(endpoint, data, stream, expect=expect or (400,))

    return make


def _user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def _oversized(ctx: Context, rng: np.random.Generator) -> Attempt:
    """A valid JSON body over the size limit, sent chunked (no Content-Length to check)."""

    async def chunks() -> AsyncIterator[bytes]:
        head = f'{{"model": {json.dumps(ctx.model)}, "max_tokens": 4, "prompt": "'.encode()
        yield head
        filler = b"the " * (_UPLOAD_CHUNK // 4)
        for _ in range(ctx.oversized_bytes // len(filler) + 1):
            yield filler
        yield b'"}'

    return Attempt(COMPLETIONS, chunks, False, expect=(413,))


def _oov(ctx: Context) -> int:
    return ctx.vocab_size if ctx.vocab_size is not None else (1 << 31) - 1


CASES: tuple[Case, ...] = (
    Case("completion", GOOD, 6, _good(COMPLETIONS, stream=False)),
    Case("completion-stream", GOOD, 8, _good(COMPLETIONS, stream=True)),
    Case("chat", GOOD, 5, _good(CHAT, stream=False)),
    Case("chat-stream", GOOD, 7, _good(CHAT, stream=True)),
    Case("chat-tools-required", GOOD, 1, _constrained({
        "tool_choice": "required", "tools": [{"type": "function", "function": {
            "name": "weather", "parameters": _WEATHER}}]})),
    Case("chat-json-schema", GOOD, 1, _constrained({"response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": _WEATHER}}})),
    Case("disconnect-mid-stream", DISCONNECT, 4, _stream_cut),
    Case("disconnect-mid-request", DISCONNECT, 3, _request_cut),
    Case("bad-json", BAD, 1, _bad(COMPLETIONS, lambda c: b'{"model": "m", "prompt": "hi", ')),
    Case("wrong-types", BAD, 1, _bad(COMPLETIONS, lambda c: {
        "model": c.model, "prompt": {"text": 5}, "max_tokens": "many"}, 400, 422)),
    Case("token-id-outside-vocab", BAD, 1, _bad(COMPLETIONS, lambda c: {
        "model": c.model, "prompt": [11, _oov(c)], "max_tokens": 4})),
    Case("huge-max-tokens", BAD, 1, _bad(COMPLETIONS, lambda c: {
        "model": c.model, "prompt": "hello", "max_tokens": 10**9})),
    Case("unknown-model", BAD, 1, _bad(CHAT, lambda c: {
        "model": "no-such-model-7f3a", "messages": _user("hi"), "max_tokens": 4}, 404, 400)),
    Case("stop-token-id-outside-vocab", BAD, 1, _bad(COMPLETIONS, lambda c: {
        "model": c.model, "prompt": "hello", "max_tokens": 8, "min_tokens": 4,
        "stop_token_ids": [1_000_000_000]})),
    Case("seed-over-64-bits", BAD, 1, _bad(COMPLETIONS, lambda c: {
        "model": c.model, "prompt": "hi", "max_tokens": 8, "seed": 1 << 64, "stream": True},
        stream=True)),
    Case("nan-temperature", BAD, 1, _bad(COMPLETIONS, lambda c: (
        f'{{"model": {json.dumps(c.model)}, "prompt": "hi", "temperature": NaN}}'.encode()))),
    Case("text-part-not-text", BAD, 1, _bad(CHAT, lambda c: {
        "model": c.model, "messages": _user([{"type": "text", "text": 123}])})),
    Case("tool-without-name", BAD, 1, _bad(CHAT, lambda c: {
        "model": c.model, "messages": _user("weather?"), "tool_choice": "required",
        "tools": [{"type": "function", "function": {"parameters": _WEATHER}}]})),
    Case("json-schema-not-a-schema", BAD, 1, _bad(CHAT, lambda c: {
        "model": c.model, "messages": _user("a name"), "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": 5}}}})),
    Case("image-url-part", BAD, 1, _bad(CHAT, lambda c: {
        "model": c.model, "messages": _user([{"type": "text", "text": "what is this?"},
                                             {"type": "image_url", "image_url": {"url": _PNG}}])})),
    Case("chunked-oversized-body", BAD, 1, _oversized, max_in_flight=1),
)  # fmt: skip


def select_cases(skip: list[str]) -> tuple[Case, ...]:
    """Every case but the skipped ones; an unknown name is a ValueError naming the known ones."""
    names = {c.name for c in CASES}
    unknown = [s for s in skip if s not in names]
    if unknown:
        raise ValueError(f"unknown case {unknown[0]!r}; cases: {', '.join(sorted(names))}")
    return tuple(c for c in CASES if c.name not in skip)
