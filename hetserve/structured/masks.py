"""Token masks computed beside the forward: started before it, waited for after the logits.

The mask of a step depends only on the tokens a sequence accepted before that step, so it can
be computed while the model runs (llguidance and xgrammar both recommend this). llguidance's
executor drops the GIL while it computes, so the forward's torch threads and the mask worker
run side by side; the executor waits for the job only when it is about to sample. The worker
unpacks the bits with numpy, never with a torch op large enough for a parallel region: that
would give its thread an OpenMP team of its own beside the engine thread's, and with two teams
libgomp wakes the engine's workers through the kernel at every region from then on
(native/openmp.py).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from hetserve.structured.compiler import GrammarMatcher


def disallowed_tokens(bits: np.ndarray, vocab_size: int) -> torch.Tensor:
    """bool [n, vocab_size], True where bit (t % 32) of word t // 32 of a row is 0: llguidance's
    int32 mask words (bit i of a word is token 32 w + i) unpacked in numpy, single-threaded."""
    words = np.ascontiguousarray(bits, dtype="<i4")  # little-endian bytes: bit 0 first
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(allowed[:, :vocab_size] == 0)


class MaskJob:
    """The allowed tokens of a batch of matchers, being computed."""

    def __init__(self, future: Future[torch.Tensor]) -> None:
        self._future = future

    def wait(self) -> torch.Tensor:
        """bool [len(matchers), vocab_size]: True where the grammar forbids the token."""
        return self._future.result()


class MaskWorker:
    """One worker thread and one llguidance executor, made at the first grammar request."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._ll = llguidance.LLExecutor()

    def start(self, matchers: list[GrammarMatcher], vocab_size: int) -> MaskJob:
        return MaskJob(self._pool.submit(self._compute, matchers, vocab_size))

    def _compute(self, matchers: list[GrammarMatcher], vocab_size: int) -> torch.Tensor:
        n, words = len(matchers), (vocab_size + 31) // 32
        bits = np.empty((n, words), dtype=np.int32)
        self._ll.unsafe_compute_mask_ptr(
            [(m.ll, i) for i, m in enumerate(matchers)], bits.ctypes.data, words * 4, n
        )
        # Built here, beside the forward, in the form the sampler applies as it is.
        return disallowed_tokens(bits, vocab_size)


_WORKER: MaskWorker | None = None


def start_masks(matchers: list[GrammarMatcher], vocab_size: int) -> MaskJob:
    """Start computing the masks of `matchers` (on the process's one mask worker)."""
    global _WORKER
    if _WORKER is None:  # only the engine thread calls this
        _WORKER = MaskWorker()
    return _WORKER.start(matchers, vocab_size)
