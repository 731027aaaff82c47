"""Engine-side failures (not user mistakes: those are `hetserve.errors.InvalidInputError`)."""

from __future__ import annotations


class EngineRequestError(RuntimeError):
    """One request failed inside the engine (the others went on). The message is one line."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed in the engine: {message}")
        self.request_id = request_id
        self.reason = message


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""
