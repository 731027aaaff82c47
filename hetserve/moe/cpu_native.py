"""Native (AVX2) kernels behind the CPU expert backends (kernel="native").

One ctypes call per layer does everything in C (hetserve/native/moe_kernels.c): counting-sort of
the (token, slot) pairs by expert, gate+up fused, the gate activation (silu, or gpt-oss's
clamped SwiGLU) with optional biases, down, the weighted sum. No host sync and no per-expert
Python. The integer formats meet activations rounded to int16 per row inside the kernel; fp32
weights meet fp32 activations, FP8 ones too except on the avx512bf16 build (BF16 and GFNI), which
multiplies them as bf16 with each input split into two bf16 (within 2^-18 of it; see
native.fp8_activations). Weights keep their numbers, in the kernel's layout: per
matrix one stacked tensor whose row quads are interleaved into one sequential stream (W13's gate
and up quads alternate), on huge pages, with the group parameters quad-interleaved beside them.

Experts packed in a checkpoint's own format (`ExpertWeights.packed`) go in as published where the
format matches the backend: MXFP4 blocks and e8m0 scales, FP8 bytes and block scales, int4
nibbles (GPTQ, compressed-tensors) with their scale and minimum, q4_K super-blocks (only
rearranged: 4.5 bits per weight), q8_0's int8 and scales.
Otherwise each expert is converted on its own (`weights.expert(e)`), never the whole layer.
Here: the shared base and the fp32, int8 and int4 (and q4_K) backends; MXFP4's and FP8's are
in moe/cpu_native_float.py.
Sizes off the kernel's multiples: weights and biases are stored with zeros appended up to them
(quant/layout.py, `padded_size`), the kernel pads tokens and drops padded outputs (no Python).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable

import torch

from hetserve.errors import InvalidInputError
from hetserve.moe.cpu_base import _CPUExperts
from hetserve.moe.experts import Activation, ClampedSwiGLU, ExpertWeights
from hetserve.moe.native_layout import int4_layer, q4k_layer, stacked_quads
from hetserve.native import kernel
from hetserve.quant.kernel_file import KernelLayout, check_format, check_padding
from hetserve.quant.layout import (
    fp16_group_scales,
    pack_int4_rows,
    pad_bias,
    pad_gate_up,
    pad_qmatrices,
    pad_tensor,
    padded_size,
)
from hetserve.quant.packed import (
    Int4Rows,
    Int8PerRow,
    Int8Rows,
    Q4KRows,
    QMatrix,
)
from hetserve.quant.quantize import (
    quantize_int4_groupwise,
    quantize_int8_per_channel,
)

# The kernel's weight formats (enum F_* in moe_kernels.c).
F_F32, F_I8, F_I4, F_MXFP4, F_FP8, F_Q4K = range(6)
F_A8 = 1 << 10  # or'd into the format at hetserve_moe_new: activations rounded to int8 (W8A8)
_F32, _I64 = torch.float32, torch.int64


def _packed_as(weights: ExpertWeights, cls: type[QMatrix]) -> bool:
    return weights.packed is not None and all(
        isinstance(m, cls) for m in (*weights.packed.w13, *weights.packed.w2)
    )


def _experts_in(
    weights: ExpertWeights, packed: bool, quantize: Callable[[torch.Tensor], QMatrix]
) -> tuple[list[QMatrix], list[QMatrix]]:
    """The layer's w13 and w2 matrices in one format, as lists the layouts empty: the
    checkpoint's own where `packed` (it holds them in that format already), else each expert
    quantized on its own."""
    if packed:
        return weights.packed_lists()
    mats13, mats2 = [], []
    for e in range(weights.num_experts):
        for w, out in zip(weights.expert(e), (mats13, mats2), strict=True):
            out.append(quantize(w))
    return mats13, mats2


class _NativeExperts(_CPUExperts):
    fmt = F_F32
    group_size = 0
    _act_flag = 0  # F_A8 where the activations are rounded to int8 (NativeInt8Experts)

    def __init__(
        self,
        weights: ExpertWeights,
        activation: Activation = "silu",
        num_threads: int | None = None,
    ) -> None:
        self._threads = num_threads
        if isinstance(activation, ClampedSwiGLU):
            self._act = (1, activation.alpha, activation.limit)
        elif activation == "silu":
            self._act = (0, 0.0, 0.0)
        else:
            raise InvalidInputError(f"native experts kernel fuses silu only, not {activation!r}")
        super().__init__(weights, activation=activation, num_threads=num_threads)
        hp, ip = self._padded()  # the biases at the weights' sizes
        self.b13, self.b2 = pad_bias(self.b13, ip, gate_up=True), pad_bias(self.b2, hp)
        self._bias_ptrs = tuple(None if b is None else b.data_ptr() for b in (self.b13, self.b2))
        self._bind()

    def _load_weights(self, weights: ExpertWeights) -> None:
        if weights.layout is None:
            self._load(weights)
            return
        # a kernel-layout file (hetserve convert): the mapped bytes are the layout, read in place
        lay = weights.layout
        check_format(lay, self.fmt, self.group_size)
        self.group_size = lay.group_size
        check_padding(lay, self._padded())
        self._set(*lay.tensors)

    def kernel_layout(self) -> KernelLayout:
        """This layer's weights as the kernel reads them (what `hetserve convert` writes)."""
        return KernelLayout(
            self.fmt, self.group_size, self.num_experts, self.hidden, self.inter,
            self._padded(), self._tensors,
        )  # fmt: skip

    def _padded(self) -> tuple[int, int]:
        """(hidden, intermediate) sizes the weights are stored at: the kernel's rule for this
        format and group size (set by _load before the weights are laid out)."""
        return tuple(padded_size(self.fmt, self.group_size, n) for n in (self.hidden, self.inter))

    def kernel_fmt(self) -> int:
        """The format the kernels take: with F_A8 where W8A8 was asked for and the weights are
        int8 with a scale per row (the byte tiles' case; grouped int8, GGUF q8_0, keeps int16
        activations: its tiles would only round more, no faster). Every caller of the kernels
        (this handle, the fused decode step) passes this, so prefill and decode agree."""
        a8 = self._act_flag if self.fmt == F_I8 and not self.group_size else 0
        return self.fmt | a8

    def _bind(self, lib: ctypes.CDLL | None = None) -> None:
        """Makes the C handle on this layer's experts (hetserve_moe_new: the 14 arguments that
        never change between calls) in `lib`, the kernels built for this CPU when None (tests
        pass another ISA's build)."""
        fn = kernel if lib is None else lambda name: getattr(lib, name)
        handle = fn("hetserve_moe_new")(
            self.kernel_fmt(), self.num_experts, self.hidden, self.inter, self.group_size,
            *self._ptrs, *self._bias_ptrs, *self._act,
        )  # fmt: skip
        if not handle:
            raise MemoryError("native MoE kernel could not allocate its handle")
        if getattr(self, "_free", None) is not None:
            self._free()
        self._free = weakref.finalize(self, fn("hetserve_moe_free"), handle)
        self._h, self._run, self._touch = handle, fn("hetserve_moe_run"), fn("hetserve_moe_touch")
        self._last = fn("hetserve_moe_last_seconds")

    def _forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        # Everything (routing sort, gathers, both matmuls, the weighted sum) is one C call:
        # at decode the per-layer cost of a dozen small torch ops would rival the matmuls.
        # Inputs as the router hands them out (CPU, fp32 / int64, contiguous) go straight in:
        # from cold caches, as a decode step's layers find them, each torch call here costs
        # several microseconds (converting them anyway took ~10% of a one-token int4 layer).
        if not (
            x.dtype is _F32 and topk_weights.dtype is _F32 and topk_ids.dtype is _I64
            and x.is_cpu and topk_weights.is_cpu and topk_ids.is_cpu and x.is_contiguous()
            and topk_weights.is_contiguous() and topk_ids.is_contiguous()
        ):  # fmt: skip
            out = self._forward(
                x.to("cpu", _F32).contiguous(), topk_weights.to("cpu", _F32).contiguous(),
                topk_ids.to("cpu", _I64).contiguous(),
            )  # fmt: skip
            return out.to(x.device, x.dtype)
        if (
            topk_ids.dim() != 2
            or topk_weights.shape != topk_ids.shape
            or x.shape != (topk_ids.shape[0], self.hidden)
        ):
            raise InvalidInputError(
                f"native experts need x [t, {self.hidden}] and topk weights and ids of one shape "
                f"[t, k]; got x {tuple(x.shape)}, weights {tuple(topk_weights.shape)}, ids "
                f"{tuple(topk_ids.shape)}"
            )
        t, k = topk_ids.shape
        out = torch.empty_like(x)  # [t, hidden] fp32; cheaper than torch.empty from cold
        rc = self._run(
            self._h, self._threads or torch.get_num_threads(), t, k, topk_ids.data_ptr(),
            topk_weights.data_ptr(), x.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        self._check(rc, "native MoE kernel could not allocate its activation buffers")
        return out

    def _check(self, rc: int, out_of_memory: str) -> None:
        """The C entry points' return codes: -2 a bad expert id, other non-zero out of memory."""
        if rc == -2:
            raise InvalidInputError(f"topk_ids outside [0, {self.num_experts})")
        if rc != 0:
            raise MemoryError(out_of_memory)

    def touch(self, topk_ids: torch.Tensor) -> tuple[int, float]:
        """Reads what `forward` with these routings would read of the weights, on the same work
        items and threads, without the arithmetic (`bench moe-kernel`'s read-pattern limit);
        returns the bytes read and the seconds it took in C."""
        ids = topk_ids.to("cpu", _I64).contiguous()
        t, k = ids.shape
        touched, seconds = ctypes.c_longlong(0), ctypes.c_double(0.0)
        rc = self._touch(
            self._h, self._threads or torch.get_num_threads(), t, k, ids.data_ptr(),
            ctypes.addressof(touched), ctypes.addressof(seconds),
        )  # fmt: skip
        self._check(rc, "native MoE touch could not allocate its expert list")
        return touched.value, seconds.value

    def last_kernel_seconds(self) -> float:
        """How long the last `forward` took inside C, entry to return: the kernel without the
        Python around it (`bench moe-kernel`'s `kernel` column; the fused decode path calls
        the kernel from C)."""
        return self._last(self._h)

    def _set(self, w13, s13, w2, s2) -> None:
        """Keeps the layout tensors alive and their pointers for the kernel (None -> NULL: formats
        whose weights carry their scales)."""
        self._tensors = (w13, s13, w2, s2)
        self._ptrs = tuple(None if t is None else t.data_ptr() for t in self._tensors)

    def _expert_nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors if t is not None) // self.num_experts


