"""FP8 block-scaled checkpoints (DeepSeek-V3/R1, Qwen3 FP8): `X.weight` float8_e4m3fn and
`X.weight_scale_inv` fp32 [ceil(N / 128), ceil(K / 128)], weight = fp8 * scale_inv per block.

quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128],
activation_scheme: dynamic}. Activations are ours to handle: this reader is weight-only.
"""

from __future__ import annotations

from typing import Any

import torch

from hetserve.errors import ModelLoadError, TensorShapeError
from hetserve.quant.checkpoint.base import CheckpointFormat
from hetserve.quant.packed import Fp8Rows

SCALE_SUFFIX = "_scale_inv"


class Fp8Format(CheckpointFormat):
    method = "fp8"
    packed_fmt = "fp8"

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> Fp8Format:
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ModelLoadError(f"fp8 quantization_config fmt {fmt!r} is not supported; only e4m3")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ModelLoadError(
                f"fp8 activation_scheme {scheme!r} is not supported (it carries static input "
                "scales); only dynamic"
            )
        block = qc.get("weight_block_size")
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(b > 0 for b in block)):
            raise ModelLoadError(
                f"fp8 weight_block_size {block!r} is not supported; block-scaled FP8 needs "
                "[rows, columns], e.g. [128, 128] (per-tensor FP8 is not read)"
            )
        return cls((int(block[0]), int(block[1])))

    def part_of(self, name: str, dtype: str) -> tuple[str, str] | None:
        if name.endswith(".weight" + SCALE_SUFFIX):
            return name[: -len(SCALE_SUFFIX)], "scale"
        if dtype == "F8_E4M3" and name.endswith(".weight"):
            return name, "weight"
        self.check_plain(name, dtype)
        return None

    def required_roles(self, logical: str) -> tuple[str, ...]:
        return ("weight", "scale")

    def decode(self, logical: str, parts: dict[str, torch.Tensor]) -> Fp8Rows:
        w, scale = parts["weight"], parts["scale"].float()
        if w.dim() != 2:
            raise TensorShapeError(f"fp8 tensor {logical!r} has {w.dim()} dims; expected 2")
        (n, k), (bn, bk) = w.shape, self.block
        want = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) != want:
            raise TensorShapeError(
                f"tensor '{logical}{SCALE_SUFFIX}' has shape {tuple(scale.shape)}, expected "
                f"{want} for a {(n, k)} weight in {self.block} blocks"
            )
        return Fp8Rows(w, scale.repeat_interleave(bn, dim=0)[:n].contiguous(), block_k=bk)
