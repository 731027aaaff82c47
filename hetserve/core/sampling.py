"""SamplingParams: how one request's tokens are chosen and when generation stops."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

# Seeds are 64-bit: OpenAI clients send any integer up to 2**64 - 1, negative ones included.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
MAX_LOGPROBS = 20  # top alternatives per position (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated at construction (ValueError names the field).

    temperature 0 means greedy. top_k None, top_p 1.0 and min_p 0 disable those filters.
    max_tokens None means "until the context is full". logprobs=k returns the top-k alternatives
    of every generated token (plus the sampled one); prompt_logprobs=k returns, for every prompt
    token after the first, its logprob given its prefix (vLLM's definition: position 0 is None).
    Penalties follow OpenAI (presence, frequency: subtracted from the logits of tokens already
    generated) and vLLM/HF (repetition: logits of tokens in the prompt or output divided by it
    when positive, multiplied when negative). logit_bias maps token ids to a bias added to their
    logits; allowed_token_ids and bad_words_token_ids keep tokens from being sampled. What
    depends on the model (token ids inside the vocabulary, the context length) is checked by
    the engine at admission.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # False: special tokens are spelled out in the text (tool and reasoning parsers read the
    # markers); the tokens that end generation are never part of it.
    skip_special_tokens: bool = True
    # token id -> bias; given as a mapping, stored as sorted pairs so the object stays hashable.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # Only these token ids may be sampled (vLLM's allowed_token_ids); empty: any.
    allowed_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Words the output never contains (vLLM's bad_words); LLM.generate spells them into
    # bad_words_token_ids with the model's tokenizer, alone and after a space.
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    # Token sequences the output never completes: a one-token word is never sampled, a longer
    # one's last token not right after the rest.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    # At most this many tokens of thinking (vLLM's thinking_token_budget): counted from the
    # token sequence that opens it (in the output, or open at the prompt's end), and once
    # spent the forced sequence (the end as the model writes it) is the only one sampled,
    # unless the thinking ended by itself. The sequences come from the reasoning format.
    thinking_budget: int | None = None
    think_open_ids: tuple[int, ...] = field(default_factory=tuple)
    think_close_ids: tuple[int, ...] = field(default_factory=tuple)
    think_forced_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # Accept lists and a bare string for convenience, store tuples so the object stays hashable.
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str | Iterable):
                raise ValueError(f"{name} takes a list, got {type(value).__name__} {value!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, Mapping) else (bias or ())
        object.__setattr__(self, "logit_bias", tuple(sorted((k, v) for k, v in items)))
        object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids or ()))
        words = tuple(tuple(w) for w in self.bad_words_token_ids or ())
        object.__setattr__(self, "bad_words_token_ids", words)
        bad = self.bad_words
        object.__setattr__(self, "bad_words", (bad,) if isinstance(bad, str) else tuple(bad or ()))
        for name in ("think_open_ids", "think_close_ids", "think_forced_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))
        self._validate()

    def _validate(self) -> None:
        _int_at_least("n", self.n, 1)
        _finite("temperature", self.temperature, 0.0)
        _finite("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        if self.top_k is not None:
            _int_at_least("top_k", self.top_k, 1)
        _finite("min_p", self.min_p, 0.0, 1.0)
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                _int_at_least(name, v, 0, MAX_LOGPROBS)
        _finite("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _finite("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _finite("repetition_penalty", self.repetition_penalty, 0.0, 2.0)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be in (0, 2], got 0")
        for tid, b in self.logit_bias:
            if not _is_int(tid) or tid < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tid!r}")
            _finite(f"logit_bias[{tid}]", b, -100.0, 100.0)
        if any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
            raise ValueError("allowed_token_ids must be a list of token ids >= 0")
        if any(not w or any(not _is_int(t) or t < 0 for t in w) for w in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be non-empty lists of token ids >= 0")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-blank strings")
        if self.thinking_budget is not None:
            _int_at_least("thinking_budget", self.thinking_budget, 0)
            seqs = (self.think_open_ids, self.think_close_ids, self.think_forced_ids)
            if not all(seqs) or any(not _is_int(t) or t < 0 for q in seqs for t in q):
                raise ValueError(
                    "thinking_budget needs the token ids that open, close and force-close the "
                    "thinking (think_open_ids, think_close_ids, think_forced_ids)"
                )
        never = {w[0] for w in self.bad_words_token_ids if len(w) == 1}
        if self.allowed_token_ids and set(self.allowed_token_ids) <= never:
            raise ValueError("allowed_token_ids: bad_words ban every one of them")

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """A copy with max_tokens set (min_tokens capped to it)."""
        return replace(self, max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def restricted(self) -> bool:
        """Whether some tokens are kept from being sampled (allowed ids, bad words)."""
        return bool(
            self.allowed_token_ids or self.bad_words_token_ids or self.thinking_budget is not None
        )

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens seen so far (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_at_least(name: str, v: object, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {span}, got {v!r}")


def _finite(name: str, v: object, lo: float, hi: float | None = None) -> None:
    # NaN compares false with everything, so range checks alone would let it through.
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        ok = False
    else:
        ok = lo <= v and (hi is None or v <= hi)
    if not ok:
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be a finite number {span}, got {v!r}")
