"""/v1/chat/completions: messages -> chat template -> one engine request -> JSON or SSE."""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from hetserve.server.protocol import ChatCompletionRequest
from hetserve.server.serving import OpenAIServing, chunk_writer, merge


class ChatServing(OpenAIServing):
    async def create(self, req: ChatCompletionRequest, request: Request):
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt = await self.render_chat(messages, req.add_generation_prompt)
        ids = await self.encode(prompt, add_special_tokens=False)
        k = (req.top_logprobs or 0) if req.logprobs else None
        limit, _ = req.output_limit()
        base = f"chatcmpl-{uuid.uuid4().hex}"
        streams = self.start(
            base,
            [(prompt, ids)],
            lambda _i, _ids: self.sampling_params(req, limit, k),
            req,
            request,
        )
        if req.stream:
            return self.event_stream(base, streams, self._chunks(req, base, streams))
        work = self._collect(req, base, streams)
        return await self.run_unless_disconnected(request, streams, work)

    async def _collect(self, req: ChatCompletionRequest, base: str, streams) -> dict:
        outs = [out async for _, out in merge(streams)]
        out = outs[-1]
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": (
                    self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
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
            "model": self.served_name(req),
            "choices": choices,
            "usage": self.usage([out]),
        }

    async def _chunks(self, req: ChatCompletionRequest, base: str, streams):
        opts = req.stream_options
        continuous = bool(opts and opts.continuous_usage_stats)
        chunk = chunk_writer(base, "chat.completion.chunk", self.served_name(req))

        role = {"role": "assistant", "content": ""}
        yield chunk(
            [
                {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
                for i in range(req.n)
            ]
        )
        sent: dict[int, tuple[int, int, bool]] = {}  # choice -> (chars, tokens, finish sent)
        last = None
        async for _, out in merge(streams):
            last = out
            for c in out.outputs:
                chars, ntok, done = sent.get(c.index, (0, 0, False))
                delta = c.text[chars:]
                if done or (not delta and c.finish_reason is None):
                    continue
                sent[c.index] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
                lp = None
                if req.logprobs:
                    lp = self._logprobs(
                        c.token_ids[ntok:], c.logprobs[ntok:], req.top_logprobs or 0
                    )
                choice = {
                    "index": c.index,
                    "delta": {"content": delta} if delta else {},
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                }
                yield chunk([choice], self.usage([out]) if continuous else None)
        if opts and opts.include_usage and last is not None:
            yield chunk([], self.usage([last]))

    def _logprobs(self, token_ids, entries, k: int) -> dict:
        def item(tid, lp):
            s = self.token_str(tid)
            return {"token": s, "logprob": lp.logprob, "bytes": list(s.encode())}

        content = []
        for e, t in zip(entries, token_ids, strict=True):
            entry = item(t, e[t])
            ranked = sorted(e.items(), key=lambda x: x[1].rank)
            entry["top_logprobs"] = [item(tid, lp) for tid, lp in ranked if lp.rank <= k]
            content.append(entry)
        return {"content": content}
