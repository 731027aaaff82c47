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


__all__ = ["quantize_q2_k", "quantize_q3_k", "quantize_q5_k", "quantize_q6_k", "random_iq4"]
