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

from hetserve.quant.packed import BlockRows, QMatrix

# Matrices holding a GGUF file's blocks as they are (BlockRows): a lookup dequantizes the
# gathered rows natively (native/gguf_rows.c, by the type's `native` number: microseconds a
# row, gguf's own numbers), else through gguf's numpy dequantize of its `ggml` type (the
# definition of those numbers; 0.1-0.7 ms a lookup, mostly array set-up, against 0.6-1.0 ms of
# small torch ops through the QMatrix fields).


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
        blocks = issubclass(self._type, BlockRows)
        if blocks and (rows := self._native_rows(flat)) is not None:
            return rows.view(*ids.shape, self.embedding_dim)
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.num_embeddings:
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        if not blocks:
            rows = self.matrix().rows(flat).dequantize()
        else:  # gguf's numpy dequantize, a few ops
            import gguf

            raw = self.raw[flat].numpy().reshape(flat.shape[0], -1)  # type: ignore[operator]
            qtype = gguf.GGMLQuantizationType[self._type.ggml]  # type: ignore[attr-defined]
            deq = gguf.quants.dequantize(raw, qtype)
            rows = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))
        return rows.view(*ids.shape, self.embedding_dim)

    def _native_rows(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The rows by native/gguf_rows.c (ids checked there), or None where the kernels are
        off or unavailable."""
        from hetserve import envs
        from hetserve.native import optional_kernel

        fn = optional_kernel("hetserve_gguf_rows") if envs.native_kernels() else None
        raw = self.raw  # [rows, blocks, block bytes] uint8, contiguous (a registered buffer)
        if fn is None or raw.device.type != "cpu":  # type: ignore[union-attr]
            return None
        ids = flat.long().contiguous()  # no copy when it is already
        out = torch.empty(ids.shape[0], self.embedding_dim)
        native = self._type.native  # type: ignore[attr-defined]
        rc = fn(native, raw.data_ptr(), raw.stride(0),  # type: ignore[union-attr]
                self.num_embeddings, ids.data_ptr(), ids.shape[0], self.embedding_dim,
                out.data_ptr())  # fmt: skip
        if rc == -2:
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt}"
