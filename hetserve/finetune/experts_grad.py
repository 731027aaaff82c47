"""Routed experts under autograd: the placed backend's forward, our own input-gradient backward.

Who calls it: `enable_expert_grads(model)` (finetune/model.py) once after loading, which wraps
every `FusedExperts`' backends in `GradExperts`; the model's MoE block then calls
`GradExperts.forward` like any backend. When autograd needs it, the backward computes the
gradient of the input x and of the router weights through gate, up, silu and down with the
frozen weights, and no weight gradient (the routed experts are not trained). Failures: a bad
expert id or an out-of-memory kernel raise at backward time (the training step fails; nothing
is half-updated, the optimizer has not stepped).

Why our own: the CPU backends (moe/cpu_backends.py, cpu_native.py) are inference kernels with
no autograd, and torch's autograd through a per-expert loop keeps [pairs, 2I] activations per
layer and runs ~3E small matmuls per layer in Python. `hetserve/native/moe_backward.c` does the
backward in one C call per layer (recomputing gate and up instead of saving them). Its weights
are the forward's where a host backend holds them in a form it reads (finetune/model.py
`load_for_training`): fp32 as the cpu-fp32 backend widened them, int8 per row in the cpu-int8
backend's quad layout (fmt 9), one copy of the experts for both passes. Elsewhere it reads a
plain row-major layout of its own: the model's fp32 tensors, or int8/int4 quantized here with
the same functions as the cpu-int8/cpu-int4 backends (same w_hat). Either way the gradient is
exact for the quantized model that the forward computes. The torch path (`torch_backward`) is
the reference and serves CUDA tensors, other dtypes and shapes the kernel does not take.

Error bound with quantized experts (quantization_bit 8|4): against the fp32 model, each
linear's input gradient W^T g has |(W - W_hat)^T g| <= sum_n |g[n]| * step[n, k] / 2 per input
k (step = the int8 row scale, or the int4 group scale); `quantized_grad_bound` computes the
whole layer's bound (tests/finetune/test_experts_grad.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetserve import envs
from hetserve.errors import InvalidInputError
from hetserve.quant.layout import pack_int4_rows
from hetserve.quant.quantize import quantize_int4_groupwise, quantize_int8_per_channel


@dataclass
class GradWeights:
    """One layer's frozen routed-expert weights as the backward reads them.

    fmt 32: w13 [E, 2I, H], w2 [E, H, I] fp32. fmt 8: int8 of those shapes + per-row scales
    s13 [E, 2I], s2 [E, H]. fmt 9: the same numbers as the cpu-int8 backend lays them out
    (shared with it: `NativeInt8Experts.int8_rows`): w13 [E, 2I/4, H/16, 4, 16] with gate and
    up rows paired in units of 4 and s13 [E, 2I] in that order, w2 [E, H/4, I/16, 4, 16].
    fmt 4: uint8 two nibbles per byte (low first) [E, rows, cols/2] + per-group scale and
    minimum s/m [E, rows, cols/G]."""

    fmt: int
    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None = None
    m13: torch.Tensor | None = None
    s2: torch.Tensor | None = None
    m2: torch.Tensor | None = None
    group_size: int = 0

    @property
    def hidden(self) -> int:
        return self.w13.shape[2] * 16 if self.fmt == 9 else self.w2.shape[1]

    @property
    def inter(self) -> int:
        return self.w13.shape[1] * 2 if self.fmt == 9 else self.w13.shape[1] // 2

    def nbytes(self) -> int:
        parts = (self.w13, self.w2, self.s13, self.m13, self.s2, self.m2)
        return sum(t.nbytes for t in parts if t is not None)

    def dequantized(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13, w2) as fp32: what the forward computes with."""
        if self.fmt == 32:
            return self.w13[e].float(), self.w2[e].float()
        if self.fmt == 8:
            w13, w2 = self.w13[e].float(), self.w2[e].float()
            return w13 * self.s13[e, :, None], w2 * self.s2[e, :, None]
        if self.fmt == 9:
            w13 = _unquad(self.w13[e]) * self.s13[e, :, None]
            w2 = _unquad(self.w2[e]) * self.s2[e, :, None]
            n, h = w13.shape  # gate 0-3, up 0-3, gate 4-7, ... -> gate rows, then up rows
            return w13.reshape(n // 8, 2, 4, h).transpose(0, 1).reshape(n, h), w2
        return (
            _deq4(self.w13[e], self.s13[e], self.m13[e], self.group_size),
            _deq4(self.w2[e], self.s2[e], self.m2[e], self.group_size),
        )


def _unquad(q: torch.Tensor) -> torch.Tensor:
    """[rows/4, cols/16, 4, 16] int8 (quads, 16 columns at a time) -> [rows, cols] fp32."""
    r4, c16 = q.shape[:2]
    return q.transpose(1, 2).reshape(4 * r4, 16 * c16).float()


def _deq4(packed: torch.Tensor, s: torch.Tensor, m: torch.Tensor, g: int) -> torch.Tensor:
    q = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1).float()
    return (q.view(q.shape[0], -1, g) * s[..., None] + m[..., None]).view(q.shape)


