"""What the scheduler needs for preemption by swap, as a protocol: the engine's host swap
(`engine/swap.py`) implements it; the scheduler calls it on the engine thread.

A preempted request's KV blocks (and, for a linear-attention model, its working state slot) are
copied to host memory before its device blocks are freed, and copied into freshly allocated
blocks when it is admitted again, so it resumes where it stopped instead of recomputing. The
copies are synchronous: the blocks are handed out again by the same scheduling pass, and the
next forward writes over them.

Failure: `swap_out` returns False (no room in the swap space, or nothing to keep) and the
request is preempted by recompute instead; nothing else fails on user input.
"""

from __future__ import annotations

from typing import Protocol


class Swapper(Protocol):
    def swap_out(self, request_id: str, block_ids: list[int], state_slot: int | None) -> bool:
        """Copy the request's blocks (in table order) and state slot to host memory."""
        ...

    def swap_in(self, request_id: str, block_ids: list[int], state_slot: int | None) -> None:
        """Copy what `swap_out` kept into the leading `block_ids` and `state_slot`; forget it."""
        ...

    def holds(self, request_id: str) -> bool: ...

    def drop(self, request_id: str) -> None:
        """Forget the request's copies (it finished or was aborted while swapped out)."""
        ...

    def swapped(self) -> set[str]: ...
