"""What the OpenAI handlers share: turning a request into engine requests, and running them so
that nothing is lost whatever the client or the engine does.

Only the engine's public API is used (`AsyncLLM.submit` of a `NewRequest`, its
`RequestStream`).
- Long prompts are rendered and tokenized on a worker thread (the tokenizer releases the GIL
  there), after a cheap length bound rejects texts that cannot fit the context.
- A non-streaming request is cancelled when its client disconnects (a task waits for the
  ASGI disconnect); a streaming one when the response is cancelled. Either way every engine
  request is aborted and its KV blocks freed.
- A stream always ends with `data: [DONE]`, after an error event if anything failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Coroutine

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from hetserve.config import SchedulingPolicy
from hetserve.core.block_hash import salt_extra
from hetserve.core.outputs import RequestOutput
from hetserve.core.request import HandoffPath, HandoffRole, KVHandoff, NewRequest
from hetserve.core.sampling import SamplingParams
from hetserve.engine.async_llm import AsyncLLM, RequestStream
from hetserve.errors import InvalidInputError, PromptTooLongError
from hetserve.server.errors import sse_error
from hetserve.server.protocol import _Common

log = logging.getLogger(__name__)

INLINE_CHARS = 16_384  # shorter texts are tokenized on the event loop (a thread hop costs more)
DONE = "data: [DONE]\n\n"
PRIORITY = SchedulingPolicy.PRIORITY


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def arrival_time(request: Request) -> float:
    """When the request reached the server (set by the ASGI guard), for TTFT from arrival."""
    return request.scope.get("hetserve.arrival") or time.monotonic()


def chunk_writer(base: str, kind: str, model: str):
    """`chunk(choices, usage=None, **extra)` -> one SSE event of a stream: id, object `kind`,
    the time the stream started, model, choices, usage where given, and any `extra` fields."""
    created = int(time.time())

    def chunk(choices: list, usage: dict | None = None, **extra) -> str:
        body = {"id": base, "object": kind, "created": created, "model": model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return sse(body | extra)

    return chunk


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tok = engine.tokenizer
        self._told_prediction = False  # predictions without speculative decoding: said once

    # ---- request -> engine requests -----------------------------------------------------------
    def served_name(self, req: _Common) -> str:
        """The model a response names: the one asked for (the base or a LoRA adapter)."""
        return req.model or self.model_name

    def lora_of(self, req: _Common) -> str | None:
        """The LoRA adapter a request picks with its `model` field (the app has already
        answered 404 for a name that is neither the base model nor a loaded adapter)."""
        return None if req.model in (None, self.model_name) else req.model

    async def encode(
        self, text: str, add_special_tokens: bool = True, whole: bool = False
    ) -> list[int]:
        """The text's token ids. A text too long to fit the context however it tokenizes is
        refused before the work, unless `whole`: /tokenize counts it, and a prompt truncated
        to its last tokens is cut after (the body limit bounds it then)."""
        limit = 2 * self.engine.max_model_len * self.tok.max_token_chars
        if len(text) > limit and not whole:
            raise PromptTooLongError(
                f"prompt of {len(text)} characters cannot fit the model's context of "
                f"{self.engine.max_model_len} tokens; shorten it",
                param="prompt",
            )
        return await self._tokenized(text, add_special_tokens)

    async def _tokenized(self, text: str, add_special_tokens: bool) -> list[int]:
        """Short texts on the event loop, long ones on a worker thread."""
        if len(text) <= INLINE_CHARS:
            return self.tok.encode(text, add_special_tokens)
        return await asyncio.to_thread(self.tok.encode_long, text, add_special_tokens)

    async def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> str:
        size = sum(len(m.get("content") or "") for m in messages)
        render = functools.partial(self.tok.apply_chat_template, tools=tools, **kwargs)
        if size <= INLINE_CHARS:
            return render(messages, add_generation_prompt)
        return await asyncio.to_thread(render, messages, add_generation_prompt)

    def sampling_params(
        self,
        req: _Common,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_lp=None,
        specials: bool = False,
        stops: tuple[int, ...] = (),
    ) -> SamplingParams:
        """`specials`: keep special tokens in the text (a parser reads its markers). `stops`:
        token ids that end the output beside the request's (a fill in the middle's markers)."""
        try:
            return SamplingParams(
                n=req.n,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.resolved_top_k(),
                min_p=req.min_p,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop or (),
                stop_token_ids=(*(req.stop_token_ids or ()), *stops),
                ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                seed=req.seed,
                logprobs=logprobs,
                prompt_logprobs=_most(prompt_lp, req.prompt_logprobs),
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                logit_bias=req.logit_bias_ids(),
                allowed_token_ids=req.allowed_token_ids or (),
                bad_words_token_ids=self.tok.bad_word_ids(req.bad_words or ()),
                skip_special_tokens=req.skip_special_tokens and not specials,
            )
        except ValueError as exc:
            raise InvalidInputError(str(exc), param=str(exc).split(" ", 1)[0]) from None

    def grammar_of(self, req: _Common):
        """The grammar the request's output must match (a subclass may add tool choices)."""
        return req.grammar

    def check_priority(self, req: _Common) -> None:
        # vLLM: a priority other than 0 is an error unless the scheduler orders by it.
        if req.priority != 0 and self.engine.config.scheduler.policy is not PRIORITY:
            raise InvalidInputError(
                "priority needs a server started with --scheduling-policy priority",
                "priority",
            )

    def check_room(self, req: _Common, prompt_len: int) -> None:
        """The output limit (and min_tokens) against the context left after the prompt, naming
        the field the client set; the engine checks it too, but knows only max_tokens."""
        room = self.engine.max_model_len - prompt_len
        if room < 1:
            return  # the engine refuses the prompt itself
        _, name = req.output_limit()
        limit = req.limit_for(prompt_len, self.engine.max_model_len)
        if limit is not None and limit > room:
            given = "" if name in req.model_fields_set else ", the default"
            raise PromptTooLongError(  # too long for the context with its output
                f"prompt ({prompt_len} tokens) plus {name} ({limit}{given}) exceeds the model's "
                f"context of {self.engine.max_model_len} tokens; lower {name}",
                name,
            )
        if req.min_tokens > room:
            raise PromptTooLongError(
                f"min_tokens ({req.min_tokens}) exceeds the {room} tokens left in the "
                f"model's context after the prompt ({prompt_len} tokens)",
                "min_tokens",
            )

    async def prediction_ids(self, req: _Common) -> list[int] | None:
        """The request's `prediction` (OpenAI's Predicted Outputs) as token ids, None without
        one. Longer than the context could hold: refused."""
        if req.prediction is None:
            return None
        if self.engine.config.speculative is None and not self._told_prediction:
            self._told_prediction = True
            log.info("a request sent a prediction: start the server with --speculative-config "
                     "'{\"method\": \"ngram\"}' for drafts to follow it (the output is the "
                     "same either way)")  # fmt: skip
        text = req.prediction.text
        if len(text) > 2 * self.engine.max_model_len * self.tok.max_token_chars:
            raise InvalidInputError(
                f"prediction of {len(text)} characters cannot fit the model's context of "
                f"{self.engine.max_model_len} tokens; send only what the output should contain",
                param="prediction",
            )
        return await self._tokenized(text, False)

    def start(
        self,
        base: str,
        prompts: list[tuple[str | None, list[int]]],
        params,
        req,
        request,
        prediction: list[int] | None = None,
    ) -> list[RequestStream]:
        """Queue one engine request per prompt. If any is refused, none stays queued."""
        self.check_priority(req)
        request.scope["hetserve.base"] = base  # the response's id header
        streams: list[RequestStream] = []
        session = req.session_id or request.headers.get("x-session-id") or None
        lora = self.lora_of(req)
        grammar = self.grammar_of(req)
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = base if len(prompts) == 1 else f"{base}-{i}"
                if len(kept := self.kept(req, ids)) < len(ids):
                    text, ids = None, kept
                self.check_room(req, len(ids))
                new = NewRequest(
                    rid,
                    ids,
                    params(i, ids),
                    prompt=text,
                    priority=req.priority,
                    arrival_time=arrival_time(request),
                    session_id=session,
                    lora=lora,
                    kv_handoff=handoff_of(req),
                    grammar=grammar,
                    caller_id=caller_id(request),
                    cache_extra=salt_extra(req.cache_salt),
                    prediction=prediction,
                )
                streams.append(self.engine.submit(new))
                request.scope.setdefault("hetserve.ids", []).append(rid)  # the access line
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    def kept(self, req: _Common, ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the context's)."""
        keep = req.truncate_prompt_tokens
        if keep == -1:
            keep = self.engine.max_model_len
        return ids[-keep:] if keep is not None and len(ids) > keep else ids

    # ---- running them -----------------------------------------------------------------------
    async def run_unless_disconnected(
        self, request: Request, streams: list[RequestStream], work: Coroutine
    ):
        """Run a non-streaming handler; if the client goes away first, cancel it and abort its
        requests (their KV blocks are freed at the engine's next step)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for s in streams:
                s.abort()
        if task in done:
            return task.result()
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    def event_stream(
        self, base: str, streams: list[RequestStream], chunks: AsyncIterator[str]
    ) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield chunk
            except Exception as exc:  # any failure ends the stream with an error event
                yield sse_error(exc)
            finally:
                for s in streams:
                    s.abort()
            yield DONE

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"x-request-id": base}
        )

    # ---- shared formatting ------------------------------------------------------------------
    def prompt_logprobs(self, out: RequestOutput, k: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt position None (the first) or, by token id, the
        prompt's token and the top k: logprob, rank, decoded token."""
        rows: list[dict | None] = []
        for tid, entry in zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=False):
            if entry is None:
                rows.append(None)
                continue
            rows.append({
                str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.token_str(t)}
                for t, lp in sorted(entry.items(), key=lambda x: x[1].rank)
                if t == tid or lp.rank <= k
            })  # fmt: skip
        return rows

    def usage(self, outs: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outs)
        by_tier: dict[str, int] = {}
        for o in outs:
            for tier, n in o.cached_tokens_by_tier.items():
                by_tier[tier] = by_tier.get(tier, 0) + n
        details = {"cached_tokens": cached}
        if by_tier:  # hetserve's extension: where the cached tokens came from
            details["cached_tokens_by_tier"] = by_tier
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": details,
        }
        if any(o.prediction_tokens is not None for o in outs):
            # OpenAI's Predicted Outputs: the prediction's tokens drafted that held, and those
            # checked that did not (computed and thrown away)
            held = sum(c.accepted_draft_tokens for o in outs for c in o.outputs)
            tried = sum(c.draft_tokens for o in outs for c in o.outputs)
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": held,
                "rejected_prediction_tokens": tried - held,
            }
        return usage

    def token_str(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False)

    @staticmethod
    def token_name(tid: int) -> str:
        """A token as vLLM's return_tokens_as_token_ids names it in logprobs."""
        return f"token_id:{tid}"


def _most(*ks: int | None) -> int | None:
    """The largest of the logprob counts asked for (None: none asked)."""
    asked = [k for k in ks if k is not None]
    return max(asked) if asked else None


def handoff_of(req: _Common) -> KVHandoff | None:
    h = req.kv_handoff
    if h is None:
        return None
    return KVHandoff(h.key, HandoffRole(h.role), HandoffPath(h.path), h.peer, h.timeout_s)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


_CALLER_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def caller_id(request: Request) -> str | None:
    """The caller's id for a request (`X-Request-Id`, as a Conductor sends it), kept for the
    request log; ours stays unique whatever callers send. Anything but a short plain token is
    ignored rather than refused (an id is a label, not an input)."""
    value = request.headers.get("x-request-id")
    return value if value is not None and _CALLER_ID.fullmatch(value) else None
