"""The reference q6_K and q5_K quantizers, where tests have always imported them from (they live
in quant/gguf_quants.py since the GGUF loader converts to those formats too)."""

from hetserve.quant.gguf_quants import quantize_q5_k, quantize_q6_k

__all__ = ["quantize_q5_k", "quantize_q6_k"]