class NativeFp32Experts(_NativeExperts):
    """fp32 weights as the model holds them (views, no copy): only fp32 rounding, summed in
    another order than torch's (|y - y_ref| <= 1e-5 relative in the tests)."""

    fmt = F_F32

    def _load(self, weights: ExpertWeights) -> None:
        dense = weights.dense("cpu", torch.float32)
        hp, ip = self._padded()  # a padded copy only where a size is not a multiple of 8
        w13, w2 = pad_gate_up(dense.w13, ip, hp), pad_tensor(dense.w2, hp, ip)
        self._set(w13.contiguous(), None, w2.contiguous(), None)

    def fp32_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(w13 [E, 2I, H], w2 [E, H, I]) as the kernel reads them, or None where they are
        padded (a size not a multiple of 8): training's backward shares them."""
        if self._padded() != (self.hidden, self.inter):
            return None
        return self._tensors[0], self._tensors[2]


class NativeInt8Experts(_NativeExperts):
    """int8 per-output-channel symmetric weights, |w - w_hat| <= scale/2; int16 activations, or
    with `activation_bits=8` int8 ones per token row (W8A8: the prefill tiles multiply bytes by
    bytes, vpdpbusd / AMX; the integer sums stay exact, so every path gives the same bits).
    Experts packed as grouped int8 (GGUF q8_0) keep their integers and group scales exactly."""

    fmt = F_I8

    def __init__(
        self,
        weights: ExpertWeights,
        activation: Activation = "silu",
        num_threads: int | None = None,
        activation_bits: int = 16,
    ) -> None:
        if activation_bits not in (8, 16):
            raise ValueError(f"activation_bits must be 8 or 16, got {activation_bits}")
        self._act_flag = F_A8 if activation_bits == 8 else 0
        super().__init__(weights, activation=activation, num_threads=num_threads)

    def _load(self, weights: ExpertWeights) -> None:
        if _packed_as(weights, Int8PerRow):  # rounded per row as the loader read them
            self._load_per_row(*weights.packed_lists())
            return
        if _packed_as(weights, Int8Rows):
            g13, g2 = weights.packed.groups()
            if g13 == g2 and g13 % 16 == 0:
                self._load_grouped(weights, g13)
                return
        q13, s13, q2, s2 = [], [], [], []
        hp, ip = self._padded()
        for e in range(self.num_experts):
            w13, w2 = weights.expert(e)
            # zero rows and columns before rounding: a row's scale (its max) is unchanged
            w13, w2 = pad_gate_up(w13, ip, hp), pad_tensor(w2, hp, ip)
            for w, qs, ss in ((w13, q13, s13), (w2, q2, s2)):
                q, s = quantize_int8_per_channel(w)
                qs.append(q)
                ss.append(s[:, None])
        self._set_per_row(q13, s13, q2, s2)

    def _load_per_row(self, m13: list[Int8Rows], m2: list[Int8Rows]) -> None:
        """Experts already int8 per row (the loader quantized them as they were read: what the
        loop above makes of dense ones, bit for bit); zero rows and columns added here (a padded
        row's scale is 0, not the loop's 1: its codes are 0 either way)."""
        hp, ip = self._padded()
        q13 = [pad_gate_up(m.q, ip, hp) for m in m13]
        s13 = [pad_gate_up(m.scale, ip, 1) for m in m13]
        q2, s2 = [pad_tensor(m.q, hp, ip) for m in m2], [pad_tensor(m.scale, hp, 1) for m in m2]
        m13.clear(), m2.clear()  # the four lists alone hold them: the layouts empty those
        self._set_per_row(q13, s13, q2, s2)

    def int8_rows(self) -> tuple[torch.Tensor, ...] | None:
        """(q13, s13, q2, s2) as the kernel reads them where they are int8 with one fp32 scale
        per row and unpadded (training's backward shares them: native/moe_backward.c's fmt 9),
        else None (group scales, padding)."""
        if self.group_size or self._padded() != (self.hidden, self.inter):
            return None
        q13, s13, q2, s2 = self._tensors
        if s13.dtype != torch.float32 or s2.dtype != torch.float32:
            return None
        return q13, s13, q2, s2

    def _set_per_row(self, q13: list, s13: list, q2: list, s2: list) -> None:
        self._set(
            stacked_quads(q13, 16, True), stacked_quads(s13, 1, True).reshape(self.num_experts, -1),
            stacked_quads(q2, 16, False), torch.stack(s2).reshape(self.num_experts, -1),
        )  # fmt: skip

    def _load_grouped(self, weights: ExpertWeights, group: int) -> None:
        self.group_size = group
        (w13, w2), (hp, ip) = weights.packed_lists(), self._padded()
        m13, m2 = pad_qmatrices(w13, ip, hp, True), pad_qmatrices(w2, hp, ip)
        s13, s2 = ([fp16_group_scales(m.scale) for m in mats] for mats in (m13, m2))
        q13, q2 = [m.q for m in m13], [m.q for m in m2]
        m13.clear(), m2.clear()  # the codes' lists alone hold them: the layouts empty those
        self._set(
            stacked_quads(q13, 16, True), stacked_quads(s13, 1, True),
            stacked_quads(q2, 16, False), stacked_quads(s2, 1, False),
        )  # fmt: skip


