"""GrammarSpec: what a request's output must match (structured output), as plain data.

The server builds it from `response_format`, vLLM's `guided_*` / `structured_outputs`, a tool
choice or Ollama's `format`; it rides on `NewRequest.grammar` to the engine, which hands it to
the grammar engine (`hetserve/structured/`) to compile. Nothing here knows a grammar engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # source: the schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; source ""
    REGEX = "regex"  # source: the pattern (the whole output matches it)
    CHOICE = "choice"  # source: a JSON list of the allowed strings
    LARK = "lark"  # source: a Lark grammar (llguidance's dialect); GBNF is converted to it


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    source: str
    # JSON schemas: keywords the engine does not implement are an error (OpenAI's
    # `strict: true`) or ignored (False).
    strict: bool = True
    # The request field it came from, named by the 400 when it does not compile; not part of
    # its identity (the same grammar from two fields is compiled once).
    param: str = field(default="response_format", compare=False)

    @property
    def key(self) -> tuple[str, str, bool]:
        """Its identity for the compile cache: the content, never the field."""
        return (self.kind.value, self.source, self.strict)
