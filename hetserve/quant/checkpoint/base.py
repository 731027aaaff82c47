"""What a checkpoint's stored tensors mean: the contract every quantization format implements,
and the guard that refuses what none of them understands.

A format groups stored tensors into logical weights (`part_of`) and decodes each group
(`decode`) into a `QMatrix` (quant/packed.py) or a plain tensor. The loader asks it about every
tensor name (with its dtype) before reading any data, so a checkpoint whose tensors we would
misread fails with one line naming the tensor, the method and the supported ones.
"""

from __future__ import annotations

import torch

from hetserve.errors import ModelLoadError
from hetserve.quant.packed import QMatrix

SUPPORTED_METHODS = (
    "fp8 (block-scaled e4m3, weight_scale_inv)",
    "mxfp4 (gpt-oss *_blocks/*_scales)",
    "gptq (4-bit, desc_act false)",
    "compressed-tensors (pack-quantized int4)",
)
SUPPORTED = "supported: " + "; ".join(SUPPORTED_METHODS)

# Names of tensors that only quantized checkpoints hold, and what they belong to.
QUANT_PART_SUFFIXES = {
    ".weight_scale_inv": "fp8 block scales",
    "_blocks": "mxfp4 blocks",
    "_scales": "mxfp4 scales",
    ".qweight": "gptq packed weights",
    ".qzeros": "gptq zero points",
    ".scales": "gptq scales",
    ".g_idx": "gptq group index",
    ".weight_packed": "compressed-tensors packed weights",
    ".weight_scale": "quantization scales",
    ".weight_zero_point": "quantization zero points",
    ".weight_shape": "compressed-tensors weight shape",
    ".weight_global_scale": "nvfp4 global scales",
    ".input_scale": "static activation scales",
    ".SCB": "bitsandbytes int8 statistics",
    ".absmax": "bitsandbytes 4-bit statistics",
    ".quant_map": "bitsandbytes 4-bit code map",
    ".quant_state.bitsandbytes__nf4": "bitsandbytes 4-bit state",
    ".quant_state.bitsandbytes__fp4": "bitsandbytes 4-bit state",
}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# safetensors' dtype names -> torch's, for messages and checks.
DTYPE_NAMES = {
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I8": "int8",
    "U8": "uint8",
    "I32": "int32",
    "I64": "int64",
    "I16": "int16",
    "BOOL": "bool",
}


def quant_part_kind(name: str) -> str | None:
    """What quantization part a tensor name is, by its suffix (None: an ordinary name)."""
    for suffix, kind in QUANT_PART_SUFFIXES.items():
        if name.endswith(suffix):
            return kind
    return None


class CheckpointFormat:
    """Plain checkpoints: every tensor is a weight of a floating dtype. Quantized formats
    override `part_of` and `decode`."""

    method = "none"
    packed_fmt: str | None = None  # the QMatrix format its quantized weights decode to

    # suffix of a part's tensor name -> its role, the weight being named PREFIX.weight (GPTQ,
    # compressed-tensors); formats that name their parts otherwise override `part_of`
    part_suffixes: dict[str, str] = {}

    def part_of(self, name: str, dtype: str) -> tuple[str, str] | None:
        """(logical weight name, role) when `name` is a part of a quantized weight, None when it
        is an ordinary tensor. Raises ModelLoadError for a tensor this format cannot read."""
        for suffix, role in self.part_suffixes.items():
            if name.endswith(suffix):
                return name[: -len(suffix)] + ".weight", role
        self.check_plain(name, dtype)
        return None

    def required_roles(self, logical: str) -> tuple[str, ...]:
        """Roles a group must have (the others are optional)."""
        raise NotImplementedError

    def decode(self, logical: str, parts: dict[str, torch.Tensor]) -> QMatrix | torch.Tensor:
        raise NotImplementedError

    def check_plain(self, name: str, dtype: str) -> None:
        """An ordinary tensor must be a float one and carry no quantization part's name."""
        kind = quant_part_kind(name)
        if kind is not None:
            raise ModelLoadError(
                f"tensor {name!r} holds {kind}, which {self.described()} does not use; the "
                f"checkpoint is quantized in a way hetserve does not read ({SUPPORTED})"
            )
        if dtype not in FLOAT_DTYPES:
            raise ModelLoadError(
                f"tensor {name!r} has dtype {DTYPE_NAMES.get(dtype, dtype)}, but "
                f"{self.described()} gives it no meaning; refusing to load it as a weight "
                f"({SUPPORTED})"
            )

    def described(self) -> str:
        if self.method == "none":
            return "config.json (no quantization_config)"
        return f"quantization_config (quant_method {self.method!r})"
