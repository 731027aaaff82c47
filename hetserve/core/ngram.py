"""Prompt-lookup drafts for speculative decoding (vLLM's `ngram` method).

Called by the engine (`engine/speculative.py`) once a step for each decoding sequence, with the
sequence's tokens (prompt and output so far): the draft is what followed the latest earlier
occurrence of the sequence's last n tokens, n from `n_max` down to `n_min` (the longest match
wins, then the latest). Where the output copies from its context (an edit of the prompt's code,
a quoted passage, a reply that repeats itself) the drafts are often right, and the engine checks
all of them in one forward. Pure: no I/O, no clock, no state; nothing raises for any list of
ints (an empty draft means "no match").
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
