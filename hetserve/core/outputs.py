"""What generation returns: one RequestOutput per prompt, holding n CompletionOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded: str | None = None


# One generated (or prompt) position: token id -> Logprob, holding the chosen token and the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token that ended it
    # Speculative decoding: drafts checked for this sequence, and those that held
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0
    # Where the cached prompt tokens came from: "device" (the paged KV pool) and each KV tier
    # they were loaded from ("dram", "ssd", "pool", ...). Empty without a prefix hit.
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # Set (with finished) when this request failed inside the engine; other requests go on.
    error: str | None = None
    # time.monotonic() when the engine first scheduled it (the end of its queueing)
    scheduled_time: float | None = None
    prediction_tokens: int | None = None  # the length of its prediction; None: it had none

    # The single-completion view (n == 1), so `out.text` works like the first choice.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
