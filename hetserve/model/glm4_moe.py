"""GLM-4.5 / 4.6 / 4.5-Air (`Glm4MoeForCausalLM`).

Attention is GQA with q/k/v bias (`attention_bias`; o_proj never has one), optional per-head
q/k RMSNorm before rotary (`use_qk_norm`), and rotary over the first `partial_rotary_factor` of
each head (0.5 when the config does not say; halves layout, not interleaved). The first
`first_k_dense_replace` layers have a dense MLP; the others route with sigmoid scores plus
`e_score_correction_bias` (selection only), group-limited top-k by the sum of each group's two
best scores, renormalisation (`norm_topk_prob`) then `routed_scaling_factor`, and add
`n_shared_experts` shared experts (one MLP of n * moe_intermediate_size).

Published checkpoints carry a multi-token-prediction layer after `num_hidden_layers`
(model.layers.92 in GLM-4.5, 46 in GLM-4.5-Air); the loader skips it, as it skips DeepSeek-V3's.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from hetserve.layers.rotary import PartialRotaryEmbedding
from hetserve.model.base import CausalLM, DecoderLayer
from hetserve.model.config import ModelConfig
from hetserve.model.deepseek import deepseek_mlp_maker
from hetserve.model.llama import GQAAttention
from hetserve.moe.router import RouterConfig

# transformers' Glm4MoeConfig defaults, for keys a config.json may leave out.
_DEFAULT_PARTIAL_ROTARY = 0.5
_DEFAULT_RMS_EPS = 1e-5


def router_config(cfg: ModelConfig) -> RouterConfig:
    return RouterConfig(
        num_experts=int(cfg.require("n_routed_experts", "num_local_experts")),
        top_k=int(cfg.require("num_experts_per_tok")),
        scoring="sigmoid",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", default=True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", default=1.0)),
        n_group=int(cfg.get("n_group", default=1)),
        topk_group=int(cfg.get("topk_group", default=1)),
        group_score="top2sum",
        use_correction_bias=True,
    )


class Glm4MoeForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        if "rms_norm_eps" not in cfg.hf:
            cfg = dataclasses.replace(cfg, rms_norm_eps=_DEFAULT_RMS_EPS)
        rotary = PartialRotaryEmbedding(
            cfg.partial_rotary_dim(_DEFAULT_PARTIAL_ROTARY), cfg.max_position_embeddings, cfg.rope
        )
        qkv_bias = bool(cfg.get("attention_bias", default=False))
        qk_norm = bool(cfg.get("use_qk_norm", default=False))
        make_mlp = deepseek_mlp_maker(cfg, router_config(cfg), shared=1, first_dense=1)

        def make_layer(i: int) -> nn.Module:
            attn = GQAAttention(cfg, i, rotary, qkv_bias, o_bias=False, qk_norm=qk_norm)
            return DecoderLayer(cfg, attn, make_mlp(i))

        super().__init__(cfg, make_layer)
        self.rotary = rotary
