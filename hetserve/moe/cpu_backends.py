"""CPU routed-expert backends: `cpu-fp32`, `cpu-int8`, `cpu-int4`.

Kernels were chosen by measuring at one MoE layer's shapes (hidden 2048, moe_intermediate 1408,
64 experts, top-6) on the 2-core AVX2 dev box; see README, "MoE kernel bench":

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

Error bounds each backend promises, per linear `y = x @ w.T` (w one expert's [N, K] matrix):

- `cpu-fp32`: only fp32 rounding (|y - y_ref| <= 1e-5 relative in the tests).
- `cpu-int8`: weights w_hat = q * s[n], q = round(w / s[n]) in [-127, 127], s[n] = max|w[n]| / 127,
  so |w - w_hat| <= s[n] / 2 per element. Activations x_hat with step s_x, |x - x_hat| <= s_x / 2,
  where s_x = max|x| / 16383 per row (native) or (max(x, 0) - min(x, 0)) / 127 per call (fbgemm):
      |y[n] - y_ref[n]| <= s[n] / 2 * ||x||_1 + s_x / 2 * ||w_hat[n]||_1   (+ fp32 rounding);
  `int8_linear_bound` computes it. Both accumulate exactly in int32.
- `cpu-int4`: per group of `group_size` input channels, scale = (max - min) / 15 and
  w_hat = q * scale + min with q in [0, 15], so |w - w_hat| <= scale / 2 per element and
      |y[n] - y_ref[n]| <= sum_k |x[k]| * scale[n, k // group_size] / 2
                           (+ s_x / 2 * ||w_hat[n]||_1, native: int16 activations as above)
                           (+ fp32 rounding);
  `int4_linear_bound` computes the weight term (torch's op keeps activations fp32).
Through a layer the bounds compose (silu is 1.1-Lipschitz); tests/moe checks the composed bound.
"""

from __future__ import annotations

import functools
import logging
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn.functional as F

from hetserve.errors import InvalidInputError
from hetserve.moe.experts import ACTIVATIONS, ExpertWeights, register_backend

INT4_GROUP_SIZES = (32, 64, 128)


def _f32(w: torch.Tensor) -> torch.Tensor:
    """One expert's matrix as fp32 on the CPU (a no-op view when it already is)."""
    return w.to("cpu", torch.float32)


