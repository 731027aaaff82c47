"""Routed-expert backends: one contract, one registry.

A backend owns the routed experts of one MoE layer and computes, for T tokens,
    out[t] = sum_j topk_weights[t, j] * down_e(act(gate_e(x[t]), up_e(x[t]))),  e = topk_ids[t, j]
(act(gate, up) = silu(gate) * up for most families; projections may carry biases.)
Model files only ever call `forward`; placement (hybrid issue) decides which backend a layer gets,
so routed experts can move to a CPU kernel without touching model code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from hetserve.errors import InvalidInputError
from hetserve.quant.kernel_file import KernelLayout
from hetserve.quant.packed import PackedExperts
from hetserve.registry import Registry


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's routed experts: dense tensors in the layout transformers uses in memory,
    w13 [E, 2*I, H] (gate rows first, then up) and w2 [E, H, I], or (`packed`, w13 = w2 = None)
    the checkpoint's quantized matrices, or (`layout`, w13 = w2 = None) the native kernels' own
    bytes as `hetserve convert` wrote them (mapped from the file; only the native backend of
    their format reads them). Optional biases (gpt-oss): b13 [E, 2*I], b2 [E, H].
    `handed_over`: nothing but `packed` (its w13 and w2 lists) holds the loaded matrices, and
    the one backend built from them may empty those lists as it lays each expert out, so each
    loaded copy goes as soon as its layout is written (the streaming load: model/hybrid_plan.py's
    ExpertsBuilder, where a layer gets a single backend)."""

    w13: torch.Tensor | None
    w2: torch.Tensor | None
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    packed: PackedExperts | None = None
    layout: KernelLayout | None = None
    handed_over: bool = False

    def packed_lists(self) -> tuple[list, list]:
        """`packed`'s w13 and w2 matrices as lists a layout may empty (moe/native_layout.py):
        the handed-over lists themselves, else new lists (the caller's matrices stay)."""
        p = self.packed
        if self.handed_over:
            return p.w13, p.w2  # type: ignore[return-value]
        return list(p.w13), list(p.w2)

    @property
    def num_experts(self) -> int:
        if self.layout is not None:
            return self.layout.num_experts
        return self.packed.num_experts if self.packed is not None else self.w13.shape[0]

    @property
    def intermediate_size(self) -> int:
        if self.layout is not None:
            return self.layout.inter
        return self.packed.intermediate_size if self.packed is not None else self.w2.shape[2]

    @property
    def hidden_size(self) -> int:
        if self.layout is not None:
            return self.layout.hidden
        return self.packed.hidden_size if self.packed is not None else self.w2.shape[1]

    @property
    def device(self) -> torch.device:
        cpu = self.packed is not None or self.layout is not None
        return torch.device("cpu") if cpu else self.w13.device

    def _no_layout(self) -> None:
        if self.layout is not None:
            raise InvalidInputError(
                "these experts are in the native kernels' layout (a mapped hetserve convert "
                "checkpoint), which only their cpu backend reads; for another placement convert "
                "with --layout portable"
            )

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2I, H], w2 [H, I]) in fp32 on the CPU: one expert at a time, so a
        bf16 or quantized layer never needs a full-precision copy of all its experts."""
        self._no_layout()
        if self.packed is not None:
            return self.packed.expert(e)
        return self.w13[e].to("cpu", torch.float32), self.w2[e].to("cpu", torch.float32)

    def dense(self, device: torch.device | str | None = None, dtype=None) -> ExpertWeights:
        """All experts as dense tensors (dequantized when packed) on `device` in `dtype`."""
        self._no_layout()
        if self.packed is None:
            w13, w2 = self.w13, self.w2
        else:
            pairs = [self.packed.expert(e) for e in range(self.num_experts)]
            w13 = torch.stack([p[0] for p in pairs])
            w2 = torch.stack([p[1] for p in pairs])
        dtype = dtype or w13.dtype

        def move(t):
            return None if t is None else t.to(device or t.device, dtype)

        return ExpertWeights(move(w13), move(w2), move(self.b13), move(self.b2))

    def subset(self, experts: list[int], device: torch.device | str) -> ExpertWeights:
        """Dense copies of the listed experts (the hot experts on the accelerator)."""
        self._no_layout()
        idx = torch.tensor(experts, dtype=torch.long)
        if self.packed is not None:
            pairs = [self.packed.expert(e) for e in experts]
            w13 = torch.stack([p[0] for p in pairs])
            w2 = torch.stack([p[1] for p in pairs])
        else:
            w13, w2 = self.w13[idx], self.w2[idx]

        def pick(t):
            return None if t is None else t[idx.to(t.device)].to(device)

        return ExpertWeights(w13.to(device), w2.to(device), pick(self.b13), pick(self.b2))


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation on (gate, up):
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * (g * torch.sigmoid(g * self.alpha))


Activation = str | ClampedSwiGLU
GatedFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gated_activation(activation: Activation) -> GatedFn:
    """act(gate, up) of a gated MLP: `act(gate) * up` for a named activation."""
    if isinstance(activation, ClampedSwiGLU):
        return activation
    if activation not in ACTIVATIONS:
        raise InvalidInputError(
            f"unknown activation {activation!r}; available: {', '.join(sorted(ACTIVATIONS))}"
        )
    act = ACTIVATIONS[activation]
    return lambda gate, up: act(gate) * up


class ExpertsBackend(Protocol):
    """Contract for a routed-experts backend.

    Called by the model's MoE block once per layer per forward, from the model's thread.
    `forward(x[T,H], topk_weights[T,k] float, topk_ids[T,k] int64) -> [T,H]` in x's dtype and
    device. It must not modify its inputs. A backend that cannot serve the request (e.g. missing
    kernel) raises at construction time, never inside forward.
    """

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor: ...

    def nbytes(self) -> int: ...


BackendFactory = Callable[..., ExpertsBackend]
_CPU = "hetserve.moe.cpu_backends"  # registers the cpu-* backends on import
# Built-in backends and the modules that register them, imported on first use so importing this
# contract stays cheap and free of import cycles.
BACKENDS: Registry[BackendFactory] = Registry(
    "experts backend",
    {
        "torch": "hetserve.moe.experts",
        "cpu-fp32": _CPU,
        "cpu-int8": _CPU,
        "cpu-int4": _CPU,
        "cpu-mxfp4": _CPU,
        "cpu-fp8": _CPU,
        "cpu-gguf": "hetserve.moe.cpu_gguf",
        "kt": "hetserve.moe.kt_backend",
    },
)
register_backend = BACKENDS.register


def available_backends() -> list[str]:
    return BACKENDS.names()


def create_backend(
    name: str, weights: ExpertWeights, activation: Activation = "silu", **options
) -> ExpertsBackend:
    """Uniform constructor: every backend is `factory(weights, activation=..., **options)`."""
    return BACKENDS.get(name)(weights, activation=activation, **options)


# The backend that reads each packed (checkpoint-quantized) format as it is.
PACKED_BACKENDS = {"fp8": "cpu-fp8", "mxfp4": "cpu-mxfp4", "int4": "cpu-int4", "int8": "cpu-int8",
                   "q6_K": "cpu-gguf", "q5_K": "cpu-gguf", "q3_K": "cpu-gguf",
                   "q2_K": "cpu-gguf", "iq4_xs": "cpu-gguf", "iq2_xxs": "cpu-gguf",
                   "iq2_xs": "cpu-gguf", "iq2_s": "cpu-gguf", "iq3_xxs": "cpu-gguf",
                   "iq3_s": "cpu-gguf", "iq1_s": "cpu-gguf", "iq1_m": "cpu-gguf",
                   "iq4_nl": "cpu-gguf", "gguf": "cpu-gguf"}  # fmt: skip

# The backend whose native kernel reads a kernel-layout file's format (cpu_native.F_*).
LAYOUT_BACKENDS = {1: "cpu-int8", 2: "cpu-int4"}


def default_backend(weights: ExpertWeights, activation: Activation = "silu") -> str:
    """What serves routed experts when no placement is given: for experts packed in a
    checkpoint's quantized format, the CPU backend of that format (`cpu-int8`, requantizing
    expert by expert, where the native kernels do not build); else `cpu-fp32` (the native
    kernel, one C call per layer) for fp32 experts on the CPU where that kernel builds, else
    `torch`. HETSERVE_NATIVE_KERNELS=0 keeps `torch` for unquantized experts."""
    from hetserve import envs
    from hetserve.native import native_unavailable_reason

    native = native_unavailable_reason() is None
    if weights.layout is not None:  # only its own native kernel reads it
        return LAYOUT_BACKENDS[weights.layout.fmt]
    if weights.packed is not None:
        return PACKED_BACKENDS[weights.packed.fmt] if native else "cpu-int8"
    w = weights.w13
    if w.device.type != "cpu" or w.dtype != torch.float32 or not native_activation(activation):
        return "torch"
    if not envs.native_kernels() or weights.hidden_size % 8 or weights.intermediate_size % 8:
        return "torch"
    return "cpu-fp32" if native else "torch"


def native_activation(activation: Activation) -> bool:
    """Whether the native experts kernel fuses this activation (silu, gpt-oss's clamped one)."""
    return isinstance(activation, ClampedSwiGLU) or activation == "silu"


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def group_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """Sort (token, slot) pairs by expert. Returns (order, counts) where `order` indexes the
    flattened [T*k] routing and `counts[e]` is how many pairs expert e received."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


@register_backend("torch")
class TorchExperts:
    """The reference: the model's dtype on the model's device, one matmul pair per active expert."""

    def __init__(self, weights: ExpertWeights, activation: Activation = "silu") -> None:
        if weights.packed is not None:
            weights = weights.dense()  # the reference computes from dequantized weights
        self.w13, self.w2, self.b13, self.b2 = weights.w13, weights.w2, weights.b13, weights.b2
        self.num_experts = weights.num_experts
        self.inter = weights.intermediate_size
        self.glu = gated_activation(activation)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.w13, self.w2, self.b13, self.b2) if t is not None)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        t, k = topk_ids.shape
        order, counts = group_by_expert(topk_ids, self.num_experts)
        xs = x[order // k]
        ws = topk_weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
        # One host sync for the counts; per-expert slices are then plain views.
        counts_list = counts.tolist()
        if min(counts_list) > 0 and len(counts_list) > 1:
            ys = self._all_active(xs, counts, counts_list) * ws
        else:
            ys = torch.empty_like(xs)
            start = 0
            for e, n in enumerate(counts_list):
                if n == 0:
                    continue
                end = start + n
                h = F.linear(xs[start:end], self.w13[e], self._bias(self.b13, e))
                gate, up = h.split(self.inter, dim=-1)
                y = F.linear(self.glu(gate, up), self.w2[e], self._bias(self.b2, e))
                ys[start:end] = y * ws[start:end]
                start = end
        # Back to (token, slot) order with a gather, then sum the k slots: no atomic scatter-add,
        # which is slow on CPU when threads are contended.
        return ys[torch.argsort(order)].view(t, k, -1).sum(dim=1)

    @staticmethod
    def _bias(b: torch.Tensor | None, e: int) -> torch.Tensor | None:
        return None if b is None else b[e]

    def _all_active(self, xs: torch.Tensor, counts: torch.Tensor, counts_list: list[int]):
        """Every expert has tokens (small models, big batches): pad each expert's rows to the
        largest count and run two batched matmuls instead of a loop of 2E small ones."""
        e, m = self.num_experts, max(counts_list)
        starts = counts.cumsum(0) - counts
        expert_of = torch.repeat_interleave(torch.arange(e, device=xs.device), counts)
        slot = torch.arange(xs.shape[0], device=xs.device) - starts[expert_of]
        padded = xs.new_zeros(e, m, xs.shape[1])
        padded[expert_of, slot] = xs
        h = torch.bmm(padded, self.w13.transpose(1, 2))
        if self.b13 is not None:
            h = h + self.b13.unsqueeze(1)
        gate, up = h.split(self.inter, dim=-1)
        out = torch.bmm(self.glu(gate, up), self.w2.transpose(1, 2))
        if self.b2 is not None:
            out = out + self.b2.unsqueeze(1)
        return out[expert_of, slot]
