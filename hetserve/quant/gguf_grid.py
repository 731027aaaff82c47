"""GGUF's grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) as a file
stores them: the rows of Unsloth's dynamic IQ1/IQ2/IQ3 files and bartowski's IQ2/IQ3 quants,
served by the native kernels from these bytes (native/moe_iqg.h), never widened.

Who calls it: the GGUF reader (`model/gguf_file.py`, `KEPT`) for every tensor of these types;
`cpu-gguf`, the int8 linears and the token embeddings read `raw` as it is. `dequantize` is
gguf's own (its numpy definition of the file's numbers, the reference the kernels are tested
against). Pure: arrays in, arrays out; a row whose length is not a whole number of 256-column
super-blocks is the caller's bug (the reader checks shapes against the metadata first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from hetserve.quant.packed import BlockRows


@dataclass(frozen=True)
class GridRows(BlockRows):
    """Super-blocks [.., N, K/256, block bytes] exactly as in a GGUF file."""

    block: ClassVar[int] = 0  # bytes per 256 columns
    # the kernels read a scale per 16 columns (IQ2_XXS, IQ3_*, IQ1_S: one per 32, twice)
    scale_columns: ClassVar[int] = 16

    def dequantize(self) -> torch.Tensor:
        import gguf

        raw = self.raw.contiguous().numpy()
        flat = raw.reshape(-1, raw.shape[-2] * raw.shape[-1])
        qtype = gguf.GGMLQuantizationType[self.ggml]
        values = gguf.quants.dequantize(flat, qtype).astype(np.float32, copy=False)
        return torch.from_numpy(values.reshape(self.shape))


def _rows(name: str, ggml: str, block: int, native: int) -> type[GridRows]:
    fmt = ggml.lower()
    cls: type[GridRows] = dataclass(frozen=True)(
        type(name, (GridRows,), {"fmt": fmt, "ggml": ggml, "block": block, "native": native,
                                 "__doc__": f"{ggml} super-blocks as a GGUF file stores them "
                                            f"({block} bytes per 256 columns)."})  # fmt: skip
    )
    cls.__module__ = __name__
    return cls


IQ2XXSRows = _rows("IQ2XXSRows", "IQ2_XXS", 66, 12)
IQ2XSRows = _rows("IQ2XSRows", "IQ2_XS", 74, 13)
IQ2SRows = _rows("IQ2SRows", "IQ2_S", 82, 14)
IQ3XXSRows = _rows("IQ3XXSRows", "IQ3_XXS", 98, 15)
IQ3SRows = _rows("IQ3SRows", "IQ3_S", 110, 16)
IQ1SRows = _rows("IQ1SRows", "IQ1_S", 50, 17)
IQ1MRows = _rows("IQ1MRows", "IQ1_M", 56, 18)
GRID_TYPES: tuple[type[GridRows], ...] = (IQ2XXSRows, IQ2XSRows, IQ2SRows, IQ3XXSRows, IQ3SRows,
                                          IQ1SRows, IQ1MRows)  # fmt: skip
BY_GGML = {cls.ggml: cls for cls in GRID_TYPES}


def grid_reader(ggml: str) -> Callable[[np.ndarray], GridRows]:
    """The reader of gguf type `ggml`'s tensor data [.., rows, bytes per row] -> its rows."""
    cls = BY_GGML[ggml]

    def read(data: np.ndarray) -> GridRows:
        raw = np.array(data).reshape(*data.shape[:-1], -1, cls.block)  # a writable copy
        return cls(torch.from_numpy(raw))

    return read
