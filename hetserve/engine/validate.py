"""Admission checks: a `NewRequest` against the model's fixed facts, before anything is queued.

Who calls it: `EngineCore.validate`, from any thread (the server's event loop through
`AsyncLLM.submit`, or `LLM` before it queues a batch): it reads only facts that never change
after start-up (vocabulary, context length) and the LoRA manager's thread-safe name lookup.

Failure contract: bad input is an `InvalidInputError` (or `PromptTooLongError`) whose `param`
names the field; nothing is queued and nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import time

from hetserve.core.request import NewRequest
from hetserve.engine.lora import LoRAManager, resolve_lora
from hetserve.errors import InvalidInputError, PromptTooLongError
from hetserve.structured import GrammarCompiler

MAX_SESSION_ID_CHARS = 256


class RequestValidator:
    def __init__(
        self,
        vocab_size: int,
        max_model_len: int,
        lora: LoRAManager | None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.lora = lora
        self.grammars = grammars

    def prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidInputError("the prompt is empty; give at least one token", param="prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_model_len} "
                "(room for at least one generated token is needed); shorten the prompt",
                param="prompt",
            )
        vocab = self.vocab_size
        bad = next((t for t in ids if type(t) is not int or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidInputError(
                f"token id {bad!r} is outside the vocabulary [0, {vocab})", param="prompt"
            )

    def request(self, new: NewRequest) -> NewRequest:
        """The checked copy of `new` (see `NewRequest`): max_tokens resolved, arrival stamped,
        the LoRA adapter's content id in `lora_id` and `cache_extra`."""
        ids, params = new.prompt_token_ids, new.params
        self.prompt(ids)
        lora_id = resolve_lora(self.lora, new.lora)
        cache_extra = new.cache_extra
        if lora_id is not None:  # no KV is ever shared across adapters (or with the base)
            cache_extra = (*cache_extra, f"lora:{lora_id}")
        vocab = self.vocab_size
        for name, tokens in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("allowed_token_ids", params.allowed_token_ids),
            ("bad_words", [t for w in params.bad_words_token_ids for t in w]),
        ):
            bad = next((t for t in tokens if t >= vocab), None)
            if bad is not None:
                raise InvalidInputError(
                    f"{name} holds token id {bad}, outside the vocabulary [0, {vocab})",
                    param=name,
                )
        self._prediction(new.prediction)
        room = self.max_model_len - len(ids)
        if params.max_tokens is None:
            params = params.with_max_tokens(room)
        elif params.max_tokens > room:
            raise InvalidInputError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens; lower max_tokens",
                param="max_tokens",
            )
        sid = new.session_id
        if sid is not None and (not sid or len(sid) > MAX_SESSION_ID_CHARS):
            raise InvalidInputError(
                f"session_id must have 1..{MAX_SESSION_ID_CHARS} characters", param="session_id"
            )
        if new.grammar is not None:
            if self.grammars is None:
                raise InvalidInputError("structured output is not available", new.grammar.param)
            # Compiled here, in the caller's thread, and cached: the engine thread only copies.
            self.grammars.check(new.grammar)
        return dataclasses.replace(
            new,
            prompt_token_ids=list(ids),
            params=params,
            arrival_time=time.monotonic() if new.arrival_time is None else new.arrival_time,
            cache_extra=cache_extra,
            lora_id=lora_id,
            prediction=None if new.prediction is None else list(new.prediction),
        )

    def _prediction(self, tokens: list[int] | None) -> None:
        if tokens is None:
            return
        if len(tokens) > self.max_model_len:
            raise InvalidInputError(
                f"prediction has {len(tokens)} tokens, more than the model's context of "
                f"{self.max_model_len}; send only what the output is expected to contain",
                param="prediction",
            )
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidInputError(
                f"prediction holds token id {bad}, outside the vocabulary [0, {self.vocab_size})",
                param="prediction",
            )
