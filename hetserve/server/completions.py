"""/v1/completions: text or token-id prompts -> engine requests -> JSON or SSE chunks."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request

from hetserve.core.outputs import RequestOutput
from hetserve.errors import InvalidInputError
from hetserve.server.beam_serving import search_beams
from hetserve.server.protocol_completion import CompletionRequest
from hetserve.server.serving import OpenAIServing, chunk_writer
from hetserve.server.stream_merge import merge

NO_FIM = (
    "suffix (fill in the middle) needs a code model: this tokenizer has no FIM tokens (such "
    "as <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>)"
)


class CompletionServing(OpenAIServing):
    async def create(self, req: CompletionRequest, request: Request):
        prompt, stops = req.prompt, ()
        if req.suffix is not None:  # fill in the middle, with the model's own markers
            prompt, stops = self._fim(str(req.prompt), req.suffix)
        cut = req.truncate_prompt_tokens is not None  # tokenized whole, then cut
        prompts = await self._prompts(prompt, req.add_special_tokens, cut)
        base = f"cmpl-{uuid.uuid4().hex}"
        if req.use_beam_search:
            return await self.run_unless_disconnected(
                request, [], self._beams(req, base, prompts, request)
            )
        echo_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
        limit, _ = req.output_limit()

        def params(_i, _ids):  # with a suffix, a marker written means the middle is done
            return self.sampling_params(req, limit, req.logprobs, echo_lp, stops=stops)

        prediction = await self.prediction_ids(req)
        streams = self.start(base, prompts, params, req, request, prediction)
        if req.stream:
            return self.event_stream(base, streams, self._chunks(req, base, streams))
        work = self._collect(req, base, streams)
        return await self.run_unless_disconnected(request, streams, work)

    async def _beams(self, req: CompletionRequest, base: str, prompts, request: Request) -> dict:
        """vLLM's beam search (core/beam_search.py): n beams per prompt, best first."""
        found = await asyncio.gather(*(search_beams(self, req, ids, f"{base}-{i}", request)
                                       for i, (_, ids) in enumerate(prompts)))  # fmt: skip
        choices, completion = [], 0
        for i, (ids, beams) in enumerate(found):
            for j, beam in enumerate(beams):
                out = beam.tokens[len(ids) :]
                completion += len(out)
                text = self.tok.decode(out, skip_special_tokens=req.skip_special_tokens)
                choices.append({"index": i * req.n + j, "text": text, "logprobs": None,
                                "finish_reason": beam.finish_reason,
                                **({"prompt_token_ids": ids, "token_ids": out}
                                   if req.return_token_ids else {})})  # fmt: skip
        prompt = sum(len(ids) for ids, _ in found)
        return {"id": base, "object": "text_completion", "created": int(time.time()),
                "model": self.served_name(req), "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}  # fmt: skip

    def _fim(self, prefix: str, suffix: str) -> tuple[str, tuple[int, ...]]:
        """The fill-in-the-middle prompt and the markers' ids to stop at."""
        fim = self.tok.fim_prompt(prefix, suffix)
        if fim is None:
            raise InvalidInputError(NO_FIM, "suffix")
        return fim

    async def _prompts(
        self, prompt, special: bool, whole: bool = False
    ) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            return [(None, prompt)]  # a fresh list from the parser: no copy (~1M ids max)
        out = []
        for p in prompt:
            ids = await self.encode(p, special, whole) if isinstance(p, str) else list(p)
            if not ids:
                raise InvalidInputError("a prompt is empty; give at least one token", "prompt")
            out.append((p if isinstance(p, str) else None, ids))
        return out

    async def _collect(self, req: CompletionRequest, base: str, streams) -> dict:
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge(streams):
            finals[i] = out
        outs = [finals[i] for i in range(len(streams))]
        choices = [
            {
                "index": i * req.n + c.index,
                "text": (self._echo(out) if req.echo else "") + c.text,
                "logprobs": self._choice_logprobs(req, out, c),
                "finish_reason": c.finish_reason,
                **(
                    {"prompt_token_ids": out.prompt_token_ids, "token_ids": list(c.token_ids)}
                    if req.return_token_ids
                    else {}
                ),
                **(
                    {"prompt_logprobs": self.prompt_logprobs(out, req.prompt_logprobs)}
                    if req.prompt_logprobs is not None
                    else {}
                ),
            }
            for i, out in enumerate(outs)
            for c in out.outputs
        ]
        return {
            "id": base,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_name(req),
            "choices": choices,
            "usage": self.usage(outs),
        }

    async def _chunks(self, req: CompletionRequest, base: str, streams):
        opts = req.stream_options
        continuous = bool(opts and opts.continuous_usage_stats)
        chunk = chunk_writer(base, "text_completion", self.served_name(req))

        # (prompt, choice) -> (chars sent, tokens sent, finish sent)
        sent: dict[tuple[int, int], tuple[int, int, bool]] = {}
        finals: dict[int, RequestOutput] = {}
        echoed: dict[int, int] = {}
        async for i, out in merge(streams):
            finals[i] = out
            for c in out.outputs:
                first = (i, c.index) not in sent
                chars, ntok, done = sent.get((i, c.index), (0, 0, False))
                delta = c.text[chars:]
                if done or (not delta and c.finish_reason is None):
                    continue
                sent[(i, c.index)] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
                lp = None
                if req.logprobs is not None:
                    if req.echo and i not in echoed:  # the echoed prompt's characters
                        echoed[i] = sum(len(self.token_str(t)) for t in out.prompt_token_ids)
                    lp = self._delta_logprobs(req, out, c, ntok, chars + echoed.get(i, 0), first)
                choice = {
                    "index": i * req.n + c.index,
                    "text": (self._echo(out) if req.echo and first else "") + delta,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                }
                if req.return_token_ids:  # vLLM's: the prompt's with each choice's first chunk
                    if first:
                        choice["prompt_token_ids"] = out.prompt_token_ids
                    choice["token_ids"] = c.token_ids[ntok:]
                usage = self.usage(list(finals.values())) if continuous else None
                yield chunk([choice], usage)
        if opts and opts.include_usage:
            yield chunk([], self.usage(list(finals.values())))

    def _delta_logprobs(self, req, out: RequestOutput, c, ntok: int, offset: int, first: bool):
        """A chunk's logprobs: its new tokens, at `offset` (what was sent before them); under
        echo the first chunk also holds the prompt's, from 0, as the whole answer does."""
        assert req.logprobs is not None
        ids, entries = c.token_ids[ntok:], c.logprobs[ntok:]
        if req.echo and first:
            ids = out.prompt_token_ids + ids
            entries = (out.prompt_logprobs or []) + entries
            offset = 0
        return self.completion_logprobs(
            ids, entries, req.logprobs, offset, req.return_tokens_as_token_ids
        )

    def completion_logprobs(
        self, token_ids, entries, k: int, offset: int = 0, as_ids: bool = False
    ) -> dict:
        """OpenAI completions logprobs for `token_ids`; an entry of None (the first prompt
        token, under echo) has no logprob. `as_ids`: tokens named "token_id:ID" (vLLM's
        return_tokens_as_token_ids); the offsets stay the text's."""
        name = self.token_name if as_ids else self.token_str
        offsets = []
        for t in token_ids:
            offsets.append(offset)
            offset += len(self.token_str(t))
        return {
            "tokens": [name(t) for t in token_ids],
            "token_logprobs": [
                e[t].logprob if e else None for e, t in zip(entries, token_ids, strict=True)
            ],
            "top_logprobs": [
                {name(tid): lp.logprob for tid, lp in e.items() if lp.rank <= k}
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
        as_ids = req.return_tokens_as_token_ids
        if not req.echo:
            return self.completion_logprobs(c.token_ids, c.logprobs, req.logprobs, 0, as_ids)
        ids = out.prompt_token_ids + c.token_ids
        entries = (out.prompt_logprobs or []) + c.logprobs
        return self.completion_logprobs(ids, entries, req.logprobs, 0, as_ids)