class _CPUExperts:
    """Shared forward of the library kernels. Subclasses set `_pack(w[N, K]) -> object` and
    `_linear(x, packed)`; the native ones override `_load` and `_forward`.

    Per-expert packed weights sit in two Python lists built once, so forward does no weight
    work, and routing costs one host sync (the per-expert counts).
    """

    def __init__(
        self, weights: ExpertWeights, activation: str = "silu", num_threads: int | None = None
    ) -> None:
        if activation not in ACTIVATIONS:
            raise InvalidInputError(
                f"unknown activation {activation!r}; available: {', '.join(sorted(ACTIVATIONS))}"
            )
        if num_threads is not None and num_threads < 1:
            raise InvalidInputError(f"num_threads must be >= 1, got {num_threads}")
        self.num_experts = weights.num_experts
        self.inter = weights.intermediate_size
        self.hidden = weights.hidden_size
        self.act = ACTIVATIONS[activation]
        # Experts are converted to fp32 one at a time (`_f32`), never the whole layer at once:
        # a bf16 layer of 64 experts would otherwise need a transient 2+ GB fp32 copy.
        self._load(weights.w13.detach(), weights.w2.detach())
        # A dedicated single worker whose intra-op pool is sized once: torch's thread count is
        # per OS thread, so the caller's (accelerator) thread keeps its own setting.
        self._pool: ThreadPoolExecutor | None = None
        if num_threads is not None:
            self._pool = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="hetserve-cpu-experts",
                initializer=torch.set_num_threads,
                initargs=(num_threads,),
            )

    # -- per-backend storage -------------------------------------------------------------
    def _load(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self._w13 = [self._pack(_f32(w13[e])) for e in range(self.num_experts)]
        self._w2 = [self._pack(_f32(w2[e])) for e in range(self.num_experts)]

    def _pack(self, w: torch.Tensor) -> object:
        raise NotImplementedError

    def _linear(self, x: torch.Tensor, packed: object) -> torch.Tensor:
        raise NotImplementedError

    def _expert_nbytes(self) -> int:
        """Bytes of one expert's weights as stored (w13 + w2, scales included)."""
        raise NotImplementedError

    # -- contract ------------------------------------------------------------------------
    def nbytes(self) -> int:
        return self.num_experts * self._expert_nbytes()

    def expert_nbytes(self) -> int:
        """Bytes one expert streams per call: what a token touching it reads from memory."""
        return self._expert_nbytes()

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self._pool is not None:
            return self.submit(x, topk_weights, topk_ids).result()
        return self._forward(x, topk_weights, topk_ids)

    def submit(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Future:
        """Run forward on the dedicated pool (needs `num_threads`); the caller overlaps its own
        work and calls `.result()` when it needs the output."""
        if self._pool is None:
            raise InvalidInputError("submit() needs the backend built with num_threads=N")
        return self._pool.submit(self._forward, x, topk_weights, topk_ids)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        out_device, out_dtype = x.device, x.dtype
        x = x.to("cpu", torch.float32)
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1).to("cpu")
        order = torch.argsort(flat, stable=True)
        # The one host sync: per-expert counts decide which packed weights to run.
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // k
        xs = x.index_select(0, token_of)
        ws = topk_weights.reshape(-1).to("cpu", torch.float32).index_select(0, order)
        ws = ws.unsqueeze(1)
        inter, act, lin = self.inter, self.act, self._linear
        ys = []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            end = start + n
            h = lin(xs[start:end], self._w13[e])  # gate+up fused: one matmul per expert
            a = act(h[:, :inter])
            a.mul_(h[:, inter:]).mul_(ws[start:end])  # in place: no extra [n, I] buffers
            ys.append(lin(a, self._w2[e]))
            start = end
        out = torch.zeros_like(x)
        if ys:
            out.index_add_(0, token_of, torch.cat(ys) if len(ys) > 1 else ys[0])
        return out.to(out_device, out_dtype)


class CPUFp32Experts(_CPUExperts):
    """fp32 weights, `F.linear` (MKL/oneDNN sgemv/sgemm)."""

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        return w.contiguous()

    def _linear(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return F.linear(x, packed)

    def _expert_nbytes(self) -> int:
        return (2 * self.inter * self.hidden + self.hidden * self.inter) * 4


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns (q int8 [N, K], scale fp32 [N]) with
    w_hat = q * scale[:, None] and |w - w_hat| <= scale / 2."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero row: any scale
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_activation_step(x: torch.Tensor, kernel: str) -> torch.Tensor:
    """Per-row activation rounding step s_x for inputs x [T, K]: native kernels (int8 and int4)
    round to int16 per row, fbgemm to 7 bits per call."""
    x = x.float()
    if kernel == "native":
        return x.abs().amax(dim=1) / 16383.0
    full = x.amax().clamp(min=0) - x.amin().clamp(max=0)  # fbgemm: one scale per call
    return (full / 127.0).expand(x.shape[0])


def int8_linear_bound(
    x: torch.Tensor, w_hat: torch.Tensor, scale: torch.Tensor, kernel: str = "native"
) -> torch.Tensor:
    """The promised |y - x @ w.T| bound of `cpu-int8` for inputs x [T, K] (see module doc)."""
    s_x = int8_activation_step(x, kernel)
    return (
        x.float().abs().sum(dim=1, keepdim=True) * scale[None, :] / 2
        + s_x[:, None] / 2 * w_hat.abs().sum(dim=1)[None, :]
    )


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


def quantize_int4_groupwise(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 over input channels: returns (q int32 [N, K] in [0, 15],
    scale [N, K/g], minimum [N, K/g]) with w_hat = q * scale + minimum, |w - w_hat| <= scale/2."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    lo = wg.amin(dim=2)
    scale = (wg.amax(dim=2) - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: exact
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15)
    return q.to(torch.int32).reshape(n, k), scale, lo


def int4_linear_bound(
    x: torch.Tensor,
    scale: torch.Tensor,
    group_size: int,
    w_hat: torch.Tensor | None = None,
    kernel: str = "library",
) -> torch.Tensor:
    """The promised |y - x @ w.T| bound of `cpu-int4` for inputs x [T, K] (see module doc);
    the native kernel's activation term needs `w_hat`."""
    t, k = x.shape
    xg = x.float().abs().reshape(t, k // group_size, group_size).sum(dim=2)  # [T, K/g]
    bound = xg @ scale.t() / 2
    if kernel == "native":
        assert w_hat is not None, "the native bound needs w_hat"
        s_x = int8_activation_step(x, "native")
        bound = bound + s_x[:, None] / 2 * w_hat.abs().sum(dim=1)[None, :]
    return bound


class TorchInt4Experts(_CPUExperts):
    """int4 weights, group-wise asymmetric, torch's CPU int4 packed matmul."""

    def __init__(
        self,
        weights: ExpertWeights,
        activation: str = "silu",
        num_threads: int | None = None,
        group_size: int = 64,
    ) -> None:
        self.group_size = group_size
        super().__init__(weights, activation=activation, num_threads=num_threads)

    def _pack(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale, lo = quantize_int4_groupwise(w, self.group_size)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        # The op dequantizes as (q - 8) * scale + zero, so zero = minimum + 8 * scale.
        scales_zeros = torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous()
        return packed, scales_zeros

    def _linear(self, x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, packed[0], self.group_size, packed[1])

    def _expert_nbytes(self) -> int:
        i, h = self.inter, self.hidden
        groups = (2 * i * h + h * i) // self.group_size
        return 3 * i * h // 2 + groups * 2 * 4  # nibbles + fp32 (scale, zero) per group


# -- registry entries: one name per format, the kernel is an option -------------------------
KERNELS = ("auto", "native", "library")


def _use_native(name: str, kernel: str, activation: str) -> bool:
    """kernel="auto" takes the native AVX2 kernel when it builds here (and the activation is
    silu, the only one it fuses); "library" forces the torch/fbgemm op."""
    if kernel not in KERNELS:
        raise InvalidInputError(f"{name}: kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "library":
        return False
    from hetserve.native import native_unavailable_reason

    reason = native_unavailable_reason()
    if kernel == "native":
        if reason is not None:
            raise InvalidInputError(f"{name}: native kernel unavailable here: {reason}")
        if activation != "silu":
            raise InvalidInputError(f"{name}: native kernel fuses silu only, not {activation!r}")
    if reason is not None:
        _warn_once(f"{name}: native kernel unavailable ({reason}); using the library kernel")
    return reason is None and activation == "silu"


@functools.cache
def _warn_once(message: str) -> None:
    logging.getLogger(__name__).warning(message)


def _check_int4(weights: ExpertWeights, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise InvalidInputError(
            f"cpu-int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}"
        )
    dims = (("hidden", weights.hidden_size), ("intermediate", weights.intermediate_size))
    for name, dim in dims:
        if dim % group_size:
            raise InvalidInputError(
                f"cpu-int4: {name} size {dim} is not a multiple of group_size {group_size}"
            )


@register_backend("cpu-fp32")
def make_cpu_fp32(
    weights: ExpertWeights,
    activation: str = "silu",
    num_threads: int | None = None,
    kernel: str = "auto",
) -> _CPUExperts:
    aligned = weights.hidden_size % 8 == 0 and weights.intermediate_size % 8 == 0
    if (kernel == "native" or aligned) and _use_native("cpu-fp32", kernel, activation):
        from hetserve.moe.cpu_native import NativeFp32Experts

        return NativeFp32Experts(weights, activation=activation, num_threads=num_threads)
    return CPUFp32Experts(weights, activation=activation, num_threads=num_threads)


@register_backend("cpu-int8")
def make_cpu_int8(
    weights: ExpertWeights,
    activation: str = "silu",
    num_threads: int | None = None,
    kernel: str = "auto",
) -> _CPUExperts:
    aligned = weights.hidden_size % 32 == 0 and weights.intermediate_size % 32 == 0
    if (kernel == "native" or aligned) and _use_native("cpu-int8", kernel, activation):
        from hetserve.moe.cpu_native import NativeInt8Experts

        return NativeInt8Experts(weights, activation=activation, num_threads=num_threads)
    return FbgemmInt8Experts(weights, activation=activation, num_threads=num_threads)


@register_backend("cpu-int4")
def make_cpu_int4(
    weights: ExpertWeights,
    activation: str = "silu",
    num_threads: int | None = None,
    group_size: int = 64,
    kernel: str = "auto",
) -> _CPUExperts:
    _check_int4(weights, group_size)
    if _use_native("cpu-int4", kernel, activation):
        from hetserve.moe.cpu_native import NativeInt4Experts

        return NativeInt4Experts(
            weights, activation=activation, num_threads=num_threads, group_size=group_size
        )
    return TorchInt4Experts(
        weights, activation=activation, num_threads=num_threads, group_size=group_size
    )
