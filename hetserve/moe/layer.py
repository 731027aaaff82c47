"""The MoE block the model families use: router -> routed experts (+ shared experts).

`FusedExperts` holds the routed experts' weights (names `w13`, `w2`) and delegates compute to an
`ExpertsBackend` from the registry; placement swaps the backend without touching model code.
"""

from __future__ import annotations

import torch
from torch import nn

from hetserve.moe.experts import ExpertsBackend, ExpertWeights, create_backend
from hetserve.moe.router import RouterConfig, TopKRouter


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, activation: str = "silu"):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = inter
        self.activation = activation
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.backend_name: str | None = None
        self._backend: ExpertsBackend | None = None

    def weights(self) -> ExpertWeights:
        return ExpertWeights(self.w13.data, self.w2.data)

    def set_backend(self, name: str, **options) -> None:
        """Build the compute backend; called once weights are loaded (and again on re-placement)."""
        self._backend = create_backend(name, self.weights(), activation=self.activation, **options)
        self.backend_name = name

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self._backend is None:
            self.set_backend("torch")
        return self._backend.forward(x, topk_weights, topk_ids)


class SparseMoE(nn.Module):
    """Routed experts plus optional shared experts (optionally sigmoid-gated, Qwen2-MoE)."""

    def __init__(
        self,
        hidden: int,
        router: RouterConfig,
        inter: int,
        activation: str = "silu",
        shared: nn.Module | None = None,
        shared_name: str = "shared_experts",
        shared_gate: bool = False,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden, router)
        self.experts = FusedExperts(router.num_experts, hidden, inter, activation)
        self._shared_name = shared_name if shared is not None else None
        if shared is not None:
            setattr(self, shared_name, shared)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        out = self.experts(x, topk_weights, topk_ids)
        if self._shared_name is not None:
            shared = getattr(self, self._shared_name)(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
