"""Group-limited routing: experts of dropped groups are never selected."""

import torch

from hetserve.moe.router import RouterConfig, TopKRouter


def test_dropped_groups_lose_even_to_negative_choice_scores():
    # Sigmoid scores are all 0.5; the correction bias makes both experts of the kept group
    # score below zero, which a 0-filled mask would let the dropped group's experts beat.
    cfg = RouterConfig(
        num_experts=4,
        top_k=2,
        scoring="sigmoid",
        norm_topk_prob=True,
        n_group=2,
        topk_group=1,
        group_score="top2sum",
        use_correction_bias=True,
    )
    router = TopKRouter(8, cfg)
    router.weight.data.zero_()
    router.e_score_correction_bias.data = torch.tensor([-0.6, -0.7, -2.0, -2.0])
    weights, ids = router(torch.randn(3, 8))
    assert ids.sort(dim=-1).values.tolist() == [[0, 1]] * 3
    torch.testing.assert_close(weights, torch.full((3, 2), 0.5))
