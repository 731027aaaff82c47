"""OpenAI request schemas (the subset hetserve serves).

Unknown fields are accepted and ignored, as OpenAI clients send many; but a field that would
change the output and that we do not implement (images, audio, ...) is a 400
naming it, never silently ignored. Structured output is read by server/structured.py. Wrong
types and out-of-range values are 400s too; the rules across fields and the message rules of
each role are in server/validation.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from hetserve.core.beam_search import MAX_WIDTH as MAX_BEAMS
from hetserve.core.grammar import GrammarSpec
from hetserve.core.sampling import MAX_LOGPROBS
from hetserve.errors import InvalidInputError
from hetserve.server.protocol_fields import (
    Finite,
    KVHandoffSpec,
    Prediction,
    StreamOptions,
    not_nullable,
)
from hetserve.server.structured import grammar_of
from hetserve.server.tool_calls import ToolPlan, plan_tools
from hetserve.server.validation import (
    CHAT_EXTENSIONS,
    check_logit_bias,
    check_message,
    check_min_tokens,
    check_stream_options,
    check_tool_replies,
    check_unsupported,
)

MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_ALLOWED_TOKEN_IDS = 65536  # a body's worth; the masks cost one pass over the vocabulary
MAX_BAD_WORDS = 256
MAX_TEMPLATE = 256 * 1024  # a request's own chat template, in characters
MAX_DOCUMENTS = 1024  # RAG documents a chat request hands its template



class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    # vLLM extensions this endpoint refuses unless they ask for nothing (server/validation.py).
    extensions: ClassVar[Mapping[str, tuple]] = {}

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
    # vLLM's: the prompt's and the reply's token ids beside the text (RL rollouts keep them).
    return_token_ids: bool = False
    # vLLM's: a tenant's secret mixed into every block hash of the request, so its prefix is
    # shared only with requests carrying the same salt (no timing side channel across tenants).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # vLLM's: n beams, best first (core/beam_search.py), scored logprob / length ** penalty.
    use_beam_search: StrictBool = False
    length_penalty: float = Field(default=1.0, ge=-10, le=10, allow_inf_nan=False)
    # vLLM's: each prompt token's logprob given its prefix, with the top k (not streamed).
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: only the prompt's last k tokens are used (left truncation; -1: the context's).
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)
    # vLLM's: logprobs name tokens "token_id:ID" (a token that is no whole UTF-8 text stays
    # exact).
    return_tokens_as_token_ids: bool = False
    # vLLM's: only these token ids may be sampled.
    allowed_token_ids: list[StrictInt] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    # vLLM's: words the output never contains (as the tokenizer spells them, with and without
    # a leading space).
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    include_stop_str_in_output: bool = False  # vLLM's extension
    min_tokens: int = Field(default=0, ge=0)
    priority: int = 0
    presence_penalty: Finite = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Finite = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: Finite = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, Finite] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    skip_special_tokens: bool = True  # vLLM's extension
    # An agent's session (or the X-Session-Id header): its KV outlives each turn for a TTL.
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    kv_handoff: KVHandoffSpec | None = None  # a prefill/decode hand-off (from a Conductor)
    prediction: Prediction | None = None  # OpenAI's Predicted Outputs
    _grammar: GrammarSpec | None = PrivateAttr(default=None)
    # The output limit is a cap that the context may lower (Ollama's num_predict), not a
    # number of tokens the context must hold (OpenAI's max_tokens): set by `capped`
    _limit_is_cap: bool = PrivateAttr(default=False)

    @property
    def grammar(self) -> GrammarSpec | None:
        """What the output must match (response_format, guided_*, structured_outputs)."""
        return self._grammar

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        """OpenAI's schema types most fields as "X or null", and clients that send every field
        (LiteLLM, generated SDKs) send null for those they leave unset: null is the field's
        default, where the field has no meaning of its own for None."""
        if not isinstance(data, dict):
            return data
        plain = not_nullable(cls)
        return {k: v for k, v in data.items() if v is not None or k not in plain}

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 16 or any(not s or len(s) > 256 for s in items):
            raise ValueError("stop must be at most 16 non-empty strings of up to 256 characters")
        return items

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def _prompt_logprobs(cls, v):
        if v == -1 and not isinstance(v, bool):  # vLLM's "the whole vocabulary"
            raise ValueError(f"-1 (the whole vocabulary) is not served; at most {MAX_LOGPROBS}")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v):
        if v == 0:
            raise ValueError("0 leaves no prompt; give k >= 1, or -1 for the model's context")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v):
        if v is not None and any(not w.strip() or len(w) > 256 for w in v):
            raise ValueError("bad_words must be non-blank strings of up to 256 characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is not None:
            check_logit_bias(v)
        return v

    @model_validator(mode="after")
    def _rules(self):
        check_unsupported(self.model_extra or {}, self.extensions)
        self._grammar = grammar_of(self.model_extra or {})
        if self.use_beam_search:
            self._beam_rules()
        check_stream_options(self.stream, self.stream_options)
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidInputError(
                "prompt_logprobs is not streamed (as vLLM); ask for it without stream",
                "prompt_logprobs",
            )
        limit, name = self.output_limit()
        check_min_tokens(self.min_tokens, limit, name)
        return self

    def _beam_rules(self) -> None:
        """What beam search does not combine with (vLLM's answers at the end, and reads only
        the model's log-probabilities), each a 400 naming its field."""
        if self.n > MAX_BEAMS:
            raise InvalidInputError(f"use_beam_search takes n <= {MAX_BEAMS} beams", "n")
        conflicts = {"stream": self.stream, "stop": bool(self.stop),
                     "prompt_logprobs": self.prompt_logprobs is not None,
                     "response_format": self._grammar is not None, **self.beam_conflicts()}
        for name, given in conflicts.items():  # fmt: skip
            if given:
                raise InvalidInputError(f"{name} is not supported with use_beam_search", name)

    def beam_conflicts(self) -> dict[str, bool]:
        """The request kind's own fields that beam search does not combine with."""
        return {}

    def capped(self) -> None:
        """Make the output limit a cap the context lowers (Ollama's num_predict)."""
        self._limit_is_cap = True

    def limit_for(self, prompt_len: int, max_model_len: int) -> int | None:
        """The output limit for a prompt of `prompt_len` tokens: as given, or, for a cap, no
        more than the context leaves."""
        limit, _ = self.output_limit()
        if limit is not None and self._limit_is_cap:
            return max(1, min(limit, max_model_len - prompt_len))
        return limit

    def output_limit(self) -> tuple[int | None, str]:
        """The output token limit and the field that set it: max_completion_tokens is OpenAI's
        newer name and wins when both are given."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def resolved_top_k(self) -> int | None:
        return None if self.top_k in (None, -1, 0) else self.top_k

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): b for k, b in (self.logit_bias or {}).items()}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _role_rules(self):
        check_message(self.role, self.content, self.model_extra or {})
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (text content, tool calls, thinking)."""
        extra = self.model_extra or {}
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("tool_calls", "tool_call_id", "reasoning_content"):
            if extra.get(key) is not None:
                out[key] = extra[key]
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        """Content as text: plain strings, or the text parts of a content list."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text") or p.get("refusal") or "" for p in self.content)


# Template variables the server renders from the request, and where a request sets them.
_RENDERED = {
    "messages": "send them as 'messages'",
    "tools": "send them as 'tools'",
    "bos_token": "it is the model's own",
    "eos_token": "it is the model's own",
    "continue_final_message": "send it as the request's continue_final_message",
    "chat_template": "send it as the request's chat_template",
}


class ChatCompletionRequest(_Common):
    extensions: ClassVar[Mapping[str, tuple]] = CHAT_EXTENSIONS

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    # vLLM's: the tokenizer's special tokens (BOS) added to the rendered prompt; templates
    # write their own, so off by default.
    add_special_tokens: StrictBool = False
    # vLLM's: the reply starts with the final message's text (as completions' echo does).
    echo: bool = False
    # vLLM's: at most this many tokens of thinking, then its end is forced (reasoning models).
    thinking_token_budget: StrictInt | None = Field(default=None, ge=0)
    # vLLM's: the reply continues the final message (an assistant turn begun by the client)
    # instead of opening a new turn; needs add_generation_prompt false.
    continue_final_message: bool = False
    # Passed to the chat template (enable_thinking, ...); vLLM's extension.
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the request's own template (used where the server trusts request templates)
    # and RAG documents the template renders (HF's `documents`: dicts such as title and text).
    chat_template: str | None = Field(default=None, min_length=1, max_length=MAX_TEMPLATE)
    documents: Annotated[list[dict[str, str]], Field(max_length=MAX_DOCUMENTS)] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    _tools: ToolPlan = PrivateAttr(default=ToolPlan(None, "none"))

    @property
    def tool_plan(self) -> ToolPlan:
        return self._tools

    def beam_conflicts(self) -> dict[str, bool]:
        return {"logprobs": self.logprobs, "echo": self.echo,
                "thinking_token_budget": self.thinking_token_budget is not None}  # fmt: skip

    @model_validator(mode="after")
    def _chat_rules(self):
        # OpenAI: "logprobs must be set to true if this parameter is used"; vLLM allows 0.
        if self.top_logprobs and not self.logprobs:
            raise InvalidInputError("top_logprobs requires logprobs to be true", "top_logprobs")
        check_tool_replies([(m.role, m.model_extra or {}) for m in self.messages])
        self._template_rules()
        self._tools = plan_tools(self.model_extra or {})
        if self.use_beam_search and self._tools.grammar is not None:
            raise InvalidInputError(
                f"tool_choice {self._tools.choice!r} is not supported with use_beam_search",
                "tool_choice",
            )
        if self._tools.grammar is not None and self.grammar is not None:
            raise InvalidInputError(
                f"tool_choice {self._tools.choice!r} already constrains the output; it cannot "
                f"be combined with {self.grammar.param.split('.')[0]}",
                "tool_choice",
            )
        return self

    def _template_rules(self) -> None:
        """chat_template_kwargs may set add_generation_prompt (as vLLM's do, over the field)
        and anything else the template reads, but not what the server renders from the
        request itself."""
        kwargs = self.chat_template_kwargs or {}
        for key in _RENDERED:
            if key in kwargs:
                raise InvalidInputError(
                    f"chat_template_kwargs.{key}: the server sets it from the request; "
                    f"{_RENDERED[key]}",
                    f"chat_template_kwargs.{key}",
                )
        if "add_generation_prompt" in kwargs:
            value = kwargs.pop("add_generation_prompt")
            if not isinstance(value, bool):
                raise InvalidInputError(
                    "chat_template_kwargs.add_generation_prompt: should be a boolean",
                    "chat_template_kwargs.add_generation_prompt",
                )
            self.add_generation_prompt = value
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidInputError(
                    "continue_final_message continues the last message, add_generation_prompt "
                    "opens a new turn: set add_generation_prompt to false",
                    "continue_final_message",
                )
            if not self.messages[-1].text().strip():
                raise InvalidInputError(
                    "continue_final_message needs a final message with text to continue",
                    "continue_final_message",
                )

    def template_kwargs(self) -> dict[str, Any]:
        """What the tokenizer's apply_chat_template takes beyond messages, the generation
        prompt and tools: the template's own variables, and whether to continue the last
        message."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        if self.documents is not None:  # over chat_template_kwargs' (vLLM takes both)
            kwargs["documents"] = self.documents
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs
