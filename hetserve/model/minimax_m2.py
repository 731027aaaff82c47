"""MiniMax-M2 (`MiniMaxM2ForCausalLM`): full-attention GQA and a routed-experts MoE on every
layer.

Attention normalises q and k with one RMSNorm over all heads together (`q_norm` of
num_heads * head_dim channels, not per head), then rotates the first `rotary_dim` channels of
each head (halves layout; the published config says `rotary_dim`, transformers
`partial_rotary_factor`). Routing: sigmoid scores, `e_score_correction_bias` added for the
choice only, top-k renormalised, no groups and no shared experts. Checkpoints name the MoE
`block_sparse_moe` with Mixtral's expert names (`experts.{e}.w1|w3|w2`) and keep the
correction bias beside the gate (`block_sparse_moe.e_score_correction_bias`).
"""

from __future__ import annotations

import torch
from torch import nn

from hetserve.errors import ModelLoadError
from hetserve.layers.attention import ForwardContext, paged_attention
from hetserve.layers.moe import SparseMoE
from hetserve.layers.norm import RMSNorm
from hetserve.layers.rotary import PartialRotaryEmbedding
from hetserve.model.base import CausalLM, DecoderLayer
from hetserve.model.config import ModelConfig
from hetserve.model.llama import GQAAttention
from hetserve.moe.router import RouterConfig

_BIAS_PUBLISHED = ".block_sparse_moe.e_score_correction_bias"
_BIAS_OURS = ".block_sparse_moe.gate.e_score_correction_bias"


def rotary_dim(cfg: ModelConfig) -> int:
    dim = cfg.get("rotary_dim")
    if dim is None:
        factor = cfg.rope.get("partial_rotary_factor")
        if factor is None:
            factor = cfg.get("partial_rotary_factor", default=1.0)
        dim = int(cfg.head_dim * float(factor))
    dim = int(dim)
    if dim < 2 or dim % 2 or dim > cfg.head_dim:
        raise ModelLoadError(
            f"rotary_dim {dim} must be an even number in [2, head_dim={cfg.head_dim}]"
        )
    return dim


class MiniMaxAttention(GQAAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary) -> None:
        super().__init__(cfg, layer_idx, rotary)
        eps = cfg.rms_norm_eps
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        if self.qkv_proj is not None:
            nq, nkv = self.num_heads * d, self.num_kv_heads * d
            q, k, v = self.qkv_proj(x).split((nq, nkv, nkv), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # One norm over all heads: before the per-head view.
        q = self.q_norm(q.contiguous()).view(t, self.num_heads, d)
        k = self.k_norm(k.contiguous()).view(t, self.num_kv_heads, d)
        rope, pos = self.rotary[0], ctx.meta.positions
        q, k = rope(q, pos), rope(k, pos)
        out = paged_attention(
            self.layer_idx, q, k, v.reshape(t, self.num_kv_heads, d), ctx, self.scale
        )
        return self.o_proj(out.reshape(t, -1))


class MiniMaxM2ForCausalLM(CausalLM):
    expert_weight_names = ("w1", "w3", "w2")
    # transformers 5 names the block `mlp` in memory; checkpoints say `block_sparse_moe`.
    checkpoint_aliases = [(r"\.mlp\.", ".block_sparse_moe.")]

    def __init__(self, cfg: ModelConfig) -> None:
        rotary = PartialRotaryEmbedding(rotary_dim(cfg), cfg.max_position_embeddings, cfg.rope)
        router = RouterConfig(
            num_experts=int(cfg.require("num_local_experts", "num_experts")),
            top_k=int(cfg.require("num_experts_per_tok")),
            scoring="sigmoid",
            norm_topk_prob=True,
            use_correction_bias=True,
        )

        def make_layer(i: int) -> nn.Module:
            moe = SparseMoE(cfg.hidden_size, router, cfg.intermediate_size, cfg.hidden_act)
            attn = MiniMaxAttention(cfg, i, rotary)
            return DecoderLayer(cfg, attn, moe, mlp_name="block_sparse_moe")

        super().__init__(cfg, make_layer)
        self.rotary = rotary

    def map_checkpoint_tensor(self, name: str, value):
        if name.endswith(_BIAS_PUBLISHED):
            name = name[: -len(_BIAS_PUBLISHED)] + _BIAS_OURS
        return name, value

    def published_name(self, name: str) -> str:
        if name.endswith(_BIAS_OURS):
            return name[: -len(_BIAS_OURS)] + _BIAS_PUBLISHED
        return name
