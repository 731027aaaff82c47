"""Mixtral: every layer a `block_sparse_moe` with softmax top-k renormalised; optional window."""

from __future__ import annotations

from torch import nn

from hetserve.layers.moe import SparseMoE
from hetserve.model.base import CausalLM, DecoderLayer
from hetserve.model.config import ModelConfig
from hetserve.model.llama import GQAAttention, make_rotary
from hetserve.moe.router import RouterConfig


class MixtralForCausalLM(CausalLM):
    # transformers 5 names the block `mlp` in memory; its checkpoints say `block_sparse_moe`.
    checkpoint_aliases = [(r"\.mlp\.", ".block_sparse_moe.")]
    expert_weight_names = ("w1", "w3", "w2")

    def __init__(self, cfg: ModelConfig) -> None:
        rotary = make_rotary(cfg)
        router = RouterConfig(
            num_experts=int(cfg.require("num_local_experts", "num_experts")),
            top_k=int(cfg.require("num_experts_per_tok")),
            norm_topk_prob=True,
        )

        def make_layer(i: int) -> nn.Module:
            attn = GQAAttention(cfg, i, rotary)
            moe = SparseMoE(cfg.hidden_size, router, cfg.intermediate_size, cfg.hidden_act)
            return DecoderLayer(cfg, attn, moe, mlp_name="block_sparse_moe")

        super().__init__(cfg, make_layer)
        self.rotary = rotary
        self.sliding_window = cfg.get("sliding_window")
