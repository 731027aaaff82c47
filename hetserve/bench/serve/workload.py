"""The nouns of `hetserve bench serve`: requests, workloads, and how prompts fit a model.

Datasets (`datasets.py`, `trace.py`) make workloads; the client (`client.py`) turns a
`BenchRequest` into an HTTP payload. Nothing here knows of HTTP or of a particular dataset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hetserve.bench.model_facts import TokenSpace
from hetserve.errors import InvalidInputError

# Keys the generator of every block; a constant, not --seed, so the same trace always yields the
# same prompts and runs on different days hit the same server-side cache entries.
_BLOCK_SALT = 0x6D6F6F6E

# Short common words: most BPE tokenizers encode each as one token, so a prompt of N words is
# close to N tokens when the chat endpoint forces us to send text instead of token ids.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than first water "
    "been call who oil its now find long down day did get come made may part over new sound take"
).split()


@dataclass
class BenchRequest:
    """One request to send. Exactly one of `token_ids`, `text` or `hash_ids` holds the prompt."""

    prompt_len: int  # tokens (estimated for text prompts without a tokenizer)
    output_len: int
    token_ids: list[int] | None = None
    text: str | None = None
    hash_ids: list[int] | None = None  # trace prompts, materialized by BlockTokens at send time
    arrival_s: float | None = None  # recorded arrival (traces) before --time-scale
    response_format: dict | None = None  # structured output (the structured dataset)
    role: str = "stream"  # what `--burst` makes of it (burst.py): stream, burst or solo


@dataclass
class Workload:
    name: str
    conversations: list[list[BenchRequest]]
    ignore_eos: bool  # default for this dataset; the CLI may override it
    notes: list[str] = field(default_factory=list)  # said on the terminal and in the JSON
    block_tokens: BlockTokens | None = None  # traces only
    prefix_reuse: dict[str, float] | None = None  # traces only: what a perfect cache would hit

    @property
    def num_requests(self) -> int:
        return sum(len(c) for c in self.conversations)


def words_from_ids(token_ids: list[int]) -> str:
    """Text of about len(token_ids) tokens, for endpoints that take text only (chat)."""
    return " ".join(_WORDS[t % len(_WORDS)] for t in token_ids)


@dataclass(frozen=True, eq=False)
class BlockTokens:
    """Hash id -> its block of token ids, derived only from the id, the block size and the space."""

    block_size: int
    space: TokenSpace

    def block(self, hash_id: int) -> np.ndarray:
        return self.space.draw(np.random.default_rng([_BLOCK_SALT, hash_id]), self.block_size)

    def prompt(self, hash_ids: list[int], length: int) -> list[int]:
        """The prompt of a trace request: its blocks in order, the last one cut to `length`."""
        needed = math.ceil(length / self.block_size)
        if needed > len(hash_ids):
            raise ValueError(f"{length} tokens need {needed} blocks, trace gives {len(hash_ids)}")
        blocks = [self.block(h) for h in hash_ids[:needed]]
        return np.concatenate(blocks)[:length].tolist() if blocks else []


def fit_lengths(
    requests: list[BenchRequest],
    max_model_len: int | None,
    mode: str,
    factor: float | None = None,
) -> list[str]:
    """Make prompt + output fit `max_model_len`, in place; returns the note to print.

    clip: only requests that do not fit change; the output keeps at most half the window and the
    prompt is cut from the end (its leading blocks, and so prefix sharing, survive).
    scale: every length is multiplied by one factor so that the longest request fits; it keeps
    the shape of the length distribution for small models. `factor` overrides the computed one
    (it must not be larger), for callers that round it to their own granularity.
    """
    if max_model_len is None:
        return []
    if max_model_len < 2:
        raise InvalidInputError(f"--max-model-len must be >= 2, got {max_model_len}")
    if mode not in ("clip", "scale"):
        raise InvalidInputError(f"--max-model-len-mode must be clip or scale, got {mode!r}")
    changed = 0
    if mode == "clip":
        for r in requests:
            if r.prompt_len + r.output_len > max_model_len:
                r.output_len = min(r.output_len, max(1, max_model_len // 2))
                r.prompt_len = min(r.prompt_len, max_model_len - r.output_len)
                changed += 1
        return [f"context {max_model_len} (clip): changed {changed} of {len(requests)}"]
    factor = scale_factor(requests, max_model_len) if factor is None else factor
    for r in requests:
        new = (max(1, math.floor(r.prompt_len * factor)), max(1, math.floor(r.output_len * factor)))
        changed += new != (r.prompt_len, r.output_len)
        r.prompt_len, r.output_len = new
    return [f"context {max_model_len} (scale x{factor:.4g}): changed {changed} of {len(requests)}"]


def scale_factor(requests: list[BenchRequest], max_model_len: int) -> float:
    longest = max((r.prompt_len + r.output_len for r in requests), default=0)
    return min(1.0, max_model_len / longest) if longest else 1.0
