"""OpenAI completions and chat completions on top of AsyncLLM: request -> engine requests ->
JSON or SSE chunks. Only the engine's public API is used."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from hetserve.core.outputs import RequestOutput
from hetserve.core.sampling import SamplingParams
from hetserve.engine.async_llm import AsyncLLM
from hetserve.errors import InvalidInputError
from hetserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _Common,
    message_text,
)


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tok = engine.tokenizer

    # ---- shared -----------------------------------------------------------------------------
    def _params(
        self,
        req: _Common,
        prompt_len: int,
        max_tokens: int | None,
        logprobs,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        room = self.engine.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = room
        if max_tokens > room:
            raise InvalidInputError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"model's context of {self.engine.max_model_len} tokens; lower max_tokens"
            )
        try:
            return SamplingParams(
                n=req.n,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                max_tokens=max_tokens,
                min_tokens=min(req.min_tokens, max_tokens),
                stop=req.stop or (),
                stop_token_ids=req.stop_token_ids or (),
                ignore_eos=req.ignore_eos,
                seed=req.seed,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None

    def _prompt_ids(self, prompt) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            return [(prompt, self.tok.encode(prompt))]
        if prompt and isinstance(prompt[0], int):
            return [(None, list(prompt))]
        if prompt and isinstance(prompt[0], str):
            return [(p, self.tok.encode(p)) for p in prompt]
        return [(None, list(p)) for p in prompt]

    async def _collect(self, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        async def last(gen):
            final = None
            async for out in gen:
                final = out
            return final

        return await asyncio.gather(*(last(g) for g in gens))

    def _usage(self, outs: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _token_str(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False)

    # ---- /v1/completions --------------------------------------------------------------------
    def start_completion(self, req: CompletionRequest):
        prompts = self._prompt_ids(req.prompt)
        if any(not ids for _, ids in prompts):
            raise InvalidInputError("a prompt is empty; give at least one token")
        base = f"cmpl-{uuid.uuid4().hex}"
        gens = []
        for i, (text, ids) in enumerate(prompts):
            self.engine.engine.validate_prompt(ids)
            echo_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
            params = self._params(req, len(ids), req.max_tokens, req.logprobs, echo_lp)
            gens.append(
                self.engine.generate(f"{base}-{i}", ids, params, prompt=text, priority=req.priority)
            )
        return base, gens

    def _completion_logprobs(self, token_ids, entries, k: int, offset: int = 0) -> dict:
        """OpenAI completions logprobs for `token_ids`; an entry of None (the first prompt
        token, under echo) has no logprob."""
        tokens = [self._token_str(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [
                e[t].logprob if e else None for e, t in zip(entries, token_ids, strict=True)
            ],
            "top_logprobs": [
                {self._token_str(tid): lp.logprob for tid, lp in e.items() if lp.rank <= k}
                if e
                else None
                for e in entries
            ],
            "text_offset": offsets,
        }

    def _echo(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tok.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _choice_logprobs(self, req: CompletionRequest, out: RequestOutput, c) -> dict | None:
        if req.logprobs is None:
            return None
        if not req.echo:
            return self._completion_logprobs(c.token_ids, c.logprobs, req.logprobs)
        ids = out.prompt_token_ids + c.token_ids
        return self._completion_logprobs(
            ids, (out.prompt_logprobs or []) + c.logprobs, req.logprobs
        )

    async def completion(self, req: CompletionRequest, base: str, gens) -> dict:
        outs = await self._collect(gens)
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                choices.append(
                    {
                        "index": i * req.n + c.index,
                        "text": (self._echo(out) if req.echo else "") + c.text,
                        "logprobs": self._choice_logprobs(req, out, c),
                        "finish_reason": c.finish_reason,
                    }
                )
        return {
            "id": base,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": self._usage(outs),
        }

    async def completion_stream(self, req: CompletionRequest, base: str, gens):
        created = int(time.time())
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, gen):
            async for out in gen:
                await queue.put((i, out))
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        # (prompt, choice) -> (chars sent, tokens sent, finish sent)
        sent: dict[tuple[int, int], tuple[int, int, bool]] = {}
        finals: dict[int, RequestOutput] = {}
        try:
            live = len(tasks)
            while live:
                i, out = await queue.get()
                if out is None:
                    live -= 1
                    continue
                finals[i] = out
                for c in out.outputs:
                    first = (i, c.index) not in sent
                    chars, ntok, done = sent.get((i, c.index), (0, 0, False))
                    delta = c.text[chars:]
                    if done or (not delta and c.finish_reason is None):
                        continue
                    sent[(i, c.index)] = (
                        len(c.text),
                        len(c.token_ids),
                        c.finish_reason is not None,
                    )
                    lp = None
                    if req.logprobs is not None:
                        lp = self._completion_logprobs(
                            c.token_ids[ntok:], c.logprobs[ntok:], req.logprobs, chars
                        )
                    choice = {
                        "index": i * req.n + c.index,
                        "text": (self._echo(out) if req.echo and first else "") + delta,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                    }
                    yield sse(
                        {
                            "id": base,
                            "object": "text_completion",
                            "created": created,
                            "model": self.model_name,
                            "choices": [choice],
                        }
                    )
            if req.stream_options and req.stream_options.include_usage:
                yield sse(
                    {
                        "id": base,
                        "object": "text_completion",
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": self._usage(list(finals.values())),
                    }
                )
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for g in gens:
                await g.aclose()

    # ---- /v1/chat/completions ---------------------------------------------------------------
    def start_chat(self, req: ChatCompletionRequest):
        messages = [{"role": m.role, "content": message_text(m)} for m in req.messages]
        prompt = self.tok.apply_chat_template(messages, req.add_generation_prompt)
        ids = self.tok.encode(prompt, add_special_tokens=False)
        self.engine.engine.validate_prompt(ids)
        max_tokens = req.max_completion_tokens or req.max_tokens
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = self._params(req, len(ids), max_tokens, k)
        base = f"chatcmpl-{uuid.uuid4().hex}"
        return base, self.engine.generate(base, ids, params, prompt=prompt, priority=req.priority)

    def _chat_logprobs(self, token_ids, entries, k: int) -> dict:
        def item(tid, lp):
            s = self._token_str(tid)
            return {"token": s, "logprob": lp.logprob, "bytes": list(s.encode())}

        content = []
        for e, t in zip(entries, token_ids, strict=True):
            entry = item(t, e[t])
            ranked = sorted(e.items(), key=lambda x: x[1].rank)
            entry["top_logprobs"] = [item(tid, lp) for tid, lp in ranked if lp.rank <= k]
            content.append(entry)
        return {"content": content}

    async def chat(self, req: ChatCompletionRequest, base: str, gen) -> dict:
        (out,) = await self._collect([gen])
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": (
                    self._chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                    if req.logprobs
                    else None
                ),
                "finish_reason": c.finish_reason,
            }
            for c in out.outputs
        ]
        return {
            "id": base,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": self._usage([out]),
        }

    async def chat_stream(self, req: ChatCompletionRequest, base: str, gen):
        created = int(time.time())

        def chunk(choices, **extra):
            return sse(
                {
                    "id": base,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": self.model_name,
                    "choices": choices,
                    **extra,
                }
            )

        try:
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(req.n)
                ]
            )
            # choice -> (chars sent, tokens sent, finish sent)
            sent: dict[int, tuple[int, int, bool]] = {}
            last = None
            async for out in gen:
                last = out
                for c in out.outputs:
                    chars, ntok, done = sent.get(c.index, (0, 0, False))
                    delta = c.text[chars:]
                    if done or (not delta and c.finish_reason is None):
                        continue
                    sent[c.index] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
                    lp = None
                    if req.logprobs:
                        lp = self._chat_logprobs(
                            c.token_ids[ntok:], c.logprobs[ntok:], req.top_logprobs or 0
                        )
                    choice = {
                        "index": c.index,
                        "delta": {"content": delta} if delta else {},
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                    }
                    yield chunk([choice])
            if req.stream_options and req.stream_options.include_usage and last is not None:
                yield chunk([], usage=self._usage([last]))
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()
