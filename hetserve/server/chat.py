"""/v1/chat/completions: messages -> chat template -> one engine request -> JSON or SSE.

The reply of each choice goes through its parser (server/tools/): thinking to
`reasoning_content`, tool calls to `tool_calls` (streamed as deltas, arguments as they are
generated), the rest to `content`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import Request

from hetserve.core.outputs import CompletionOutput
from hetserve.core.sampling import SamplingParams
from hetserve.engine.async_llm import AsyncLLM
from hetserve.errors import InvalidInputError
from hetserve.server.beam_serving import search_beams
from hetserve.server.protocol import ChatCompletionRequest
from hetserve.server.serving import OpenAIServing, chunk_writer
from hetserve.server.stream_merge import merge
from hetserve.server.tool_calls import (
    ToolPlan,
    choice_parser,
    needs_special_tokens,
    openai_tool_calls,
    template_messages,
)
from hetserve.server.tools import OutputParser, Parsed, Streamer, default_parsers, new_call_id
from hetserve.server.tools.registry import REASONING_PARSERS, TOOL_PARSERS, thinking_marks


def check_parser_names(tool: str | None, reasoning: str | None) -> None:
    """For the command line: a parser name we do not have is a one-line error."""
    if tool is not None and tool not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {tool!r}: choose one of {', '.join(TOOL_PARSERS)}")
    if reasoning is not None and reasoning not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser {reasoning!r}: choose one of {', '.join(REASONING_PARSERS)}"
        )


def template_inputs(req: ChatCompletionRequest) -> tuple[list[dict], bool, Any, dict[str, Any]]:
    """What the chat template renders for `req`: its messages in the templates' shape,
    add_generation_prompt, the tools its tool_choice shows the model, the template's kwargs."""
    messages = template_messages([m.template_dict() for m in req.messages])
    return messages, req.add_generation_prompt, req.tool_plan.tools, req.template_kwargs()


def chat_prompt_text(tok, body: Mapping[str, Any]) -> str:
    """The prompt text this server renders for a chat body, for the Conductor, which hashes the
    same tokens to find which instance holds the prefix. Raises where the route answers 400
    (pydantic's ValidationError, InvalidInputError)."""
    req = ChatCompletionRequest.model_validate(body)
    messages, add_generation_prompt, tools, kwargs = template_inputs(req)
    # A request's own template is the instances' to trust or refuse: the Conductor hashes with
    # the model's (a routing estimate; the prefill and decode halves both render the request's).
    kwargs.pop("chat_template", None)
    return str(tok.apply_chat_template(messages, add_generation_prompt, tools, **kwargs))


