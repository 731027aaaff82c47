"""The /v1/completions request schema (`CompletionRequest`) and its fast parse.

Who calls it: server/app.py's route (`parse_completion`) and server/completions.py. The fields
every request kind shares, and their rules, are `protocol._Common`'s; a mistake is a 400
naming the field (InvalidInputError, UnsupportedFieldError).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar

import pydantic_core
from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from hetserve.errors import InvalidInputError
from hetserve.server.protocol import _Common
from hetserve.server.validation import COMPLETION_EXTENSIONS, UnsupportedFieldError

MAX_PROMPTS = 256  # prompts in one /v1/completions request
MAX_CHOICES = 256  # prompts x n


class CompletionRequest(_Common):
    extensions: ClassVar[Mapping[str, tuple]] = COMPLETION_EXTENSIONS

    # Tried in order (str first): a smart union would try every branch on every element.
    prompt: (
        str
        | list[StrictInt]
        | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
        | Annotated[list[list[StrictInt]], Field(max_length=MAX_PROMPTS)]
    ) = Field(union_mode="left_to_right")
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    add_special_tokens: StrictBool = True  # vLLM's: the tokenizer's BOS (and such) on text prompts
    suffix: str | None = None  # fill in the middle: the text after the completion

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, v, handler):
        # The union's own error names the first form it tried ("should be a valid string"),
        # whatever the client meant; say what the forms are instead.
        try:
            v = handler(v)
        except ValidationError:
            if isinstance(v, list) and len(v) > MAX_PROMPTS and not _is_ids(v):
                raise InvalidInputError(
                    f"prompt holds {len(v)} prompts; at most {MAX_PROMPTS}", "prompt"
                ) from None
            raise InvalidInputError(
                "prompt must be a string, a list of strings, a list of token ids or a list "
                "of lists of token ids",
                "prompt",
            ) from None
        if isinstance(v, list) and not v:
            raise InvalidInputError("prompt must not be empty", "prompt")
        return v

    @model_validator(mode="after")
    def _completion_only(self):
        if self.suffix is not None and (self.echo or not isinstance(self.prompt, str)):
            raise InvalidInputError(
                "suffix (fill in the middle) takes one text prompt and no echo", "suffix"
            )
        if self.best_of is not None and self.best_of < self.n:
            # OpenAI: best_of is the number of candidates, of which n are returned.
            raise InvalidInputError(
                f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFieldError("best_of", "best_of other than n is not supported")
        count = (
            len(self.prompt) if isinstance(self.prompt, list) and not _is_ids(self.prompt) else 1
        )
        if count * self.n > MAX_CHOICES:
            raise InvalidInputError(
                f"prompts x n must be at most {MAX_CHOICES}, got {count * self.n}", "n"
            )
        return self

    def beam_conflicts(self) -> dict[str, bool]:
        return {"logprobs": self.logprobs is not None, "echo": self.echo,
                "suffix": self.suffix is not None}  # fmt: skip


def _is_ids(prompt: list) -> bool:
    return bool(prompt) and isinstance(prompt[0], int)


LONG_IDS = 512  # token-id prompts longer than this skip the schema's per-element check


def parse_completion(body: bytes) -> CompletionRequest:
    """The request from its JSON body. A long token-id prompt (up to ~1M ids in a maximal body)
    is taken out of the schema's per-element validation, which holds the event loop for ~100 ms
    per million ids: the engine checks every id (an int in the vocabulary) at admission, and
    refuses a prompt longer than the context before looking at it."""
    if len(body) < 8 * LONG_IDS:
        return CompletionRequest.model_validate_json(body)
    try:
        data = pydantic_core.from_json(body)
    except ValueError:
        return CompletionRequest.model_validate_json(body)  # the usual "not valid JSON" error
    prompt = data.get("prompt") if isinstance(data, dict) else None
    if not (isinstance(prompt, list) and len(prompt) > LONG_IDS and type(prompt[0]) is int):
        return CompletionRequest.model_validate(data)
    data["prompt"] = [0]
    req = CompletionRequest.model_validate(data)
    req.prompt = prompt
    return req
