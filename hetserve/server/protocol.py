"""OpenAI request schemas (the subset hetserve serves).

Unknown fields are accepted and ignored, as OpenAI clients send many; but a field that would
change the output and that we do not implement (tools, structured output, images, ...) is a 400
naming it, never silently ignored. Wrong types and out-of-range values are 400s too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

MAX_PROMPTS = 256  # prompts in one /v1/completions request
MAX_CHOICES = 256  # prompts x n
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's limit

Finite = Annotated[float, Field(allow_inf_nan=False)]


class UnsupportedFieldError(ValueError):
    """A request asks for a feature this server does not implement (answered with a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk (vLLM's extension)


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: Finite = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Finite = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: no top-k (vLLM's convention)
    min_p: Finite = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    priority: int = 0
    presence_penalty: Finite = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Finite = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: Finite = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, Finite] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    # An agent's session (or the X-Session-Id header): its KV outlives each turn for a TTL.
    session_id: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 16 or any(not s or len(s) > 256 for s in items):
            raise ValueError("stop must be at most 16 non-empty strings of up to 256 characters")
        return items

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return v
        for key, bias in v.items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        extra = self.model_extra or {}
        tools = extra.get("tools") or extra.get("functions")
        choice = extra.get("tool_choice", extra.get("function_call"))
        if tools and choice != "none":
            name = "tools" if extra.get("tools") else "functions"
            raise UnsupportedFieldError(
                name,
                f"{name} (tool calling) is not supported by this server; send no tools "
                "or set tool_choice to 'none'",
            )
        if choice not in (None, "none", "auto"):
            raise UnsupportedFieldError(
                "tool_choice", f"tool_choice {choice!r} is not supported (no tool calling)"
            )
        fmt = extra.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise UnsupportedFieldError(
                "response_format",
                f"response_format {kind!r} (structured output) is not supported; use 'text'",
            )
        for name in _UNSUPPORTED:
            if extra.get(name) is not None:
                raise UnsupportedFieldError(name, f"{name} is not supported by this server")
        modalities = extra.get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise UnsupportedFieldError("modalities", "only the 'text' modality is supported")
        return self

    def resolved_top_k(self) -> int | None:
        return None if self.top_k in (None, -1, 0) else self.top_k

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): b for k, b in (self.logit_bias or {}).items()}


# Fields that would change the output and that we do not implement.
_UNSUPPORTED = (
    "audio",
    "prediction",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "logits_processors",
    "web_search_options",
)


class CompletionRequest(_Common):
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
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _completion_only(self):
        if self.suffix:
            raise UnsupportedFieldError("suffix", "suffix (insertion) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFieldError("best_of", "best_of other than n is not supported")
        count = (
            len(self.prompt) if isinstance(self.prompt, list) and not _is_ids(self.prompt) else 1
        )
        if count * self.n > MAX_CHOICES:
            raise ValueError(f"prompts x n must be at most {MAX_CHOICES}, got {count * self.n}")
        return self

    def output_limit(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are given.
        return self.max_completion_tokens or self.max_tokens


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


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if not isinstance(v, list):
            return v
        for part in v:
            kind = part.get("type")
            if kind in ("text", "refusal"):
                key = "text" if kind == "text" else "refusal"
                if not isinstance(part.get(key), str):
                    raise ValueError(f"a {kind!r} content part needs a string {key!r}")
            elif kind in ("image_url", "input_audio", "file", "video_url", "audio_url"):
                raise UnsupportedFieldError(
                    "content", f"{kind} content parts are not supported (text-only model)"
                )
            else:
                raise ValueError(f"unknown content part type {kind!r}")
        return v

    @model_validator(mode="after")
    def _no_tool_calls(self):
        if (self.model_extra or {}).get("tool_calls"):
            raise UnsupportedFieldError("tool_calls", "tool_calls in messages are not supported")
        return self

    def text(self) -> str:
        """Content as text: plain strings, or the text parts of a content list."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text") or p.get("refusal") or "" for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body for POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="allow")  # vLLM clients may send load_inplace and the like

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body for POST /v1/unload_lora_adapter (its lora_int_id is accepted, unused)."""

    model_config = ConfigDict(extra="allow")

    lora_name: str = Field(min_length=1, max_length=256)