class ChatServing(OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLM,
        model_name: str,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        trust_request_chat_template: bool = False,
    ) -> None:
        super().__init__(engine, model_name)
        self.trust_request_chat_template = trust_request_chat_template
        check_parser_names(tool_parser, reasoning_parser)
        default_tool, default_reasoning = default_parsers(self.tok.chat_template)
        self.tool_parser = tool_parser or default_tool
        self.reasoning_parser = reasoning_parser or default_reasoning

    def grammar_of(self, req):
        plan = getattr(req, "tool_plan", None)
        return plan.grammar if plan is not None and plan.grammar is not None else req.grammar

    async def create(self, req: ChatCompletionRequest, request: Request):
        base = f"chatcmpl-{uuid.uuid4().hex}"
        if req.use_beam_search:
            work = self._beams(req, base, request)
            return await self.run_unless_disconnected(request, [], work)
        streams, parsers, _ = await self.prepare(base, req, request)
        if req.stream:
            return self.event_stream(base, streams, self._chunks(req, base, streams, parsers))
        work = self._collect(req, base, streams, parsers)
        return await self.run_unless_disconnected(request, streams, work)

    async def prepare(self, base: str, req: ChatCompletionRequest, request: Request):
        """Render, tokenize and queue the request: (its streams, a parser per choice, the
        prompt). Shared with the Ollama and Responses routes, which only answer in their own
        shapes."""
        plan = req.tool_plan
        prompt, ids = await self._prompt_ids(req)
        k = (req.top_logprobs or 0) if req.logprobs else None
        limit = req.limit_for(len(ids), self.engine.max_model_len)
        specials = needs_special_tokens(plan, self.tool_parser, self.reasoning_parser)
        prediction = await self.prediction_ids(req)
        streams = self.start(
            base,
            [(prompt, ids)],
            lambda _i, _ids: self.budgeted(
                req, self.sampling_params(req, limit, k, specials=specials)
            ),
            req,
            request,
            prediction,
        )
        parsers = [
            choice_parser(plan, self.tool_parser, self.reasoning_parser, prompt)
            for _ in range(req.n)
        ]
        return streams, parsers, prompt

    async def _prompt_ids(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        if req.tool_plan.choice == "auto" and self.tool_parser is None:
            raise InvalidInputError(
                "this model's chat template has no tool-call format hetserve knows; start the "
                "server with --tool-call-parser NAME, or use tool_choice 'required'",
                "tools",
            )
        prompt = await self.prompt_of(req)
        cut = req.truncate_prompt_tokens is not None  # tokenized whole, then cut
        return prompt, await self.encode(prompt, req.add_special_tokens, whole=cut)

    async def _beams(self, req: ChatCompletionRequest, base: str, request: Request) -> dict:
        """vLLM's beam search (core/beam_search.py): n beams, best first, each read by the
        choice parser as a sampled reply is (reasoning, tool calls)."""
        prompt, ids = await self._prompt_ids(req)
        ids, beams = await search_beams(self, req, ids, base, request)
        plan = req.tool_plan
        keep_specials = needs_special_tokens(plan, self.tool_parser, self.reasoning_parser)
        choices, reasoning, completion = [], [], 0
        for j, beam in enumerate(beams):
            out = beam.tokens[len(ids) :]
            completion += len(out)
            text = self.tok.decode(out, skip_special_tokens=req.skip_special_tokens
                                   and not keep_specials)  # fmt: skip
            parser = choice_parser(plan, self.tool_parser, self.reasoning_parser, prompt)
            parsed = parser.parse(text, final=True)
            reasoning.append(parsed.reasoning)
            choices.append({"index": j, "message": self._message(parsed), "logprobs": None,
                            "finish_reason": _finish(beam.finish_reason, bool(parsed.calls),
                                                     plan),
                            **({"token_ids": out} if req.return_token_ids else {})})  # fmt: skip
        usage = {"prompt_tokens": len(ids), "completion_tokens": completion,
                 "total_tokens": len(ids) + completion}  # fmt: skip
        body = {"id": base, "object": "chat.completion", "created": int(time.time()),
                "model": self.served_name(req), "choices": choices,
                "usage": self._reasoned(usage, reasoning)}  # fmt: skip
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        return body

    async def prompt_of(self, req: ChatCompletionRequest) -> str:
        """The prompt text the model's template renders for `req` (before tokenizing)."""
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise InvalidInputError(
                "a request's chat_template is used only where the server runs with "
                "--trust-request-chat-template (vLLM's flag); omit it to use the model's",
                "chat_template",
            )
        messages, add_generation_prompt, tools, kwargs = template_inputs(req)
        return await self.render_chat(messages, add_generation_prompt, tools, **kwargs)

    def budgeted(self, req: ChatCompletionRequest, params: SamplingParams) -> SamplingParams:
        """`params` with the request's thinking budget and its format's markers as tokens."""
        if req.thinking_token_budget is None:
            return params
        if req.grammar is not None or req.tool_plan.grammar is not None:
            raise InvalidInputError(
                "thinking_token_budget cannot go with structured output or a forced tool call: "
                "their grammar holds from the reply's first token, where no thinking can be",
                "thinking_token_budget",
            )
        marks = thinking_marks(self.reasoning_parser)
        if marks is None:
            raise InvalidInputError(
                "thinking_token_budget: this model's chat template has no thinking format "
                "hetserve knows; start the server with --reasoning-parser NAME",
                "thinking_token_budget",
            )
        opened, closed, forced = (tuple(self.tok.encode(m, False)) for m in marks)
        return dataclasses.replace(
            params, thinking_budget=req.thinking_token_budget, think_open_ids=opened,
            think_close_ids=closed, think_forced_ids=forced,
        )  # fmt: skip

    @property
    def thinks(self) -> bool:
        return self.reasoning_parser is not None

    def _message(self, parsed: Parsed) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if self.thinks:
            msg["reasoning_content"] = parsed.reasoning or None
        if parsed.calls:
            ids = [c.id or new_call_id() for c in parsed.calls]
            msg["tool_calls"] = openai_tool_calls(parsed.calls, ids)
            msg["content"] = parsed.content if parsed.content.strip() else None
        return msg

    async def _collect(self, req: ChatCompletionRequest, base: str, streams, parsers) -> dict:
        outs = [out async for _, out in merge(streams)]
        out = outs[-1]
        choices, reasoning = [], []
        echo = _echo(req)
        for c in out.outputs:
            parsed = parsers[c.index].parse(c.text, final=True)
            reasoning.append(parsed.reasoning)
            message = self._message(parsed)
            if echo:
                message["content"] = echo + (message["content"] or "")
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": (
                        self.token_logprobs(
                            c.token_ids,
                            c.logprobs,
                            req.top_logprobs or 0,
                            req.return_tokens_as_token_ids,
                        )
                        if req.logprobs
                        else None
                    ),
                    "finish_reason": _finish(c.finish_reason, bool(parsed.calls), req.tool_plan),
                }
            )
            if req.return_token_ids:
                choices[-1]["token_ids"] = list(c.token_ids)
        body = {
            "id": base,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.served_name(req),
            "choices": choices,
            "usage": self._usage(out, reasoning),
        }
        if req.return_token_ids:  # vLLM's: the prompt's once, beside the choices
            body["prompt_token_ids"] = out.prompt_token_ids
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs(out, req.prompt_logprobs)
        return body

    def _usage(self, out, reasoning: list[str]) -> dict:
        return self._reasoned(self.usage([out]), reasoning)

    def _reasoned(self, usage: dict[str, Any], reasoning: list[str]) -> dict[str, Any]:
        """`usage` with the reasoning's tokens, for a model that thinks."""
        if self.thinks:
            n = sum(len(self.tok.encode(r, add_special_tokens=False)) for r in reasoning if r)
            usage.setdefault("completion_tokens_details", {})["reasoning_tokens"] = n
        return usage

    async def _chunks(self, req: ChatCompletionRequest, base: str, streams, parsers):
        opts = req.stream_options
        continuous = bool(opts and opts.continuous_usage_stats)
        chunk = chunk_writer(base, "chat.completion.chunk", self.served_name(req))
        streamers = [Streamer(p) for p in parsers]
        role = {"role": "assistant", "content": ""}
        prompt = streams[0].num_prompt_tokens  # as vLLM: the role chunk counts the prompt
        zero = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
        ids = {}
        if req.return_token_ids:  # vLLM's: the prompt's in the first chunk
            ids["prompt_token_ids"] = list(streams[0].prompt_token_ids)
        yield chunk(
            [
                {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
                for i in range(req.n)
            ],
            zero if continuous else None,
            **ids,
        )
        echo = _echo(req)
        if echo:  # vLLM's: the echoed text as each choice's first content delta
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"content": echo},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(req.n)
                ],
                zero if continuous else None,
            )
        sent: dict[int, tuple[int, bool]] = {}  # choice -> (tokens sent, finish sent)
        last = None
        async for _, out in merge(streams):
            last = out
            for c in out.outputs:
                ntok, done = sent.get(c.index, (0, False))
                if done:
                    continue
                delta = self._delta(streamers[c.index], c)
                if not delta and c.finish_reason is None:
                    continue
                sent[c.index] = (len(c.token_ids), c.finish_reason is not None)
                lp = None
                if req.logprobs:
                    lp = self.token_logprobs(c.token_ids[ntok:], c.logprobs[ntok:],
                                             req.top_logprobs or 0,
                                             req.return_tokens_as_token_ids)  # fmt: skip
                called = bool(streamers[c.index].sent.calls)
                choice = {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": lp,
                    "finish_reason": _finish(c.finish_reason, called, req.tool_plan),
                }
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids[ntok:]
                yield chunk([choice], self._stream_usage(out, streamers) if continuous else None)
        if opts and opts.include_usage and last is not None:
            yield chunk([], self._stream_usage(last, streamers))

    def _stream_usage(self, out, streamers: list[Streamer]) -> dict:
        return self._usage(out, [s.sent.reasoning for s in streamers])

    def _delta(self, streamer: Streamer, c: CompletionOutput) -> dict[str, Any]:
        content, reasoning, calls = streamer.feed(c.text, final=c.finish_reason is not None)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [_call_delta(d) for d in calls]
        return delta

    def token_logprobs(self, token_ids, entries, k: int, as_ids: bool = False) -> dict:
        """Chat logprobs of `token_ids` with the top `k` each; `as_ids`: tokens named
        "token_id:ID" (vLLM's return_tokens_as_token_ids)."""
        name = self.token_name if as_ids else self.token_str

        def item(tid, lp):
            raw = self.tok.token_bytes(tid)
            return {"token": name(tid), "logprob": lp.logprob, "bytes": list(raw)}

        content = []
        for e, t in zip(entries, token_ids, strict=True):
            entry = item(t, e[t])
            ranked = sorted(e.items(), key=lambda x: x[1].rank)
            entry["top_logprobs"] = [item(tid, lp) for tid, lp in ranked if lp.rank <= k]
            content.append(entry)
        return {"content": content}


def _echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the final message's text where it is the assistant's (the reply's
    role): the reply is shown whole, the part the client wrote first."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == "assistant" else ""


def _call_delta(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"index": d["index"], "function": {"arguments": d["arguments"]}}
    if "id" in d:
        out["id"], out["type"] = d["id"], "function"
        out["function"]["name"] = d["name"]
    return out


def _finish(reason: str | None, called: bool, plan: ToolPlan) -> str | None:
    # As OpenAI (and vLLM) answer: a call the request named ends with "stop", others with
    # "tool_calls".
    if reason == "stop" and called and plan.choice != "named":
        return "tool_calls"
    return reason


__all__ = ["ChatServing", "OutputParser", "check_parser_names"]
