"""Small request parts the OpenAI request schemas share (server/protocol.py): stream
options, a Conductor's hand-off instruction, a prediction, a text part; and which fields of a
schema take no null (a null there means the default). Pure schemas: a wrong value is a pydantic
ValidationError the routes answer with a 400 naming the field."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

Finite = Annotated[float, Field(allow_inf_nan=False)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk (vLLM's extension)


class KVHandoffSpec(BaseModel):
    """A Conductor's instruction to an instance with a prefill or decode role (hetserve's
    extension; `/v1/*` is behind the API key when one is set)."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    role: Literal["send", "receive"]
    path: Literal["direct", "store", "mooncake"] = "direct"
    peer: str | None = Field(default=None, max_length=300)  # host:port (send over direct)
    timeout_s: Finite = Field(default=30.0, gt=0.0, le=600.0)


NOT_NULLABLE: dict[type, frozenset[str]] = {}


def not_nullable(cls: type[BaseModel]) -> frozenset[str]:
    """The fields of `cls` whose type does not take None (computed once a class)."""
    names = NOT_NULLABLE.get(cls)
    if names is None:
        names = frozenset(
            name for name, f in cls.model_fields.items()
            if f.annotation is not None and type(None) not in get_args(f.annotation)
        )  # fmt: skip
        NOT_NULLABLE[cls] = names
    return names


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the output is expected to largely repeat (a file an
    edit rewrites). Speculative decoding drafts from it (`--speculative-config`); the output is
    the same with or without it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c)