class NativeInt4Experts(_NativeExperts):
    """int4 group-wise asymmetric weights, |w - w_hat| <= scale/2 per group; int16 activations.
    Experts packed as int4 groups of 32/64/128 (GPTQ, compressed-tensors) keep their nibbles,
    scales and minimums exactly (group_size None takes theirs); GGUF q4_K experts (group 32)
    keep their super-blocks, read by the q4_K kernel, which rounds activations to int8 per 256
    columns as llama.cpp's q8_K does (|x - x_hat| <= max|x_block| / 254)."""

    fmt = F_I4

    def __init__(
        self,
        weights: ExpertWeights,
        activation: Activation = "silu",
        num_threads: int | None = None,
        group_size: int = 64,
    ) -> None:
        self.group_size = group_size
        super().__init__(weights, activation=activation, num_threads=num_threads)

    def _load(self, weights: ExpertWeights) -> None:
        if _packed_as(weights, Q4KRows) and self.group_size == 32:
            self.fmt = F_Q4K  # the super-blocks as they are (group_size: their sub-blocks)
            w13, w2 = weights.packed_lists()
            self._set(q4k_layer(w13, True), None, q4k_layer(w2, False), None)
            return

        def quantize(w: torch.Tensor) -> Int4Rows:  # a short last group: its own scale, minimum
            q, scale, low = quantize_int4_groupwise(w, self.group_size)
            whole = scale.shape[1] * self.group_size  # its codes padded with zeros
            return Int4Rows(pack_int4_rows(pad_tensor(q, q.shape[0], whole)), scale, low)

        groups = (self.group_size,) * 2
        keep = _packed_as(weights, Int4Rows) and weights.packed.groups() == groups
        mats13, mats2 = _experts_in(weights, keep, quantize)
        hp, ip = self._padded()
        mats13, mats2 = pad_qmatrices(mats13, ip, hp, True), pad_qmatrices(mats2, hp, ip)
        self._set(int4_layer(mats13, True), None, int4_layer(mats2, False), None)
