"""Per-request output state: detokenizer, RNG, logprobs; and assembly of RequestOutputs.

A user request with n > 1 fans out into n sequences (`Request`s) that share the prompt (and,
through the prefix cache, its KV). `ParentState` gathers them back into one RequestOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hetserve.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from hetserve.core.request import Request
from hetserve.engine.detokenizer import IncrementalDetokenizer
from hetserve.structured import GrammarMatcher


@dataclass(eq=False)
class SeqState:
    request: Request
    parent: ParentState
    index: int
    detok: IncrementalDetokenizer
    generator: torch.Generator
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    grammar: GrammarMatcher | None = None  # where its output is in its grammar (structured)


@dataclass(eq=False)
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[SeqState] = field(default_factory=list)
    stream: bool = True  # False: only the final output is built (offline generation)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    scheduled_time: float | None = None  # first scheduled (monotonic), for queue-time metrics

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def snapshot(self, error: str | None = None) -> RequestOutput:
        """A cumulative view (copies, safe to hand to another thread). `error`: the request
        failed inside the engine (it is then finished)."""
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.detok.visible_text(finished=s.finish_reason is not None),
                token_ids=list(s.request.output_token_ids),
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.request.stop_reason,
                draft_tokens=s.request.num_draft_tokens,
                accepted_draft_tokens=s.request.num_accepted_tokens,
            )
            for s in self.seqs
        ]
        first = self.seqs[0].request
        cached = first.num_cached_tokens or 0
        by_tier = dict(first.loaded_tokens)
        if cached - sum(by_tier.values()) > 0:
            by_tier["device"] = cached - sum(by_tier.values())
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs else None,
            finished=self.finished or error is not None,
            num_cached_tokens=cached,
            cached_tokens_by_tier=by_tier,
            error=error,
            scheduled_time=self.scheduled_time,
            prediction_tokens=None if first.prediction is None else len(first.prediction),
        )
