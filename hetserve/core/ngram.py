"""Prompt-lookup drafts for speculative decoding (vLLM's `ngram` method), and where an output
follows a predicted text (OpenAI's Predicted Outputs).

Called by the engine (`engine/speculative.py`) once a step for each decoding sequence, with the
sequence's tokens (prompt and output so far): the draft is what followed the latest earlier
occurrence of the sequence's last n tokens, n from `n_max` down to `n_min` (the longest match
wins, then the latest). Where the output copies from its context (an edit of the prompt's code,
a quoted passage, a reply that repeats itself) the drafts are often right, and the engine checks
all of them in one forward. `align` finds where a sequence's output continues in a
reference it is expected to follow (a request's `prediction`: the file an edit rewrites), so
the drafts are the reference's next tokens. Pure: no I/O, no clock, no state; nothing raises for
any list of ints (an empty draft or None means "no match").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose(tokens: Sequence[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of length n in [n_min, n_max] that occurred before; [] where none did."""
    arr = np.asarray(tokens, dtype=np.int64)
    size = arr.shape[0]
    if k < 1 or n_min < 1:
        return []
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # Starts i with tokens[i : i + n] == the suffix and at least one token after them
        # (i + n <= size - 1): i in [0, size - n - 1].
        last = size - n
        match = arr[:last] == arr[last]
        for j in range(1, n):
            if not match.any():
                break
            match &= arr[j : last + j] == arr[last + j]
        hits = np.flatnonzero(match)
        if hits.size:
            at = int(hits[-1]) + n
            return [int(t) for t in arr[at : at + k]]
    return []


def align(
    reference: Sequence[int] | np.ndarray,
    tokens: Sequence[int] | np.ndarray,
    start: int,
    n_min: int,
    n_max: int,
) -> int | None:
    """The position in `reference` just after an occurrence of the last n `tokens`, for the
    longest n in [n_min, n_max] that occurs there; among that n's occurrences the first that
    ends at or after `start` (an output moves forward through what it rewrites), else the last
    before it. None where no such n occurs."""
    ref = np.asarray(reference, dtype=np.int64)
    arr = np.asarray(tokens, dtype=np.int64)
    if n_min < 1:
        return None
    for n in range(min(n_max, arr.shape[0], ref.shape[0]), n_min - 1, -1):
        suffix = arr[arr.shape[0] - n :]
        last = ref.shape[0] - n + 1  # starts i in [0, len(reference) - n]
        match = ref[:last] == suffix[0]
        for j in range(1, n):
            if not match.any():
                break
            match &= ref[j : last + j] == suffix[j]
        ends = np.flatnonzero(match) + n
        if ends.size:
            ahead = ends[ends >= start]
            return int(ahead[0]) if ahead.size else int(ends[-1])
    return None
