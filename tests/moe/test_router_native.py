"""Softmax top-k routing: the native CPU path equals the torch reference (order aside)."""

from __future__ import annotations

import pytest
import torch

from hetserve.moe.router import RouterConfig, TopKRouter


def _by_expert(w: torch.Tensor, ids: torch.Tensor):
    order = ids.argsort(dim=-1)
    return w.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize(
    "cfg",
    [
        RouterConfig(num_experts=32, top_k=4, norm_topk_prob=True),
        RouterConfig(num_experts=8, top_k=2),  # Mixtral-like: no renormalisation
        RouterConfig(num_experts=16, top_k=1, norm_topk_prob=True),
        RouterConfig(num_experts=64, top_k=6, routed_scaling_factor=2.5),
        RouterConfig(
            num_experts=64,
            top_k=6,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            scale_only_if_not_normed=True,
        ),
        RouterConfig(num_experts=64, top_k=6, norm_topk_prob=True, routed_scaling_factor=2.5),
    ],
)
def test_native_routing_equals_torch(cfg, monkeypatch):
    router = TopKRouter(48, cfg).requires_grad_(False)
    g = torch.Generator().manual_seed(cfg.num_experts + cfg.top_k)
    router.weight.copy_(torch.randn(cfg.num_experts, 48, generator=g))
    x = torch.randn(130, 48, generator=g)  # > one 64-token work item
    w_nat, ids_nat = router(x)
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    w_ref, ids_ref = router(x)
    assert ids_nat.dtype == ids_ref.dtype and w_nat.shape == w_ref.shape
    (w_nat, ids_nat), (w_ref, ids_ref) = _by_expert(w_nat, ids_nat), _by_expert(w_ref, ids_ref)
    assert torch.equal(ids_nat, ids_ref)
    assert torch.allclose(w_nat, w_ref, rtol=1e-5, atol=1e-7)


def test_empty_batch():
    router = TopKRouter(8, RouterConfig(num_experts=4, top_k=2)).requires_grad_(False)
    w, ids = router(torch.randn(0, 8))
    assert w.shape == ids.shape == (0, 2)
