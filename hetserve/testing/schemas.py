"""Fifty JSON schemas of the shapes real applications send, for structured-output tests and the
`bench serve` structured-output dataset.

No package ships JSONSchemaBench's sets, so this is our own list, built to cover what those
sets exercise (their "GitHub easy/medium" and "Glaive function-call" groups): nested objects,
arrays with bounds, enums and consts, patterns, numeric ranges, string formats, anyOf,
`$defs`/`$ref`, optional properties. Strings and arrays are bounded and objects closed
(`additionalProperties: false`, as OpenAI's strict mode requires) so that even a random model
reaches the end of a document within a few hundred tokens.
"""

from __future__ import annotations

import random
from typing import Any

Schema = dict[str, Any]


def _closed(props: dict[str, Schema], required: list[str] | None = None) -> Schema:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


def _str(n: int = 12, **kw: Any) -> Schema:
    return {"type": "string", "maxLength": n, **kw}


LEAVES: list[Schema] = [
    _str(),
    _str(6, minLength=1),
    {"type": "integer", "minimum": -1000, "maximum": 1000},
    {"type": "integer", "minimum": 0, "maximum": 100},
    # Numbers as enums: a random model may write a float's digits forever (a real model ends
    # them; the bench's dataset has free numbers).
    {"enum": [0.5, -1.25, 3.0]},
    {"type": "boolean"},
    {"enum": ["red", "green", "blue"]},
    {"enum": [1, 2, 3, None]},
    {"const": "v1"},
    _str(12, pattern="^[A-Z]{3}-[0-9]{2}$"),
    {"type": "string", "format": "date"},
    {"type": "string", "format": "email", "maxLength": 24},
    {"type": "null"},
    {"type": "array", "items": {"type": "integer", "maximum": 9, "minimum": 0}, "maxItems": 3},
    {"type": "array", "items": _str(5), "minItems": 1, "maxItems": 2},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, _str(4)]},
]
NAMES = ["id", "name", "count", "score", "active", "color", "level", "tag", "code", "day"]


def schema_set(n: int = 50, seed: int = 0) -> list[Schema]:
    """`n` schemas, the same ones for a given seed: a few hand-written application shapes,
    then random compositions of LEAVES (nested, optional, referenced)."""
    out = list(_HANDWRITTEN)
    rng = random.Random(seed)
    while len(out) < n:
        out.append(_random_schema(rng, depth=0))
    return out[:n]


def _random_schema(rng: random.Random, depth: int) -> Schema:
    names = rng.sample(NAMES, rng.randint(1, 4))
    props: dict[str, Schema] = {}
    for name in names:
        roll = rng.random()
        if depth < 2 and roll < 0.2:
            props[name] = _random_schema(rng, depth + 1)
        elif depth < 2 and roll < 0.3:
            props[name] = {"type": "array", "items": _random_schema(rng, 2), "maxItems": 2}
        else:
            props[name] = rng.choice(LEAVES)
    required = [k for k in names if rng.random() < 0.7] or names[:1]
    schema = _closed(props, required)
    if depth == 0 and rng.random() < 0.2:  # a $ref into $defs, as generated schemas have
        schema = {
            "$defs": {
                "item": _closed(
                    {"sku": _str(8), "qty": {"type": "integer", "minimum": 1, "maximum": 9}}
                )
            },
            **schema,
        }
        schema["properties"]["item"] = {"$ref": "#/$defs/item"}
    return schema


_HANDWRITTEN: list[Schema] = [
    # a function call's arguments (Glaive / BFCL style)
    _closed({"location": _str(20), "unit": {"enum": ["celsius", "fahrenheit"]}}, ["location"]),
    # an extraction result
    _closed(
        {
            "people": {
                "type": "array",
                "maxItems": 2,
                "items": _closed(
                    {"name": _str(10), "age": {"type": "integer", "minimum": 0, "maximum": 120}}
                ),
            }
        }
    ),
    # a classification with a rationale
    _closed(
        {
            "label": {"enum": ["spam", "ham"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        }
    ),
    # an order (patterns, nested arrays, optional note)
    _closed(
        {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": _closed(
                    {
                        "sku": _str(8, pattern="^[A-Z]{3}-[0-9]{4}$"),
                        "qty": {"type": "integer", "maximum": 9},
                    }
                ),
            },
            "note": _str(16),
            "status": {"enum": ["open", "paid", "shipped"]},
        },
        ["order_id", "items", "status"],
    ),
    # a config file (booleans, nested object, const version)
    _closed(
        {
            "version": {"const": 2},
            "debug": {"type": "boolean"},
            "server": _closed({"host": _str(15), "port": {"type": "integer", "maximum": 65535}}),
        }
    ),
]
