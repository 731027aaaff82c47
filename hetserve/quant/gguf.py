"""GGUF block types as a file stores them, read into `QMatrix` rows without rounding again.

Who calls it: the GGUF reader (`model/gguf_file.py`) for every quantized tensor it keeps packed.
`data` is the tensor's raw bytes as the `gguf` package maps them ([.., rows, bytes per row]);
the result holds exactly the file's numbers. A block size that does not divide a row is the
caller's bug (the reader checks tensor shapes against the file's metadata first).
"""

from __future__ import annotations

import numpy as np
import torch

from hetserve.quant.packed import Int8Rows, Q4KRows

Q8_0_BLOCK_BYTES = 34  # fp16 d, 32 int8
Q4_K_BLOCK_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums, 128 of nibbles


def f16_values(raw: np.ndarray) -> torch.Tensor:
    """Little-endian fp16 bytes -> fp32 values."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


def q8_0_rows(data: np.ndarray) -> Int8Rows:
    """q8_0 blocks [.., rows, n * 34] -> Int8Rows (group 32), exactly."""
    blocks = data.reshape(*data.shape[:-1], -1, Q8_0_BLOCK_BYTES)
    scale = f16_values(blocks[..., :2]).squeeze(-1)
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
    return Int8Rows(q.reshape(*q.shape[:-2], -1), scale)


def q4_k_rows(data: np.ndarray) -> Q4KRows:
    """q4_K super-blocks [.., rows, n * 144] -> Q4KRows: the file's bytes, unchanged."""
    raw = np.array(data).reshape(*data.shape[:-1], -1, Q4_K_BLOCK_BYTES)  # a writable copy
    return Q4KRows(torch.from_numpy(raw))
