"""One streaming request to an OpenAI-compatible server, timed token by token.

Speaks `/v1/completions` and `/v1/chat/completions` with `stream: true`. Never raises for what the
server does: HTTP errors, broken streams and timeouts come back as a failed `RequestResult`, so one
bad request cannot end a benchmark.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from hetserve.bench.serve.workload import BenchRequest, Workload, words_from_ids

Clock = Callable[[], float]


@dataclass
class RequestResult:
    """What one request did, in seconds on the runner's clock."""

    send_s: float
    prompt_len: int  # from the server's usage when it reports one, else the dataset's count
    token_s: list[float] = field(default_factory=list)  # arrival of each chunk with content
    end_s: float = 0.0
    output_tokens: int = 0
    usage_from_server: bool = False
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.token_s[0] - self.send_s

    @property
    def e2e(self) -> float:
        return self.end_s - self.send_s

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's definition); None for one token."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_s, self.token_s[1:], strict=False)]


def is_chat(endpoint: str) -> bool:
    return "chat" in endpoint


def build_payload(
    endpoint: str,
    model: str,
    request: BenchRequest,
    history: list[dict[str, str]] | None,
    workload: Workload,
    ignore_eos: bool,
) -> dict[str, Any]:
    """The JSON body. `history`: earlier turns of a multi-turn conversation (None: single turn).

    On the completions endpoint a conversation is flattened to `role: text` lines, the first turn
    too, so each turn's prompt starts with the previous one (what a prefix cache can reuse).
    """
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # a vLLM/SGLang extension; only sent when asked, strict servers reject it
        body["ignore_eos"] = True
    if request.response_format is not None:
        body["response_format"] = request.response_format
    if request.hash_ids is not None:
        assert workload.block_tokens is not None
        prompt: str | list[int] = workload.block_tokens.prompt(request.hash_ids, request.prompt_len)
    elif request.token_ids is not None:
        prompt = request.token_ids
    else:
        assert request.text is not None
        prompt = request.text
    if is_chat(endpoint):
        text = prompt if isinstance(prompt, str) else words_from_ids(prompt)
        body["messages"] = [*(history or []), {"role": "user", "content": text}]
    elif history is not None:
        assert isinstance(prompt, str), "multi-turn prompts are text"
        turns = [*history, {"role": "user", "content": prompt}]
        body["prompt"] = "".join(f"{m['role']}: {m['content']}\n" for m in turns) + "assistant:"
    else:
        body["prompt"] = prompt
    return body


def _content(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        text = (choices[0].get("delta") or {}).get("content") or ""
    else:
        text = choices[0].get("text") or ""
    if not isinstance(text, str):
        raise TypeError(f"content is {type(text).__name__}, not text")
    return text


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    payload: dict[str, Any],
    prompt_len: int,
    clock: Clock = time.perf_counter,
) -> RequestResult:
    """POST and read the SSE stream; the result records the arrival time of every content chunk."""
    chat = "messages" in payload
    # Serialized before the clock starts: a long token-id prompt takes milliseconds to encode,
    # and that is our time, not the server's.
    data = json.dumps(payload).encode()
    headers = {**headers, "Content-Type": "application/json"}
    result = RequestResult(send_s=clock(), prompt_len=prompt_len)
    try:
        async with session.post(url, data=data, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.text())[:200].replace("\n", " ")
                result.error = f"HTTP {resp.status}: {body}"
                return _finish(result, clock)
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments (keep-alives)
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                _on_chunk(result, json.loads(data), chat, clock)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    if result.error is None and not result.token_s:
        result.error = "stream ended without any content"
    return _finish(result, clock)


def _on_chunk(result: RequestResult, chunk: Any, chat: bool, clock: Clock) -> None:
    if isinstance(chunk, dict) and "error" in chunk:  # how servers report mid-stream failures
        err = chunk["error"]
        raise ValueError(err.get("message", err) if isinstance(err, dict) else err)
    try:
        text = _content(chunk, chat)
        usage = chunk.get("usage")
        completion_tokens = None if not usage else usage.get("completion_tokens")
        if completion_tokens is not None:
            completion_tokens = int(completion_tokens)
            prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_len)
    except (AttributeError, TypeError, IndexError, ValueError) as exc:
        # A server's malformed chunk fails this request only, never the whole benchmark.
        raise ValueError(f"malformed stream chunk {json.dumps(chunk)[:80]}") from exc
    if text:
        result.token_s.append(clock())
        result.text += text
    elif not result.token_s and _finished(chunk):
        # A token whose text is empty (part of a character, a special token) still came: a
        # one-token reply that decodes to nothing is an answer, not a failure.
        result.token_s.append(clock())
    if completion_tokens is not None:
        result.usage_from_server = True
        result.output_tokens = completion_tokens
        result.prompt_len = prompt_tokens


def _finished(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices") or []
    return bool(choices) and choices[0].get("finish_reason") is not None


def _finish(result: RequestResult, clock: Clock) -> RequestResult:
    result.end_s = clock()
    if not result.usage_from_server:
        # No usage from the server: one token per content chunk, as the OpenAI stream sends them.
        result.output_tokens = len(result.token_s)
    return result
