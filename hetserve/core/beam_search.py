"""Beam search (vLLM's `use_beam_search` on /v1/completions, `LLM.beam_search`) over an engine.

Who calls it: `server/completions.py` and `engine/llm.py`, each with its own `expand`. The
search is vLLM's: every step asks the engine for one token of each live beam with the
`2 x width` most likely next tokens and their log-probabilities (`expand`), extends each beam
by each of them, sets aside the ones that end in a stop token (unless `ignore_eos`), and keeps
the `width` best of the rest by score; after `max_tokens` steps the `width` best of the
finished and live beams are the answer, best first. A beam's score is its summed
log-probability over its length (prompt and output, a final stop token not counted) to the
power `length_penalty`. The engine's prefix cache makes each step cost one token per beam plus
its last partial block. Sampling fields do not apply: the beams follow the model's
log-probabilities alone.

Pure policy (`search`, `score`): no engine, no I/O; the engine is reached only through
`expand`. Failure contract: whatever `expand` raises propagates (the caller aborts what it
queued).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# One step: for each beam's tokens, its `k` likeliest next (token id, log-probability).
Expand = Callable[[list[list[int]], int], Awaitable[list[list[tuple[int, float]]]]]
MAX_WIDTH = 10  # 2 x width alternatives per step, at most the engine's 20 logprobs


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's: `beam_width` beams (up to MAX_WIDTH), each up to `max_tokens` long."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_WIDTH:
            raise ValueError(f"beam_width must be 1 to {MAX_WIDTH}, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass
class Beam:
    tokens: list[int]  # the prompt's and the output's
    cum_logprob: float
    finish_reason: str | None = None  # "stop" (a stop token) or "length"
    text: str = ""  # the output's, where the caller decodes it


@dataclass
class BeamSearchOutput:
    """One prompt's beams, best first (vLLM's name)."""

    sequences: list[Beam] = field(default_factory=list)


def score(beam: Beam, length_penalty: float) -> float:
    n = len(beam.tokens) - (beam.finish_reason == "stop")
    length: float = math.pow(max(n, 1), length_penalty)
    return beam.cum_logprob / length


async def search(
    expand: Expand,
    prompt: Sequence[int],
    width: int,
    max_tokens: int,
    stop_ids: frozenset[int],
    ignore_eos: bool = False,
    length_penalty: float = 1.0,
) -> list[Beam]:
    """The `width` best beams after at most `max_tokens` steps, best first."""
    live = [Beam(list(prompt), 0.0)]
    done: list[Beam] = []
    for _ in range(max_tokens):
        alternatives = await expand([b.tokens for b in live], 2 * width)
        grown: list[Beam] = []
        for beam, top in zip(live, alternatives, strict=True):
            for tid, logprob in top:
                new = Beam([*beam.tokens, tid], beam.cum_logprob + logprob)
                if tid in stop_ids and not ignore_eos:
                    new.finish_reason = "stop"
                    done.append(new)
                else:
                    grown.append(new)
        live = sorted(grown, key=lambda b: score(b, length_penalty), reverse=True)[:width]
        if not live:
            break
    for beam in live:
        beam.finish_reason = "length"
    return sorted(done + live, key=lambda b: score(b, length_penalty), reverse=True)[:width]


def likeliest(logprobs: Sequence[Mapping[int, Any]] | None, k: int) -> list[tuple[int, float]]:
    """The `k` likeliest next tokens at the one position an engine request produced (its
    logprobs: token id -> Logprob with a rank), by rank."""
    assert logprobs is not None
    ranked = sorted(logprobs[0].items(), key=lambda kv: kv[1].rank)[:k]
    return [(tid, lp.logprob) for tid, lp in ranked]
