"""CPU routed-expert backends: `cpu-fp32`, `cpu-int8`, `cpu-int4`.

Kernels were chosen by measuring at one MoE layer's shapes (hidden 2048, moe_intermediate 1408,
64 experts, top-6) on the 2-core AVX2 dev box (`hetserve bench moe-kernel`, docs/benchmarks.md):

- `cpu-fp32`, `kernel="native"` (default where it builds): the native kernel below reading the
  fp32 weights in place (no copy), one C call per layer. `kernel="library"`: `F.linear` per
  expert on views of the weights; MKL's sgemv is fine at one token but its small-M sgemm is far
  from bandwidth here, and the per-expert Python loop dominates small models.
- `cpu-int8`, `kernel="native"` (default where a C compiler and AVX2 exist): hetserve's own
  weight-only kernel (`hetserve/native/moe_kernels.c`, `cpu_native.py`): int8 weights meet
  int16-rounded activations, one C call per layer. `kernel="library"`: fbgemm's packed int8 GEMM
  (`quantized.linear_dynamic`, reduce_range), which also quantizes each call's activations to
  7 bits with one scale, i.e. ~100x the activation error. The weight-only library op
  `_weight_int8pack_mm` streamed 0.4 GB/s in torch 2.13 here and is not used.
- `cpu-int4`, `kernel="native"`: the same C kernel; nibbles go straight into the integer dot
  product with int16 activations, scale and minimum applied per group.
  `kernel="library"`: `_weight_int4pack_mm_for_cpu` (~0.2 GB/s here, kept as the fallback).

Error bounds: each backend promises its format's bound (`quant/quantize.py`, where they are
stated and computed); through a layer they compose (silu is 1.1-Lipschitz), which tests/moe checks.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch
import torch.nn.functional as F

from hetserve.errors import InvalidInputError
from hetserve.moe.cpu_base import _CPUExperts
from hetserve.moe.cpu_native import NativeFp32Experts, NativeInt4Experts, NativeInt8Experts
from hetserve.moe.cpu_native_float import NativeFp8Experts, NativeMxfp4Experts
from hetserve.moe.experts import Activation, ExpertWeights, native_activation, register_backend
from hetserve.quant.layout import pad_bias, pad_gate_up, pad_tensor, round_up
from hetserve.quant.quantize import (
    INT4_GROUP_SIZES,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
)


class CPUFp32Experts(_CPUExperts):
    """fp32 weights, `F.linear` (MKL/oneDNN sgemv/sgemm)."""

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        return w.contiguous()

    def _linear(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return F.linear(x, packed)

    def _expert_nbytes(self) -> int:
        return (2 * self.inter * self.hidden + self.hidden * self.inter) * 4


class FbgemmInt8Experts(_CPUExperts):
    """int8 weights per output channel, fbgemm packed GEMM with dynamic 7-bit activations."""

    def _pack(self, w: torch.Tensor) -> object:
        q, scale = quantize_int8_per_channel(w)
        zero = torch.zeros(q.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated but fbgemm is not
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
            return torch.ops.quantized.linear_prepack(qw, None)

    def _linear(self, x: torch.Tensor, packed: object) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, packed, True)

    def _expert_nbytes(self) -> int:
        i, h = self.inter, self.hidden
        return 3 * i * h + (2 * i + h) * 4  # int8 weights + fp32 per-channel scales


class TorchInt4Experts(_CPUExperts):
    """int4 weights, group-wise asymmetric, torch's CPU int4 packed matmul. The op needs whole
    groups and rows in sixteens: other sizes are stored with zero weights appended (a short
    last group keeps its own scale and minimum) and forward pads the tokens with zeros."""

    def __init__(
        self,
        weights: ExpertWeights,
        activation: str = "silu",
        num_threads: int | None = None,
        group_size: int = 64,
    ) -> None:
        self.group_size = group_size
        super().__init__(weights, activation=activation, num_threads=num_threads)

    def _load(self, weights: ExpertWeights) -> None:
        # whole groups; rows then come in sixteens too (every group size is a multiple of 16)
        hp, ip = (round_up(n, self.group_size) for n in (self.hidden, self.inter))
        self._pad = (hp - self.hidden, ip - self.inter)
        self.b13, self.b2 = pad_bias(self.b13, ip, gate_up=True), pad_bias(self.b2, hp)
        self._w13, self._w2 = [], []
        for e in range(self.num_experts):
            w13, w2 = weights.expert(e)
            self._w13.append(self._pack(w13, ip, hp, gate_up=True))
            self._w2.append(self._pack(w2, hp, ip))

    def _pack(
        self, w: torch.Tensor, rows: int, cols: int, gate_up: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale, lo = quantize_int4_groupwise(w, self.group_size)
        pad = pad_gate_up if gate_up else pad_tensor  # zero codes, scales and minimums
        groups = cols // self.group_size
        q, scale, lo = pad(q, rows, cols), pad(scale, rows, groups), pad(lo, rows, groups)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        # The op dequantizes as (q - 8) * scale + zero, so zero = minimum + 8 * scale.
        scales_zeros = torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous()
        return packed, scales_zeros

    def _linear(self, x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, packed[0], self.group_size, packed[1])

    def _expert_nbytes(self) -> int:
        h, i = self.hidden + self._pad[0], self.inter + self._pad[1]
        groups = (2 * i * h + h * i) // self.group_size
        return 3 * i * h // 2 + groups * 2 * 4  # nibbles + fp32 (scale, zero) per group


# -- registry entries: one name per format, the kernel is an option -------------------------
KERNELS = ("auto", "native", "library")


def _use_native(name: str, kernel: str, activation: Activation) -> bool:
    """kernel="auto" takes the native AVX2 kernel when it builds here (and fuses the
    activation: silu or gpt-oss's clamped SwiGLU); "library" forces the torch/fbgemm op."""
    if kernel not in KERNELS:
        raise InvalidInputError(f"{name}: kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "library":
        return False
    from hetserve.native import native_unavailable_reason

    reason = native_unavailable_reason()
    if kernel == "native":
        if reason is not None:
            raise InvalidInputError(f"{name}: native kernel unavailable here: {reason}")
        if not native_activation(activation):
            raise InvalidInputError(f"{name}: native kernel fuses silu only, not {activation!r}")
    if reason is not None:
        _warn_once(f"{name}: native kernel unavailable ({reason}); using the library kernel")
    return reason is None and native_activation(activation)


def _native_only(name: str, kernel: str, activation: Activation) -> None:
    """Formats that exist only as a native kernel (their point is reading published bytes)."""
    if kernel not in ("auto", "native"):
        raise InvalidInputError(f"{name} has only the native kernel; kernel={kernel!r} is not one")
    _use_native(name, "native", activation)


@functools.cache
def _warn_once(message: str) -> None:
    logging.getLogger(__name__).warning(message)


def _int4_group(weights: ExpertWeights, group_size: int | None) -> int:
    """The int4 group size: as asked, else the packed checkpoint's own where it is one of
    INT4_GROUP_SIZES (no requantization), else 64."""
    if group_size is None:
        group_size = 64
        p = weights.packed
        if p is not None and p.fmt == "int4" and p.groups()[0] == p.groups()[1]:
            group_size = p.groups()[0] if p.groups()[0] in INT4_GROUP_SIZES else 64
    # Any hidden and intermediate size: both kernels store sizes off whole groups padded.
    if group_size not in INT4_GROUP_SIZES:
        raise InvalidInputError(
            f"cpu-int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}"
        )
    return group_size


@register_backend("cpu-fp32")
def make_cpu_fp32(
    weights: ExpertWeights,
    activation: Activation = "silu",
    num_threads: int | None = None,
    kernel: str = "auto",
) -> _CPUExperts:
    # Sizes off multiples of 8 cost the native kernel a padded copy of the weights (the model's
    # own are released once every phase's backend holds its copy, model/hybrid_plan.py).
    if _use_native("cpu-fp32", kernel, activation):
        return NativeFp32Experts(weights, activation=activation, num_threads=num_threads)
    return CPUFp32Experts(weights, activation=activation, num_threads=num_threads)


@register_backend("cpu-int8")
def make_cpu_int8(
    weights: ExpertWeights,
    activation: Activation = "silu",
    num_threads: int | None = None,
    kernel: str = "auto",
    activation_bits: int = 16,
) -> _CPUExperts:
    """`activation_bits`: 16 (int16 activations per row) or 8 (W8A8, native kernel only: fbgemm
    rounds its activations to 7 bits per call anyway)."""
    if _use_native("cpu-int8", kernel, activation):  # any size: padded with zero weights
        return NativeInt8Experts(
            weights, activation=activation, num_threads=num_threads,
            activation_bits=activation_bits,
        )  # fmt: skip
    return FbgemmInt8Experts(weights, activation=activation, num_threads=num_threads)


@register_backend("cpu-int4")
def make_cpu_int4(
    weights: ExpertWeights,
    activation: Activation = "silu",
    num_threads: int | None = None,
    group_size: int | None = None,
    kernel: str = "auto",
) -> _CPUExperts:
    group_size = _int4_group(weights, group_size)
    if _use_native("cpu-int4", kernel, activation):
        return NativeInt4Experts(
            weights, activation=activation, num_threads=num_threads, group_size=group_size
        )
    return TorchInt4Experts(
        weights, activation=activation, num_threads=num_threads, group_size=group_size
    )


@register_backend("cpu-mxfp4")
def make_cpu_mxfp4(
    weights: ExpertWeights,
    activation: Activation = "silu",
    num_threads: int | None = None,
    kernel: str = "auto",
) -> _CPUExperts:
    _native_only("cpu-mxfp4", kernel, activation)
    return NativeMxfp4Experts(weights, activation=activation, num_threads=num_threads)


@register_backend("cpu-fp8")
def make_cpu_fp8(
    weights: ExpertWeights,
    activation: Activation = "silu",
    num_threads: int | None = None,
    kernel: str = "auto",
) -> _CPUExperts:
    _native_only("cpu-fp8", kernel, activation)
    return NativeFp8Experts(weights, activation=activation, num_threads=num_threads)
