"""Qwen2-MoE (sigmoid-gated shared expert) and Qwen3-MoE (q/k norm, norm_topk_prob)."""

from __future__ import annotations

from torch import nn

from hetserve.layers.moe import SparseMoE
from hetserve.model.base import CausalLM, DecoderLayer, DenseMLP
from hetserve.model.config import ModelConfig
from hetserve.model.llama import GQAAttention, make_rotary, reject_sliding_window
from hetserve.moe.router import RouterConfig


def is_sparse_layer(cfg: ModelConfig, i: int) -> bool:
    mlp_only = cfg.get("mlp_only_layers", default=[])
    step = cfg.get("decoder_sparse_step", default=1)
    return i not in mlp_only and num_experts(cfg) > 0 and (i + 1) % step == 0


def num_experts(cfg: ModelConfig) -> int:
    return int(cfg.get("num_experts", "num_local_experts", "n_routed_experts", default=0))


class _QwenMoeFamily(CausalLM):
    qwen3 = False

    def __init__(self, cfg: ModelConfig) -> None:
        reject_sliding_window(cfg)
        rotary = make_rotary(cfg)
        if self.qwen3:
            bias = bool(cfg.get("attention_bias", default=False))
            qkv_bias, o_bias = bias, bias
        else:
            qkv_bias, o_bias = bool(cfg.get("qkv_bias", default=True)), False
        router = RouterConfig(
            num_experts=num_experts(cfg),
            top_k=int(cfg.require("num_experts_per_tok")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", default=self.qwen3)),
        )
        moe_inter = int(cfg.require("moe_intermediate_size"))
        shared_inter = cfg.get("shared_expert_intermediate_size", default=0)

        def make_layer(i: int) -> nn.Module:
            attn = GQAAttention(cfg, i, rotary, qkv_bias, o_bias, qk_norm=self.qwen3)
            if not is_sparse_layer(cfg, i):
                mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
            else:
                shared = None
                if not self.qwen3 and shared_inter:
                    shared = DenseMLP(cfg.hidden_size, shared_inter, cfg.hidden_act)
                mlp = SparseMoE(
                    cfg.hidden_size,
                    router,
                    moe_inter,
                    cfg.hidden_act,
                    shared=shared,
                    shared_name="shared_expert",
                    shared_gate=shared is not None,
                )
            return DecoderLayer(cfg, attn, mlp)

        super().__init__(cfg, make_layer)
        self.rotary = rotary


class Qwen2MoeForCausalLM(_QwenMoeFamily):
    qwen3 = False


class Qwen3MoeForCausalLM(_QwenMoeFamily):
    qwen3 = True
