"""A request body's fields as the Conductor reads them for routing, leniently: a field of the
wrong shape reads as its default, and the instance the request goes to answers the 400 for it
(as it would alone). Pure; called by `conductor.py`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """A boolean field as the instances read it (anything else: the default, and the instance
    answers its 400)."""
    value = body.get(name, default)
    return value if isinstance(value, bool) else default


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_field(body: Mapping[str, Any], name: str, default: int) -> int:
    """An integer field as routing reads it (an integral float too, as the instances take it):
    anything else (a string, a list, null) routes as the default, and the instances answer
    the 400 for what they cannot take."""
    value: Any = body.get(name)
    if isinstance(value, float) and value.is_integer() or is_int(value):
        return int(value)
    return default


def output_limit(body: Mapping[str, Any]) -> int:
    return int_field(body, "max_tokens", 0) or int_field(body, "max_completion_tokens", 0)


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = (p.get("text") for p in content if isinstance(p, dict))
        return "".join(t for t in parts if isinstance(t, str))
    return ""
