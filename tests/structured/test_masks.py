"""The grammar mask worker's unpacking of llguidance's bit words (hetserve/structured/masks.py)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from hetserve.structured.masks import disallowed_tokens


def _words(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = (vocab + 31) // 32
    return rng.integers(-(2**31), 2**31, size=(rows, n), dtype=np.int64).astype(np.int32)


@pytest.mark.parametrize("rows, vocab", [(1, 33), (2, 100), (3, 576)])
def test_a_token_is_disallowed_exactly_where_its_bit_is_clear(rows, vocab):
    bits = _words(rows, vocab)
    out = disallowed_tokens(bits, vocab)
    assert out.dtype is torch.bool and tuple(out.shape) == (rows, vocab)
    for r in range(rows):
        for t in range(vocab):  # brute force: bit t % 32 of word t // 32 (the sign bit at 31)
            word = int(bits[r, t // 32]) & 0xFFFFFFFF
            assert bool(out[r, t]) == (not (word >> (t % 32)) & 1)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_unpacking_a_large_vocabulary_opens_no_openmp_team_in_the_worker():
    if torch.get_num_threads() < 2:
        pytest.skip("torch runs 1 thread here: no team to open")
    bits = _words(4, 151936)  # Qwen's vocabulary: a torch op this size runs on a team
    seen = {}

    def work() -> None:
        seen["before"] = len(os.listdir("/proc/self/task"))
        seen["out"] = disallowed_tokens(bits, 151936)
        seen["after"] = len(os.listdir("/proc/self/task"))

    t = threading.Thread(target=work)
    t.start()
    t.join(30)
    assert seen["after"] == seen["before"]  # no OpenMP worker started for this thread
    assert int(seen["out"].sum()) == int(151936 * 4 - np.unpackbits(bits.view(np.uint8)).sum())
