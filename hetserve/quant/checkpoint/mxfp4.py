"""MXFP4 checkpoints (gpt-oss): `X_blocks` uint8 [.., N, K/32, 16] (two e2m1 codes a byte,
element 2j in the low nibble) and `X_scales` uint8 [.., N, K/32] (e8m0: 2^(s - 127)).

quantization_config: {quant_method: mxfp4, modules_to_not_convert: [...]}. The blocks are kept
as published (quant/packed.py `Mxfp4Rows`); other weights are ordinary bf16 tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from hetserve.errors import ModelLoadError, TensorShapeError
from hetserve.quant.checkpoint.base import CheckpointFormat
from hetserve.quant.packed import Mxfp4Rows


class Mxfp4Format(CheckpointFormat):
    method = "mxfp4"
    packed_fmt = "mxfp4"

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> Mxfp4Format:
        return cls()

    def part_of(self, name: str, dtype: str) -> tuple[str, str] | None:
        for suffix, role in (("_blocks", "blocks"), ("_scales", "scales")):
            if name.endswith(suffix):
                if dtype != "U8":
                    raise ModelLoadError(f"mxfp4 tensor {name!r} must be uint8, not {dtype}")
                return name[: -len(suffix)], role
        self.check_plain(name, dtype)
        return None

    def required_roles(self, logical: str) -> tuple[str, ...]:
        return ("blocks", "scales")

    def decode(self, logical: str, parts: dict[str, torch.Tensor]) -> Mxfp4Rows:
        blocks, scales = parts["blocks"], parts["scales"]
        if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
            raise TensorShapeError(
                f"mxfp4 tensors '{logical}_blocks' {tuple(blocks.shape)} and '{logical}_scales' "
                f"{tuple(scales.shape)} do not form 32-element blocks [.., N, K/32, 16]"
            )
        return Mxfp4Rows(blocks, scales)
