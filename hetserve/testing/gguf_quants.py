"""The reference q6_K and q5_K quantizers, where tests have always imported them from (they live
in quant/gguf_quants.py since the GGUF loader converts to those formats too), and random
IQ4_XS / IQ4_NL blocks: the i-quant kernels' tests where llama.cpp's quantizer
(testing/ggml_quant.py) is not installed."""

import numpy as np

from hetserve.quant.gguf_quants import quantize_q2_k, quantize_q3_k, quantize_q5_k, quantize_q6_k


def random_iq4(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random `kind` ("IQ4_XS" or "IQ4_NL") blocks for a [rows, cols] matrix as a file stores
    them ([rows, bytes]): every bit pattern is a valid block; each fp16 d is set small enough
    that |w| < 0.2 (IQ4_XS: |w| <= 32 * 127 d; IQ4_NL: 127 d)."""
    g = np.random.default_rng(seed)
    block, cols_per = (136, 256) if kind == "IQ4_XS" else (18, 32)
    raw = g.integers(0, 256, (rows, cols // cols_per, block), dtype=np.uint8)
    scale = 1e-5 if kind == "IQ4_XS" else 3e-4
    d = g.uniform(0.5, 1.5, raw.shape[:2]) * g.choice([-1, 1], raw.shape[:2]) * scale
    raw[:, :, :2] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


# Grid i-quants: bytes per 256 columns and the fp16 d that keeps |w| < ~0.2 (the largest
# |D * sc * v|: IQ2 d / 8 * 31 * 43, IQ3_XXS d / 4 * 31 * 62, IQ3_S d * 31 * 15, IQ1 d / 8 * 15 * 9)
_GRID = {"IQ2_XXS": (66, 1e-3), "IQ2_XS": (74, 1e-3), "IQ2_S": (82, 1e-3), "IQ3_XXS": (98, 3e-4),
         "IQ3_S": (110, 3e-4), "IQ1_S": (50, 1e-2), "IQ1_M": (56, 1e-2)}  # fmt: skip


def random_iq_grid(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random `kind` (a grid i-quant: IQ2_XXS ... IQ1_M) blocks for a [rows, cols] matrix as a
    file stores them ([rows, bytes]): every index, sign and scale bit pattern is valid; each
    super-block's fp16 d is set (IQ1_M: in the top nibbles of its four scale words) to a
    random sign and size that keeps |w| below ~0.2."""
    g = np.random.default_rng(seed)
    block, scale = _GRID[kind]
    raw = g.integers(0, 256, (rows, cols // 256, block), dtype=np.uint8)
    d = (g.uniform(0.5, 1.5, raw.shape[:2]) * g.choice([-1, 1], raw.shape[:2]) * scale)
    bits = d.astype(np.float16).view(np.uint16)
    if kind != "IQ1_M":
        raw[:, :, :2] = bits[..., None].view(np.uint8)
    else:  # d's 4 nibbles, lowest first, in bits 12-15 of the words at bytes 48, 50, 52, 54
        words = raw[:, :, 48:56].copy().view(np.uint16)
        for i in range(4):
            words[..., i] = (words[..., i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        raw[:, :, 48:56] = words.view(np.uint8)
    return raw.reshape(rows, -1)


__all__ = ["quantize_q2_k", "quantize_q3_k", "quantize_q5_k", "quantize_q6_k", "random_iq4",
           "random_iq_grid"]
