"""Request fields that constrain the output -> one GrammarSpec (or None).

OpenAI's `response_format` (text, json_object, json_schema with strict) and vLLM's extensions:
the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and the newer
`structured_outputs` object ({json | regex | choice | grammar | json_object}). At most one may
ask for a grammar (vLLM's rule); each error names the field. Whether the grammar compiles is
the engine's check (a 400 naming the same field).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from hetserve.core.grammar import GrammarKind, GrammarSpec
from hetserve.errors import InvalidInputError

GUIDED = {
    "guided_json": GrammarKind.JSON_SCHEMA,
    "guided_regex": GrammarKind.REGEX,
    "guided_choice": GrammarKind.CHOICE,
    "guided_grammar": GrammarKind.LARK,
}
STRUCTURED = {
    "json": GrammarKind.JSON_SCHEMA,
    "regex": GrammarKind.REGEX,
    "choice": GrammarKind.CHOICE,
    "grammar": GrammarKind.LARK,
}
# Accepted and without effect: a choice of grammar engine (there is one) and its whitespace.
IGNORED = ("guided_decoding_backend", "guided_whitespace_pattern")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a json_schema's name


def grammar_of(extra: Mapping[str, Any]) -> GrammarSpec | None:
    """The one grammar the request's fields ask for; InvalidInputError naming the field if a
    field is malformed or two ask for one."""
    found = [
        spec
        for spec in (
            response_format(extra.get("response_format")),
            *(_guided(name, extra.get(name)) for name in GUIDED),
            _structured(extra.get("structured_outputs")),
        )
        if spec is not None
    ]
    if len(found) > 1:
        names = ", ".join(s.param.split(".")[0] for s in found)
        raise InvalidInputError(
            f"only one kind of structured output per request; got {names}", found[1].param
        )
    return found[0] if found else None


def response_format(fmt: Any, param: str = "response_format") -> GrammarSpec | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidInputError(f"{param} must be an object with a 'type'", param)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT, "", param=param)
    if kind != "json_schema":
        raise InvalidInputError(
            f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            f"{param}.type",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidInputError(
            f"{param} of type 'json_schema' needs a 'json_schema' object",
            f"{param}.json_schema",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidInputError(
            f"{param}.json_schema.name must be 1-64 letters, digits, '_' or '-'",
            f"{param}.json_schema.name",
        )
    schema = spec.get("schema", {"type": "object"})
    strict = spec.get("strict")
    if not isinstance(schema, dict) or not isinstance(strict, bool | None):
        bad = "schema" if not isinstance(schema, dict) else "strict"
        raise InvalidInputError(
            f"{param}.json_schema.{bad} has the wrong type", f"{param}.json_schema.{bad}"
        )
    return json_schema(schema, f"{param}.json_schema.schema", strict=bool(strict))


def json_schema(schema: Any, param: str, strict: bool = True) -> GrammarSpec:
    if isinstance(schema, str):  # vLLM accepts the schema as JSON text too
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            raise InvalidInputError(f"{param} is not valid JSON", param) from None
    if not isinstance(schema, dict):
        raise InvalidInputError(f"{param} must be a JSON schema object", param)
    # Sorted keys: the same schema from any client is one cache entry.
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    return GrammarSpec(GrammarKind.JSON_SCHEMA, text, strict=strict, param=param)


def _guided(name: str, value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    return _spec(GUIDED[name], value, name)


def _structured(value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidInputError(f"{param} must be an object", param)
    asked = [k for k in (*STRUCTURED, "json_object") if value.get(k) not in (None, False)]
    unknown = sorted(set(value) - {*STRUCTURED, "json_object", "disable_any_whitespace"})
    if unknown:
        raise InvalidInputError(
            f"{param}.{unknown[0]} is not supported (supported: json, regex, choice, grammar, "
            "json_object)",
            f"{param}.{unknown[0]}",
        )
    if len(asked) != 1:
        raise InvalidInputError(
            f"{param} must set exactly one of json, regex, choice, grammar, json_object", param
        )
    key = asked[0]
    if key == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT, "", param=f"{param}.json_object")
    return _spec(STRUCTURED[key], value[key], f"{param}.{key}")


def _spec(kind: GrammarKind, value: Any, param: str) -> GrammarSpec:
    if kind is GrammarKind.JSON_SCHEMA:
        return json_schema(value, param)
    if kind is GrammarKind.CHOICE:
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidInputError(f"{param} must be a non-empty list of strings", param)
        return GrammarSpec(kind, json.dumps(value), param=param)
    if not isinstance(value, str) or not value:
        raise InvalidInputError(f"{param} must be a non-empty string", param)
    return GrammarSpec(kind, value, param=param)
