"""Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5-MoE's text model (`Qwen3_5MoeForCausalLM`;
`Qwen3_5MoeForConditionalGeneration` checkpoints as published, their vision tower left out).

Layers alternate Gated DeltaNet linear attention with gated full attention (`layer_types`, or
one full layer every `full_attention_interval`, 4 by default: three linear to one full).
  * Gated DeltaNet (`linear_attn`): projections to q, k (per key head), v and an output gate z
    (per value head), b and a; a depthwise causal conv (+SiLU) over q|k|v; q and k
    L2-normalised, each key head shared by num_v_heads / num_k_heads value heads; the gated
    delta rule with decay exp(-exp(A_log) * softplus(a + dt_bias)) and rate sigmoid(b); an
    RMSNorm of the output gated by SiLU(z); out_proj. Qwen3-Next stores q|k|v|z (and b|a)
    interleaved by key-head group in `in_proj_qkvz` (`in_proj_ba`); Qwen3.5 stores
    `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` plainly.
  * Full attention (`self_attn`): q_proj yields per head a query and a gate of head_dim each,
    q/k RMSNorm per head, rotary over the first `partial_rotary_factor` (0.25) of each head,
    the output multiplied by sigmoid(gate) before o_proj.
  * MoE: softmax top-k (renormalised) plus a shared expert scaled by sigmoid(shared_expert_gate).
The layer norms, the final norm and q/k norms are zero-centred (the checkpoint holds w, the
scale is 1 + w): the loader stores 1 + w so the ordinary RMSNorm (and its native kernel)
applies them. The delta-rule output norm is plain.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from hetserve.errors import ModelLoadError
from hetserve.kv.cache_spec import StateLayerSpec
from hetserve.layers.attention import ForwardContext, paged_attention
from hetserve.layers.linear_attention import LinearHeads, gated_rms_norm, linear_mix
from hetserve.layers.moe import SparseMoE
from hetserve.layers.rotary import PartialRotaryEmbedding
from hetserve.model.base import CausalLM, DecoderLayer, DenseMLP
from hetserve.model.config import ModelConfig
from hetserve.model.llama import GQAAttention
from hetserve.model.qwen_moe import is_sparse_layer, num_experts
from hetserve.moe.router import RouterConfig

_ZERO_CENTRED = re.compile(
    r"(input_layernorm|post_attention_layernorm|self_attn\.q_norm|self_attn\.k_norm)\.weight$"
    r"|^model\.norm\.weight$"
)


def layer_types(cfg: ModelConfig) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval", default=4))
        types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(cfg.num_layers)
        ]
    if len(types) < cfg.num_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ModelLoadError(
            f"layer_types must name linear_attention or full_attention for each of the "
            f"{cfg.num_layers} layers, got {types}"
        )
    return list(types)


class GatedAttention(GQAAttention):
    """GQA whose q_proj also yields a per-head output gate (sigmoid) applied before o_proj."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary, bias: bool) -> None:
        super().__init__(cfg, layer_idx, rotary, qkv_bias=bias, o_bias=bias, qk_norm=True)
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * self.num_heads * self.head_dim, bias=bias)

    def fused_sizes(self) -> dict[str, int]:
        return {**super().fused_sizes(), "q_proj": 2 * self.num_heads * self.head_dim}

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        if self.qkv_proj is not None:
            nkv = self.num_kv_heads * d
            qg, k, v = self.qkv_proj(x).split((2 * h * d, nkv, nkv), dim=-1)
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, gate = qg.reshape(t, h, 2 * d).split(d, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(t, self.num_kv_heads, d))
        rope, pos = self.rotary[0], ctx.meta.positions
        q, k = rope(q, pos), rope(k, pos)
        v = v.reshape(t, self.num_kv_heads, d)
        out = paged_attention(self.layer_idx, q, k, v, ctx, self.scale)
        return self.o_proj(out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention (see the module docstring); `split_projections`: the
    Qwen3.5 checkpoint layout."""

    # Finer than int8 under all-int8: see "Precision" in layers/linear_attention.py.
    precise_projections = (
        "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
    )  # fmt: skip

    def __init__(self, cfg: ModelConfig, layer_idx: int, split_projections: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hidden = cfg.hidden_size
        self.num_k_heads = int(cfg.require("linear_num_key_heads"))
        self.num_v_heads = int(cfg.require("linear_num_value_heads"))
        self.k_dim = int(cfg.require("linear_key_head_dim"))
        self.v_dim = int(cfg.require("linear_value_head_dim"))
        if self.num_v_heads % self.num_k_heads:
            raise ModelLoadError(
                "linear_num_value_heads must be a multiple of linear_num_key_heads"
            )
        kernel = int(cfg.get("linear_conv_kernel_dim", default=4))
        self.heads = LinearHeads(self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim)
        key_dim, value_dim = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_dim = 2 * key_dim + value_dim
        self.split = split_projections
        if split_projections:
            self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(hidden, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, bias=False,
                                groups=self.conv_dim, padding=kernel - 1)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.v_dim))
        self.eps = cfg.rms_norm_eps
        self.out_proj = nn.Linear(value_dim, hidden, bias=False)

    def cache_spec(self) -> StateLayerSpec:
        kernel = self.conv1d.weight.shape[-1]
        return StateLayerSpec(
            ((self.conv_dim, kernel - 1), (self.num_v_heads, self.k_dim, self.v_dim))
        )

    def _project(self, x: torch.Tensor):
        """-> q|k|v [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]."""
        t = x.shape[0]
        if self.split:
            z = self.in_proj_z(x).view(t, self.num_v_heads, self.v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        # Grouped by key head: [q Dk | k Dk | v r*Dv | z r*Dv] and [b r | a r], r = Hv / Hk.
        hk, r = self.num_k_heads, self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(t, hk, -1)
        q, k, v, z = qkvz.split((self.k_dim, self.k_dim, r * self.v_dim, r * self.v_dim), -1)
        b, a = self.in_proj_ba(x).view(t, hk, 2 * r).split((r, r), -1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        z = z.reshape(t, self.num_v_heads, self.v_dim)
        return mixed, z, b.reshape(t, -1), a.reshape(t, -1)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        beta = torch.sigmoid(b.float())
        log_decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        weight = self.conv1d.weight.squeeze(1)
        o = linear_mix(self.layer_idx, mixed, weight, self.heads, log_decay, beta, ctx)
        o = gated_rms_norm(o, z, self.norm.weight, self.eps, F.silu)
        return self.out_proj(o.reshape(t, -1).to(x.dtype))


class _Qwen3NextFamily(CausalLM):
    zero_centred_norms = _ZERO_CENTRED  # also read by the tiny-checkpoint maker
    split_projections = False
    all_sparse = False  # Qwen3.5: every layer is MoE, top-k always renormalised

    def __init__(self, cfg: ModelConfig) -> None:
        types = layer_types(cfg)
        rotary = PartialRotaryEmbedding(
            cfg.partial_rotary_dim(0.25), cfg.max_position_embeddings, cfg.rope
        )
        bias = bool(cfg.get("attention_bias", default=False))
        router = RouterConfig(
            num_experts=num_experts(cfg),
            top_k=int(cfg.require("num_experts_per_tok")),
            norm_topk_prob=self.all_sparse or bool(cfg.get("norm_topk_prob", default=True)),
        )
        moe_inter = int(cfg.require("moe_intermediate_size"))
        shared_inter = int(cfg.get("shared_expert_intermediate_size", default=0))

        def make_mlp(i: int) -> nn.Module:
            if not self.all_sparse and not is_sparse_layer(cfg, i):
                return DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
            shared = (
                DenseMLP(cfg.hidden_size, shared_inter, cfg.hidden_act) if shared_inter else None
            )
            gated = shared is not None
            return SparseMoE(
                cfg.hidden_size, router, moe_inter, cfg.hidden_act, shared=shared,
                shared_name="shared_expert", shared_gate=gated,
            )  # fmt: skip

        def make_layer(i: int) -> nn.Module:
            if types[i] == "linear_attention":
                mixer = GatedDeltaNet(cfg, i, self.split_projections)
                return DecoderLayer(cfg, mixer, make_mlp(i), attn_name="linear_attn")
            return DecoderLayer(cfg, GatedAttention(cfg, i, rotary, bias), make_mlp(i))

        super().__init__(cfg, make_layer)
        self.rotary = rotary

    def map_checkpoint_tensor(self, name: str, value):
        # A published Qwen3.5 (vision-language) checkpoint keeps the text model here.
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        if value is not None and _ZERO_CENTRED.search(name):
            value = value.float() + 1.0  # zero-centred: stored as the scale it applies
        return name, value

    def published_value(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return value - 1.0 if _ZERO_CENTRED.search(name) else value


class Qwen3NextForCausalLM(_Qwen3NextFamily):
    pass


class Qwen3_5MoeForCausalLM(_Qwen3NextFamily):  # noqa: N801 (the HF class name)
    split_projections = True
    all_sparse = True