def make_grad_weights(w13: torch.Tensor, w2: torch.Tensor, bits: int = 32, group_size: int = 64):
    """Backward weights of one layer from its fp32 (or model-dtype) weights; bits 32 keeps
    references to them, 8/4 quantizes each expert as cpu-int8/cpu-int4 do."""
    if bits == 32:
        return GradWeights(32, w13.detach(), w2.detach())
    if bits == 8:
        q13, s13 = zip(*(quantize_int8_per_channel(w.float().cpu()) for w in w13), strict=True)
        q2, s2 = zip(*(quantize_int8_per_channel(w.float().cpu()) for w in w2), strict=True)
        return GradWeights(8, torch.stack(q13), torch.stack(q2), torch.stack(s13), None,
                           torch.stack(s2))  # fmt: skip
    if bits != 4:
        raise ValueError(f"bits must be 32, 8 or 4, got {bits}")
    hidden, inter = w13.shape[-1], w2.shape[-1]
    if hidden % group_size or inter % group_size:
        # The backward kernel reads whole groups (the forward pads; the backward does not).
        raise InvalidInputError(
            f"4-bit experts for training need hidden ({hidden}) and intermediate ({inter}) "
            f"sizes that are multiples of the group size {group_size}; use 8-bit experts or a "
            "group size that divides both"
        )

    def quant(w: torch.Tensor):
        parts = [quantize_int4_groupwise(m.float().cpu(), group_size) for m in w]
        q = torch.stack([p[0] for p in parts])
        return (
            pack_int4_rows(q),
            torch.stack([p[1] for p in parts]),
            torch.stack([p[2] for p in parts]),
        )

    (q13, s13, m13), (q2, s2, m2) = quant(w13), quant(w2)
    return GradWeights(4, q13, q2, s13, m13, s2, m2, group_size)


def torch_backward(gw: GradWeights, x, tw, ids, gout) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference backward: autograd through the per-expert torch computation, in fp32, on x's
    device. Returns (dx [T, H], dw [T, k]) in fp32."""
    dev = x.device
    x, tw, gout = x.detach().float(), tw.detach().float(), gout.float()
    k = ids.shape[1]
    flat = ids.reshape(-1)
    dx = torch.zeros_like(x)
    dw = torch.zeros(flat.shape[0], dtype=torch.float32, device=dev)
    inter = gw.inter
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        tok = pairs // k
        w13, w2 = (w.to(dev) for w in gw.dequantized(e))
        xs = x[tok].requires_grad_(True)
        ws = tw.reshape(-1)[pairs].requires_grad_(True)
        with torch.enable_grad():
            gate, up = F.linear(xs, w13).split(inter, dim=-1)
            y = F.linear(F.silu(gate) * up, w2) * ws[:, None]
            gx, gws = torch.autograd.grad(y, (xs, ws), gout[tok])
        dx.index_add_(0, tok, gx)
        dw[pairs] = gws
    return dx, dw.view(-1, k)


def native_backward_applies(gw: GradWeights, x: torch.Tensor) -> bool:
    """Whether `experts_backward` runs the native kernel for these weights and input (else it
    runs `torch_backward`)."""
    from hetserve.native import optional_kernel

    h, i = gw.hidden, gw.inter
    return (
        x.is_cpu
        and gw.w13.is_cpu
        and (gw.fmt != 32 or gw.w13.dtype == torch.float32)
        and h % 8 == 0
        and i % 8 == 0
        and (gw.fmt != 4 or (h % gw.group_size == 0 and i % gw.group_size == 0))
        and (gw.fmt != 9 or (h % 16 == 0 and i % 16 == 0))
        and envs.native_kernels()
        and optional_kernel("hetserve_moe_backward") is not None
    )


def experts_backward(
    gw: GradWeights, x, tw, ids, gout, num_threads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) in fp32 on x's device: the native kernel on CPU where it applies, else torch.
    num_threads: the kernel's threads (default: torch's)."""
    if not native_backward_applies(gw, x):
        return torch_backward(gw, x, tw, ids, gout)
    from hetserve.native import optional_kernel

    x = x.detach().float().contiguous()
    gout = gout.float().contiguous()
    tw = tw.detach().float().contiguous()
    ids = ids.to(torch.int64).contiguous()
    t, k = ids.shape
    dx = torch.empty_like(x)
    dw = torch.empty(t, k, dtype=torch.float32)
    keep = torch.zeros(1)  # a valid pointer for the scales a format does not have
    ptr = [p.data_ptr() if p is not None else keep.data_ptr() for p in
           (gw.w13, gw.s13, gw.m13, gw.w2, gw.s2, gw.m2)]  # fmt: skip
    rc = optional_kernel("hetserve_moe_backward")(
        gw.fmt, num_threads or torch.get_num_threads(), gw.w13.shape[0], gw.hidden, gw.inter,
        gw.group_size, t, k, ids.data_ptr(), tw.data_ptr(), x.data_ptr(), gout.data_ptr(), *ptr,
        dx.data_ptr(), dw.data_ptr(),
    )  # fmt: skip
    if rc == -2:
        raise ValueError(f"topk_ids outside [0, {gw.w13.shape[0]})")
    if rc != 0:
        raise MemoryError("native MoE backward could not allocate its buffers")
    return dx, dw


