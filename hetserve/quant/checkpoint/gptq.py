"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum): per quantized linear `X.qweight` int32
[K/8, N] (8 nibbles a word along the input, lowest bits first), `X.qzeros` int32 [K/g, N/8],
`X.scales` fp16 [K/g, N] and `X.g_idx` int32 [K]; weight = scale * (q - zero), where the
original format ("gptq", v1) stores zero - 1 and "gptq_v2" the zero itself.

quantization_config: {quant_method: gptq, bits: 4, group_size: 128, desc_act: false, sym: true,
checkpoint_format: gptq}. Read onto `Int4Rows` without requantizing: nibbles unchanged (a
transpose of the words), scale per group, minimum = -zero * scale (exact in fp32).
"""

from __future__ import annotations

from typing import Any

import torch

from hetserve.errors import ModelLoadError, TensorShapeError
from hetserve.quant.checkpoint.base import CheckpointFormat
from hetserve.quant.packed import Int4Rows

_ROLES = {".qweight": "qweight", ".qzeros": "qzeros", ".scales": "scales", ".g_idx": "g_idx"}


def unpack_int32_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [.., M] -> int [.., 8M]: nibble i of word m is element 8m + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(*words.shape[:-1], -1)


class GptqFormat(CheckpointFormat):
    method = "gptq"
    part_suffixes = _ROLES
    packed_fmt = "int4"

    def __init__(self, group_size: int, zero_offset: int) -> None:
        self.group_size = group_size  # -1: one group per row
        self.zero_offset = zero_offset

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> GptqFormat:
        bits = qc.get("bits", 4)
        if bits != 4:
            raise ModelLoadError(f"gptq with bits={bits} is not supported; only 4-bit GPTQ")
        if qc.get("desc_act"):
            raise ModelLoadError(
                "gptq with desc_act=true (act-order groups) is not supported; use a checkpoint "
                "quantized with desc_act=false"
            )
        if qc.get("dynamic"):
            raise ModelLoadError("gptq with per-module 'dynamic' overrides is not supported")
        layout = qc.get("checkpoint_format", "gptq")
        if layout not in ("gptq", "gptq_v2"):
            raise ModelLoadError(
                f"gptq checkpoint_format {layout!r} is not supported; supported: gptq, gptq_v2"
            )
        return cls(int(qc.get("group_size", 128)), 1 if layout == "gptq" else 0)

    def required_roles(self, logical: str) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def decode(self, logical: str, parts: dict[str, torch.Tensor]) -> Int4Rows:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        k8, n = qweight.shape
        k, groups = 8 * k8, scales.shape[0]
        if qweight.dtype != torch.int32 or k % groups or tuple(scales.shape) != (groups, n):
            raise TensorShapeError(
                f"gptq tensors of {logical!r}: qweight {tuple(qweight.shape)} and scales "
                f"{tuple(scales.shape)} do not fit 4-bit groups"
            )
        group = k // groups
        g_idx = parts.get("g_idx")
        if g_idx is not None and not torch.equal(
            g_idx.long(), torch.arange(k, dtype=torch.long) // group
        ):
            raise ModelLoadError(
                f"gptq tensor '{logical[: -len('.weight')]}.g_idx' is not in group order "
                "(act-order); not supported"
            )
        packed = qweight.t().contiguous().view(torch.uint8)  # [N, K/2], element 2j low nibble
        zeros = unpack_int32_nibbles(qzeros)[:, :n].t().float() + self.zero_offset  # [N, G]
        scale = scales.t().float().contiguous()
        return Int4Rows(packed, scale, (-zeros * scale).contiguous())
