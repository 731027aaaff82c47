"""compressed-tensors "pack-quantized" checkpoints (Kimi-K2 Thinking, llm-compressor W4A16):
`X.weight_packed` int32 [N, K/8] (8 nibbles a word along the input, lowest bits first, each
the signed value + 8), `X.weight_scale` [N, K/g], `X.weight_shape` [2] and, asymmetric only,
`X.weight_zero_point` int32 [N/8, K/g] packed along rows; weight = (q - zero) * scale.

quantization_config: {quant_method: compressed-tensors, format: pack-quantized,
config_groups: {group_0: {weights: {num_bits: 4, type: int, strategy: group, group_size: 32,
symmetric: true}}}, ignore: [...]}. Read onto `Int4Rows` without requantizing: nibbles as
stored, minimum = -(8 + zero) * scale (exact in fp32).
"""

from __future__ import annotations

from typing import Any

import torch

from hetserve.errors import ModelLoadError, TensorShapeError
from hetserve.quant.checkpoint.base import CheckpointFormat
from hetserve.quant.checkpoint.gptq import unpack_int32_nibbles
from hetserve.quant.packed import Int4Rows

_ROLES = {
    ".weight_packed": "packed",
    ".weight_scale": "scale",
    ".weight_zero_point": "zero",
    ".weight_shape": "shape",
    ".weight_g_idx": "g_idx",
}


def _check_weights(name: str, args: dict[str, Any] | None) -> None:
    if not args:
        raise ModelLoadError(f"compressed-tensors config group {name!r} quantizes no weights")
    bits, kind = args.get("num_bits"), args.get("type", "int")
    if bits != 4 or kind != "int":
        raise ModelLoadError(
            f"compressed-tensors config group {name!r}: {bits}-bit {kind} weights are not "
            "supported; only 4-bit int (pack-quantized)"
        )
    if args.get("strategy", "group") not in ("group", "channel"):
        raise ModelLoadError(
            f"compressed-tensors strategy {args.get('strategy')!r} is not supported; "
            "supported: group, channel"
        )
    if args.get("actorder") not in (None, False):
        raise ModelLoadError("compressed-tensors with actorder is not supported")


class CompressedTensorsFormat(CheckpointFormat):
    method = "compressed-tensors"
    part_suffixes = _ROLES
    packed_fmt = "int4"

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> CompressedTensorsFormat:
        fmt = qc.get("format")
        if fmt != "pack-quantized":
            raise ModelLoadError(
                f"compressed-tensors format {fmt!r} is not supported; supported: pack-quantized"
            )
        if qc.get("quantization_status", "compressed") != "compressed":
            raise ModelLoadError("compressed-tensors checkpoint is not in 'compressed' status")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise ModelLoadError("compressed-tensors quantization_config has no config_groups")
        for name, group in groups.items():
            if group.get("input_activations") or group.get("output_activations"):
                raise ModelLoadError(
                    f"compressed-tensors config group {name!r} quantizes activations; only "
                    "weight-only (W4A16) checkpoints are supported"
                )
            _check_weights(name, group.get("weights"))
        return cls()

    def required_roles(self, logical: str) -> tuple[str, ...]:
        return ("packed", "scale", "shape")

    def decode(self, logical: str, parts: dict[str, torch.Tensor]) -> Int4Rows:
        packed, scale = parts["packed"], parts["scale"].float()
        n, k = (int(v) for v in parts["shape"].tolist())
        if packed.dtype != torch.int32 or packed.shape[0] != n or k % 8 or scale.shape[0] != n:
            raise TensorShapeError(
                f"compressed-tensors tensors of {logical!r} (packed {tuple(packed.shape)}, "
                f"scale {tuple(scale.shape)}) do not fit weight_shape {(n, k)}"
            )
        if k % scale.shape[1]:
            raise TensorShapeError(f"{logical!r}: {scale.shape[1]} groups do not divide {k}")
        if parts.get("g_idx") is not None:
            raise ModelLoadError(f"{logical!r} has a g_idx (act-order); not supported")
        codes = packed.contiguous().view(torch.uint8)[:, : k // 2].contiguous()
        offset = torch.full_like(scale, 8.0)
        zero = parts.get("zero")
        if zero is not None:  # packed along rows, stored as value + 8
            z = unpack_int32_nibbles(zero.t().contiguous())[:, :n].t().float() - 8
            offset = offset + z
        return Int4Rows(codes, scale.contiguous(), (-offset * scale).contiguous())
