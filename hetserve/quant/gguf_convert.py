"""GGUF types without a native kernel (q4_0/q4_1/q5_0/q5_1, the ternary TQ1_0/TQ2_0) converted at
load to the nearest native format of no more bits per weight: which one (`convert_target`),
the conversion itself (`converted`, round to nearest) and the error the loader reports
(`relative_rms`). Who calls it: the GGUF loader (`model/gguf_file.py`) per tensor. Pure: arrays
in, arrays out; an unknown target is a KeyError (the loader only passes convert_target's).
"""

from __future__ import annotations

import numpy as np
import torch

from hetserve.quant.gguf import q2_k_rows, q3_k_rows, q4_k_rows, q5_k_rows, q6_k_rows, quantize_q4_k
from hetserve.quant.gguf_quants import quantize_q2_k, quantize_q3_k, quantize_q5_k, quantize_q6_k
from hetserve.quant.packed import Int8Rows, QMatrix

# Native formats a converted tensor may take, with bits per weight: the kernels' q2_K-q6_K
# super-blocks (rows of whole 256s) and q8_0 (any multiple of 32).
NATIVE_BPW = {"q2_K": 2.625, "q3_K": 3.4375, "q4_K": 4.5, "q5_K": 5.5, "q6_K": 6.5625,
              "q8_0": 8.5}  # fmt: skip


def convert_target(bpw: float, k: int) -> str:
    """The native format a type of `bpw` bits per weight converts to, for rows of `k` columns:
    the largest that has no more bits per weight (q5_0: q5_K, q4_0: q4_K); where none has that
    few (TQ1_0, TQ2_0: below q2_K's 2.625), the smallest, q2_K. Rows off 256 can only take
    q8_0."""
    if k % 256:
        return "q8_0"
    fits = [f for f, b in NATIVE_BPW.items() if b <= bpw]
    return max(fits, key=NATIVE_BPW.__getitem__) if fits else "q2_K"


def relative_rms(approx: np.ndarray, exact: np.ndarray) -> float:
    """RMS of approx - exact over the RMS of exact (0 for an all-zero tensor)."""
    num = float(np.sqrt(np.mean((approx.astype(np.float64) - exact) ** 2)))
    den = float(np.sqrt(np.mean(exact.astype(np.float64) ** 2)))
    return num / den if den > 0 else 0.0


def converted(w: np.ndarray, target: str) -> QMatrix:
    """Dequantized weights [.., N, K] -> `target` (convert_target's) rows, round to nearest."""
    k = w.shape[-1]
    flat = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, k)
    if target == "q8_0":  # (an f32 tensor of the file is its read-only mapping: copied)
        m = Int8Rows.q8_0(torch.from_numpy(flat if flat.flags.writeable else flat.copy()))
        return Int8Rows(m.q.reshape(w.shape), m.scale.reshape(*w.shape[:-1], -1))
    quantize, rows = {"q2_K": (quantize_q2_k, q2_k_rows), "q3_K": (quantize_q3_k, q3_k_rows),
                      "q4_K": (quantize_q4_k, q4_k_rows), "q5_K": (quantize_q5_k, q5_k_rows),
                      "q6_K": (quantize_q6_k, q6_k_rows)}[target]  # fmt: skip
    return rows(quantize(flat).reshape(*w.shape[:-1], -1))
