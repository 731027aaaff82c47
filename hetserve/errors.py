"""Typed errors for user mistakes. Each message is one line naming the problem and the fix.

The CLI prints any HetserveError as `error: <message>` and exits 2; the server maps them to 4xx.
Our own bugs stay ordinary exceptions (and asserts), so they are never mistaken for user errors.
"""

from __future__ import annotations


class HetserveError(Exception):
    """Base of every error caused by input, configuration or environment, not by our bugs."""


class InvalidInputError(HetserveError, ValueError):
    """A request or argument is malformed or out of range. `param` names the offending field
    where there is one (the server reports it as OpenAI's `error.param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(HetserveError):
    """A model directory cannot be loaded as given."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    pass


class UnsupportedArchitectureError(ModelLoadError):
    pass


class MissingTensorError(ModelLoadError):
    pass


class TensorShapeError(ModelLoadError):
    pass


class PromptTooLongError(InvalidInputError):
    pass
