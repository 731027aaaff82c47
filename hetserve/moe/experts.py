"""Routed-expert backends: one contract, one registry.

A backend owns the routed experts of one MoE layer and computes, for T tokens,
    out[t] = sum_j topk_weights[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]
Model files only ever call `forward`; placement (hybrid issue) decides which backend a layer gets,
so routed experts can move to a CPU kernel without touching model code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ExpertWeights:
    """Fused weights of one layer's routed experts, in the layout transformers uses in memory.

    w13: [E, 2*I, H] (gate rows first, then up); w2: [E, H, I].
    """

    w13: torch.Tensor
    w2: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]


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
_REGISTRY: dict[str, BackendFactory] = {}
# Modules whose backends register on import; loaded on the first registry lookup so importing
# this contract stays cheap and free of import cycles.
_BUILTIN_BACKEND_MODULES = ("hetserve.moe.cpu_backends", "hetserve.moe.kt_backend")
_builtins_loaded = False


def _load_builtin_backends() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for name in _BUILTIN_BACKEND_MODULES:
            importlib.import_module(name)


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    def deco(factory: BackendFactory) -> BackendFactory:
        if name in _REGISTRY:
            raise RuntimeError(f"experts backend {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def available_backends() -> list[str]:
    _load_builtin_backends()
    return sorted(_REGISTRY)


def create_backend(
    name: str, weights: ExpertWeights, activation: str = "silu", **options
) -> ExpertsBackend:
    """Uniform constructor: every backend is `factory(weights, activation=..., **options)`."""
    _load_builtin_backends()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown experts backend {name!r}; available: {', '.join(available_backends())}"
        ) from None
    return factory(weights, activation=activation, **options)


def default_backend(weights: ExpertWeights, activation: str = "silu") -> str:
    """What serves routed experts when no placement is given: `cpu-fp32` (the native kernel,
    one C call per layer) for fp32 silu experts on the CPU where that kernel builds, else
    `torch`. HETSERVE_NATIVE_KERNELS=0 keeps `torch`."""
    from hetserve import envs

    w = weights.w13
    if w.device.type != "cpu" or w.dtype != torch.float32 or activation != "silu":
        return "torch"
    if not envs.native_kernels() or weights.hidden_size % 8 or weights.intermediate_size % 8:
        return "torch"
    from hetserve.native import native_unavailable_reason

    return "torch" if native_unavailable_reason() is not None else "cpu-fp32"


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

    def __init__(self, weights: ExpertWeights, activation: str = "silu") -> None:
        self.w13 = weights.w13
        self.w2 = weights.w2
        self.num_experts = weights.num_experts
        self.inter = weights.intermediate_size
        self.act = ACTIVATIONS[activation]

    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

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
                h = F.linear(xs[start:end], self.w13[e])
                gate, up = h.split(self.inter, dim=-1)
                ys[start:end] = F.linear(self.act(gate) * up, self.w2[e]) * ws[start:end]
                start = end
        # Back to (token, slot) order with a gather, then sum the k slots: no atomic scatter-add,
        # which is slow on CPU when threads are contended.
        return ys[torch.argsort(order)].view(t, k, -1).sum(dim=1)

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
        gate, up = h.split(self.inter, dim=-1)
        out = torch.bmm(self.act(gate) * up, self.w2.transpose(1, 2))
        return out[expert_of, slot]
