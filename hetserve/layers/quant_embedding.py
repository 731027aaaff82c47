"""QuantEmbedding: token embeddings served from a GGUF file's own quantized rows.

Who uses it: model/build.py `apply_dense_backends`, for a GGUF checkpoint served under
`all-int8` whose `token_embd` is q8_0 or a K-quant (the types the loader keeps as they are; the
embedding's weight was then left unallocated and the file's matrix kept, model/loader.py,
model/filler.py). A lookup dequantizes only the rows it gathers, so each row is exactly what
dequantizing the file gives (as llama.cpp reads it) at a quarter (q8_0) or an eighth (q4_K) of
fp32's bytes: on a 151,936 x 2,048 vocabulary (Qwen3-30B-A3B) 0.33 or 0.18 GB instead of
1.24 GB. Other types stay fp32 embeddings (rounding them to int8 would change the file's
numbers). An id out of range is torch's IndexError, as with nn.Embedding.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hetserve.quant.packed import QMatrix

# Matrices holding a GGUF file's super-blocks as they are, by their type's name: a lookup hands
# the gathered rows' bytes to gguf's own numpy dequantize (the definition of the file's numbers;
# 0.1-0.3 ms a token against 0.6-1.0 ms of small torch ops through the QMatrix fields).
_GGML = {"Q4KRows": "Q4_K", "Q5KRows": "Q5_K", "Q6KRows": "Q6_K", "IQ4XSRows": "IQ4_XS",
         "IQ4NLRows": "IQ4_NL"}  # fmt: skip


class QuantEmbedding(nn.Module):
    def __init__(self, rows: QMatrix) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = rows.shape
        self._type = type(rows)
        # buffers: moved like any module's tensors, and counted as dense memory
        # (model/memory_facts.py) once
        for field in rows.row_dims:
            self.register_buffer(field, getattr(rows, field).contiguous(), persistent=False)

    @property
    def fmt(self) -> str:
        return self._type.__name__

    def matrix(self) -> QMatrix:
        return self._type(**{f: getattr(self, f) for f in self._type.row_dims})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.num_embeddings:
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        ggml = _GGML.get(self.fmt)
        if ggml is not None:  # the file's own blocks: gguf's numpy dequantize, a few ops
            import gguf

            raw = self.raw[flat].numpy().reshape(flat.shape[0], -1)  # type: ignore[operator]
            deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml])
            rows = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))
        else:
            rows = self.matrix().rows(flat).dequantize()
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt}"