class _ExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tw, ids, backend, gw, num_threads):
        ctx.save_for_backward(x, tw, ids)
        ctx.gw, ctx.num_threads = gw, num_threads
        with torch.no_grad():
            return backend.forward(x.detach(), tw.detach(), ids)

    @staticmethod
    def backward(ctx, gout):
        x, tw, ids = ctx.saved_tensors
        cpu = ctx.gw.w13.device.type == "cpu"
        # Experts on the host while activations live on an accelerator: compute there.
        dev = torch.device("cpu") if cpu else x.device
        dx, dw = experts_backward(
            ctx.gw, x.to(dev), tw.to(dev), ids.to(dev), gout.to(dev), ctx.num_threads
        )
        dx = dx.to(x.device, x.dtype) if ctx.needs_input_grad[0] else None
        dw = dw.to(tw.device, tw.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None


class GradExperts:
    """An ExpertsBackend (moe/experts.py) that adds the backward to another backend. Not
    `remote`: the MoE block's overlap thread runs under inference mode, which would drop the
    autograd graph; shared experts are still computed before the routed ones, so on CUDA they
    run while the CPU computes."""

    remote = False

    def __init__(
        self,
        inner,
        grad_weights: GradWeights,
        chunk_size: int | None = None,
        num_threads: int | None = None,
    ) -> None:
        """chunk_size: most tokens per call (bounds the backward's [tokens * k, H] buffer);
        num_threads: the backward kernel's threads (cpu_infer)."""
        self.inner, self.grad_weights = inner, grad_weights
        self.chunk_size, self.num_threads = chunk_size, num_threads

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        c = self.chunk_size
        if c is not None and x.shape[0] > c:
            parts = zip(x.split(c), topk_weights.split(c), topk_ids.split(c), strict=True)
            return torch.cat([self.forward(*p) for p in parts])
        if torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad):
            return _ExpertsFn.apply(
                x, topk_weights, topk_ids, self.inner, self.grad_weights, self.num_threads
            )
        return self.inner.forward(x, topk_weights, topk_ids)


def quantized_grad_bound(gw: GradWeights, x, tw, ids, gout, w13_ref, w2_ref) -> torch.Tensor:
    """The promised bound on |dx_quantized - dx_fp32| per element for one layer, a priori from
    the weight errors E = |W - W_hat| (known exactly from the quantization) and fp32 reference
    activations: with r = w * grad_out, d = W2^T r, g/u = gate/up, a = silu,
      |Δd| <= E2^T |r|,  |Δg| <= E1 |x|,  |Δu| <= E3 |x|,
      |Δdg| <= |Δd| |û| 1.1 + |d| (1.1 |Δu| + 0.5 |u| |Δg|)    (|a'| <= 1.1, |a''| <= 0.5)
      |Δdu| <= |Δd| |a(ĝ)| + 1.1 |d| |Δg|
      |Δdx| <= E13^T |dĝu| + |W13|^T |Δdgu|   (+ fp32 rounding)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    inter = w13_ref.shape[1] // 2
    bound = torch.zeros_like(x, dtype=torch.float32)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        tok = pairs // k
        w13, w2 = w13_ref[e].float(), w2_ref[e].float()
        q13, q2 = gw.dequantized(e)
        e13, e2 = (w13 - q13).abs(), (w2 - q2).abs()
        xs, r = x[tok].float(), gout[tok].float() * tw.reshape(-1)[pairs, None].float()
        g, u = (xs @ w13.t()).split(inter, dim=-1)
        gq, uq = (xs @ q13.t()).split(inter, dim=-1)
        dg_err, du_err = (xs.abs() @ e13.t()).split(inter, dim=-1)
        d, d_q = r @ w2, r @ q2
        d_err = r.abs() @ e2
        ddg = d_err * uq.abs() * 1.1 + d.abs() * (1.1 * du_err + 0.5 * u.abs() * dg_err)
        ddu = d_err * F.silu(gq).abs() + 1.1 * d.abs() * dg_err
        sq = torch.sigmoid(gq)
        dgu_q = torch.cat((d_q * uq * sq * (1 + gq * (1 - sq)), d_q * F.silu(gq)), -1)
        bound.index_add_(0, tok, dgu_q.abs() @ e13 + torch.cat((ddg, ddu), -1) @ w13.abs())
    return bound
