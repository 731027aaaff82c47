"""Kimi-Linear (`KimiLinearForCausalLM`): Kimi Delta Attention (KDA) layers beside MLA layers,
and DeepSeek-V3-style MoE.

  * KDA (`self_attn` of the layers in `linear_attn_config.kda_layers`, 1-based): q, k, v
    projections, each through its own depthwise causal conv (+SiLU) (`q_conv1d`, ...); q and
    k L2-normalised; the gated delta rule with a decay per key channel,
    -exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias), and rate sigmoid(b_proj(x)); the
    output RMSNorm gated by sigmoid(g_b_proj(g_a_proj(x))); o_proj.
  * MLA (`full_attn_layers`) without rotary ("NoPE"): the shared key part is cached and used
    unrotated; softmax scale (nope + rope dim)^-0.5.
  * MoE from `first_k_dense_replace` on (`block_sparse_moe`): sigmoid scores plus
    `e_score_correction_bias` for selection, grouped top-k (`num_expert_group`, `topk_group`),
    renormalised (`moe_renormalize`) and scaled (`routed_scaling_factor`), plus
    `num_shared_experts` shared experts; experts as `experts.{e}.w1|w3|w2` (Mixtral names).
Config keys as Moonshot publishes them (`num_experts`, `num_experts_per_token`,
`model_max_length`, ...), with transformers' names as aliases.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from hetserve.errors import ModelLoadError
from hetserve.kv.cache_spec import StateLayerSpec
from hetserve.layers.attention import ForwardContext
from hetserve.layers.linear_attention import LinearHeads, gated_rms_norm, linear_mix
from hetserve.layers.moe import SparseMoE
from hetserve.model.base import CausalLM, DecoderLayer, DenseMLP
from hetserve.model.config import ModelConfig
from hetserve.model.deepseek import MLAttention
from hetserve.moe.router import RouterConfig


def _conv(channels: int, kernel: int) -> nn.Conv1d:
    return nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1, bias=False)


class KimiDeltaAttention(nn.Module):
    # Finer than int8 under all-int8: see "Precision" in layers/linear_attention.py.
    precise_projections = (
        "q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj",
    )  # fmt: skip

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        lin = cfg.get("linear_attn_config", default={})
        self.layer_idx = layer_idx
        self.num_heads = int(lin.get("num_heads") or cfg.get("linear_num_heads", default=32))
        self.head_dim = int(lin.get("head_dim") or cfg.get("linear_head_dim", default=128))
        kernel = int(
            lin.get("short_conv_kernel_size") or cfg.get("linear_conv_kernel_dim", default=4)
        )
        hidden, width = cfg.hidden_size, self.num_heads * self.head_dim
        self.width = width
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (_conv(width, kernel) for _ in range(3))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.num_heads, 1))
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(self.head_dim))
        self.eps = cfg.rms_norm_eps
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def cache_spec(self) -> StateLayerSpec:
        kernel = self.q_conv1d.weight.shape[-1]
        return StateLayerSpec(
            ((3 * self.width, kernel - 1), (self.num_heads, self.head_dim, self.head_dim))
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        mixed = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        # The three convolutions are one depthwise convolution over q|k|v channels.
        weight = torch.cat((self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight))
        gate = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        # softplus's threshold 20 is the reference's: above it, softplus(g) is g itself.
        log_decay = -self.A_log.float().exp().view(1, h, 1) * F.softplus(gate.view(t, h, d))
        beta = torch.sigmoid(self.b_proj(x).float())
        heads = LinearHeads(h, h, d, d)
        o = linear_mix(self.layer_idx, mixed, weight.squeeze(1), heads, log_decay, beta, ctx)
        out_gate = self.g_b_proj(self.g_a_proj(x)).view(t, h, d)
        o = gated_rms_norm(o, out_gate, self.o_norm.weight, self.eps, torch.sigmoid)
        return self.o_proj(o.reshape(t, -1).to(x.dtype))


def layer_types(cfg: ModelConfig) -> list[str]:
    types = cfg.get("layer_types")
    lin = cfg.get("linear_attn_config", default={})
    if types is None and "full_attn_layers" in lin and "kda_layers" in lin:
        types = [""] * cfg.num_layers
        for i in lin["full_attn_layers"]:
            types[i - 1] = "full_attention"  # 1-based in the published config
        for i in lin["kda_layers"]:
            types[i - 1] = "linear_attention"
    if types is None:
        types = [
            "full_attention" if i and i % 4 == 0 else "linear_attention"
            for i in range(cfg.num_layers)
        ]
    if len(types) < cfg.num_layers or set(types[: cfg.num_layers]) - {
        "linear_attention",
        "full_attention",
    }:
        raise ModelLoadError(f"Kimi-Linear layer types must cover all layers, got {types}")
    return list(types)


class KimiLinearForCausalLM(CausalLM):
    expert_weight_names = ("w1", "w3", "w2")
    # GGUF files (model/gguf_file.py) name the MoE `mlp` as the other families do
    checkpoint_aliases = [(r"\.mlp\.", ".block_sparse_moe.")]

    def __init__(self, cfg: ModelConfig) -> None:
        ctx_len = cfg.get("model_max_length", "max_position_embeddings")
        if ctx_len is not None:
            cfg = dataclasses.replace(cfg, max_position_embeddings=int(ctx_len))
        if "rms_norm_eps" not in cfg.hf:
            cfg = dataclasses.replace(cfg, rms_norm_eps=1e-5)
        types = layer_types(cfg)
        n_group = int(cfg.get("num_expert_group", "n_group", default=1))
        router = RouterConfig(
            num_experts=int(cfg.require("num_experts", "num_local_experts", "n_routed_experts")),
            top_k=int(cfg.require("num_experts_per_token", "num_experts_per_tok")),
            scoring="sigmoid",
            norm_topk_prob=bool(cfg.get("moe_renormalize", "norm_topk_prob", default=True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", default=1.0)),
            n_group=n_group,
            topk_group=int(cfg.get("topk_group", default=1)),
            group_score="top2sum",
            use_correction_bias=True,
        )
        moe_inter = int(cfg.require("moe_intermediate_size"))
        n_shared = int(cfg.get("num_shared_experts", "n_shared_experts", default=1))
        n_dense = int(cfg.get("first_k_dense_replace", default=1))

        def make_layer(i: int) -> nn.Module:
            if types[i] == "linear_attention":
                mixer: nn.Module = KimiDeltaAttention(cfg, i)
            else:
                mixer = MLAttention(cfg, i, None, bool(cfg.get("attention_bias", default=False)))
            if i < n_dense:
                mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
                return DecoderLayer(cfg, mixer, mlp)
            shared = (
                DenseMLP(cfg.hidden_size, moe_inter * n_shared, cfg.hidden_act)
                if n_shared
                else None
            )
            moe = SparseMoE(cfg.hidden_size, router, moe_inter, cfg.hidden_act, shared=shared)
            return DecoderLayer(cfg, mixer, moe, mlp_name="block_sparse_moe")

        super().__init__(cfg, make_layer)
