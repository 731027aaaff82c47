"""Registry: a name -> implementation table, filled lazily by the modules that implement them.

One small piece behind every place hetserve picks an implementation by name: model classes by
HF architecture (`model/registry.py`), routed-expert backends (`moe/experts.py`) and KV store
backends by URL scheme (`store/registry.py`).

A registry knows where each built-in name lives: either "module:attribute" (looked up on first
use) or "module" (imported on first use; it registers its names with `@registry.register`). So
importing a registry costs nothing, optional dependencies load only for whoever uses them, and
no import cycle forms between a registry and its implementations. An unknown name raises the
registry's error class (a HetserveError: a user's mistake) listing the known names; a name
registered twice is our bug (RuntimeError).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from hetserve.errors import HetserveError, InvalidInputError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(
        self,
        kind: str,
        builtins: Mapping[str, str],
        error: type[HetserveError] = InvalidInputError,
    ) -> None:
        """`kind` names entries in messages ("experts backend"); `builtins` maps each built-in
        name to "module:attribute" or to the "module" that registers it."""
        self.kind = kind
        self.error = error
        self._builtins = dict(builtins)
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise RuntimeError(f"{self.kind} {name!r} registered twice")
            self._entries[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        if name not in self._entries and name in self._builtins:
            self._load(name)
        try:
            return self._entries[name]
        except KeyError:
            raise self.error(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._builtins

    def names(self) -> list[str]:
        return sorted(set(self._entries) | set(self._builtins))

    def _load(self, name: str) -> None:
        module, _, attr = self._builtins[name].partition(":")
        loaded = importlib.import_module(module)
        if attr:
            self._entries[name] = getattr(loaded, attr)
