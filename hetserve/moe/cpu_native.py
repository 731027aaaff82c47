"""Native (AVX2) kernels behind `cpu-fp32`, `cpu-int8` and `cpu-int4` (kernel="native").

One ctypes call per layer does everything in C (hetserve/native/moe_kernels.c): counting-sort of the
(token, slot) pairs by expert, gate+up fused, silu, down, the weighted sum. No host sync and no
per-expert Python. Activations are rounded to int16 per row inside the kernel; weights stay as
quantized here, in the kernel's layout: per matrix one stacked tensor whose row quads are
interleaved into one sequential stream (W13's gate and up quads alternate), on huge pages;
fp32 per-channel scales (int8) or per-group scale and minimum (int4, also quad-interleaved).
"""

from __future__ import annotations

import torch

from hetserve.errors import InvalidInputError
from hetserve.moe.cpu_base import _CPUExperts, _f32
from hetserve.moe.experts import ExpertWeights
from hetserve.moe.quant import quantize_int4_groupwise, quantize_int8_per_channel
from hetserve.native import kernel
from hetserve.native.layout import interleave_quads, pack_int4_rows, pair_gate_up


class _NativeExperts(_CPUExperts):
    bits = 0
    group_size = 0
    align = 32  # hidden and intermediate sizes must be multiples of this

    def __init__(
        self, weights: ExpertWeights, activation: str = "silu", num_threads: int | None = None
    ) -> None:
        for name, dim in (
            ("hidden", weights.hidden_size),
            ("intermediate", weights.intermediate_size),
        ):
            if dim % self.align:
                raise InvalidInputError(
                    f"native kernel needs {name} size % {self.align} == 0, got {dim}"
                )
        self._fn = kernel("hetserve_moe_forward")
        self._threads = num_threads
        super().__init__(weights, activation=activation, num_threads=num_threads)

    def _forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        # Everything (routing sort, gathers, both matmuls, the weighted sum) is one C call:
        # at decode the per-layer cost of a dozen small torch ops would rival the matmuls.
        out_device, out_dtype = x.device, x.dtype
        x = x.to("cpu", torch.float32).contiguous()
        ids = topk_ids.to("cpu", torch.int64).contiguous()
        tw = topk_weights.to("cpu", torch.float32).contiguous()
        t, k = ids.shape
        out = torch.empty(t, self.hidden, dtype=torch.float32)
        rc = self._fn(
            self.bits, self._threads or torch.get_num_threads(), self.num_experts, self.hidden,
            self.inter, self.group_size, t, k, ids.data_ptr(), tw.data_ptr(), x.data_ptr(),
            out.data_ptr(), *self._ptrs,
        )  # fmt: skip
        if rc == -2:
            raise InvalidInputError(f"topk_ids outside [0, {self.num_experts})")
        if rc != 0:
            raise MemoryError("native MoE kernel could not allocate its activation buffers")
        return out.to(out_device, out_dtype)


class NativeFp32Experts(_NativeExperts):
    """fp32 weights as the model holds them (views, no copy): only fp32 rounding, summed in
    another order than torch's (|y - y_ref| <= 1e-5 relative in the tests)."""

    bits = 32
    align = 8

    def _load(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13 = w13.to("cpu", torch.float32).contiguous()
        self.w2 = w2.to("cpu", torch.float32).contiguous()
        z = self.w13.data_ptr()  # no scales or minimums: valid pointers the kernel ignores
        self._ptrs = (self.w13.data_ptr(), z, z, self.w2.data_ptr(), z, z)

    def _expert_nbytes(self) -> int:
        return 3 * self.inter * self.hidden * 4


class NativeInt8Experts(_NativeExperts):
    """int8 per-output-channel symmetric weights, |w - w_hat| <= scale/2; int16 activations."""

    bits = 8

    def _load(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        q13, s13 = zip(*(quantize_int8_per_channel(_f32(w)) for w in w13), strict=True)
        q2, s2 = zip(*(quantize_int8_per_channel(_f32(w)) for w in w2), strict=True)
        self.w13q = interleave_quads(pair_gate_up(torch.stack(q13)), 16)
        self.w2q = interleave_quads(torch.stack(q2), 16)
        self.s13 = pair_gate_up(torch.stack(s13)[..., None]).reshape(len(s13), -1).contiguous()
        self.s2 = torch.stack(s2).contiguous()
        self._keep = torch.zeros(1)  # int8 has no minimums: a valid pointer the kernel ignores
        z = self._keep.data_ptr()
        self._ptrs = (self.w13q.data_ptr(), self.s13.data_ptr(), z,
                      self.w2q.data_ptr(), self.s2.data_ptr(), z)  # fmt: skip

    def _expert_nbytes(self) -> int:
        i, h = self.inter, self.hidden
        return 3 * i * h + (2 * i + h) * 4


class NativeInt4Experts(_NativeExperts):
    """int4 group-wise asymmetric weights, |w - w_hat| <= scale/2 per group; int16 activations."""

    bits = 4

    def __init__(
        self,
        weights: ExpertWeights,
        activation: str = "silu",
        num_threads: int | None = None,
        group_size: int = 64,
    ) -> None:
        self.group_size = group_size
        super().__init__(weights, activation=activation, num_threads=num_threads)

    def _load(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        def quant(w: torch.Tensor, order=lambda t: t):
            parts = [quantize_int4_groupwise(_f32(m), self.group_size) for m in w]
            q = interleave_quads(order(pack_int4_rows(torch.stack([p[0] for p in parts]))), 16)
            scale = interleave_quads(order(torch.stack([p[1] for p in parts])), 1)
            low = interleave_quads(order(torch.stack([p[2] for p in parts])), 1)
            return q, scale, low

        self.w13q, self.s13, self.m13 = quant(w13, pair_gate_up)
        self.w2q, self.s2, self.m2 = quant(w2)
        self._ptrs = tuple(
            t.data_ptr() for t in (self.w13q, self.s13, self.m13, self.w2q, self.s2, self.m2)
        )

    def _expert_nbytes(self) -> int:
        i, h = self.inter, self.hidden
        return 3 * i * h // 2 + (3 * i * h // self.group_size) * 2 * 4
