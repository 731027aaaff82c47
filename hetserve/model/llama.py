"""Dense decoder families: Llama, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm per head).

`GQAAttention` is also the attention of the Qwen-MoE and Mixtral families.
"""

from __future__ import annotations

import torch
from torch import nn

from hetserve.errors import ModelLoadError
from hetserve.kv.cache_spec import LayerKind, PagedLayerSpec
from hetserve.layers.attention import ForwardContext, paged_attention
from hetserve.layers.native_decode import native_qk_rope_cache
from hetserve.layers.norm import RMSNorm
from hetserve.layers.rotary import RotaryEmbedding
from hetserve.model.base import CausalLM, DecoderLayer, DenseMLP
from hetserve.model.config import ModelConfig


class GQAAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=o_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = [rotary]  # a list: shared across layers, not a registered submodule
        self.scale = d**-0.5
        # Families with per-layer windows or attention sinks (gpt-oss) set these.
        self.window: int | None = None
        self.sinks: nn.Parameter | None = None
        # Set by int8 quantization (layers/int8_linear.py): one matrix for q, k and v, in
        # place of the three projections (which are then None).
        self.qkv_proj: nn.Module | None = None

    def fused_projections(self) -> dict[str, tuple[str, ...]]:
        """Projections that read the same input and may be stored as one matrix."""
        return {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def fused_sizes(self) -> dict[str, int]:
        """Output features of each fused projection (LoRA adds each one's delta to its slice)."""
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": nq, "k_proj": nkv, "v_proj": nkv}

    def kv_spec(self) -> list[tuple[int, ...]]:
        return [(self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)]

    def cache_spec(self) -> PagedLayerSpec:
        kind = LayerKind.ATTENTION if self.window is None else LayerKind.SLIDING_WINDOW
        return PagedLayerSpec(kind, tuple(self.kv_spec()), self.window)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None:
            nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split((nq, nkv, nkv), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # CPU inference: norms, rotary and the cache write in one native call.
        q_rot = native_qk_rope_cache(self, q, k, v, ctx)
        if q_rot is not None:
            q, k, v = q_rot, None, None  # K/V already in the cache
        else:
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            rope = self.rotary[0]
            q, k = rope(q, ctx.meta.positions), rope(k, ctx.meta.positions)
        out = paged_attention(self.layer_idx, q, k, v, ctx, self.scale, self.window, self.sinks)
        return self.o_proj(out.reshape(t, -1))


def make_rotary(cfg: ModelConfig, dim: int | None = None, interleaved: bool = False):
    return RotaryEmbedding(
        dim or cfg.head_dim, cfg.max_position_embeddings, cfg.rope, interleaved=interleaved
    )


def reject_sliding_window(cfg: ModelConfig) -> None:
    if cfg.get("use_sliding_window", default=False):
        raise ModelLoadError(
            f"{cfg.architecture} with use_sliding_window=true is not supported; set it to false"
        )


class _DenseFamily(CausalLM):
    qkv_bias_key: str | None = "attention_bias"  # config key; None = always on (Qwen2)
    o_bias: bool | None = None  # None = same as attention_bias
    qk_norm = False

    def __init__(self, cfg: ModelConfig) -> None:
        reject_sliding_window(cfg)
        rotary = make_rotary(cfg)
        attn_bias = bool(cfg.get("attention_bias", default=False))
        qkv_bias = attn_bias if self.qkv_bias_key else True
        o_bias = attn_bias if self.o_bias is None else self.o_bias

        def make_layer(i: int) -> nn.Module:
            attn = GQAAttention(cfg, i, rotary, qkv_bias, o_bias, self.qk_norm)
            return DecoderLayer(
                cfg, attn, DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
            )

        super().__init__(cfg, make_layer)
        self.rotary = rotary


class LlamaForCausalLM(_DenseFamily):
    pass


class Qwen2ForCausalLM(_DenseFamily):
    qkv_bias_key = None
    o_bias = False


class Qwen3ForCausalLM(_DenseFamily):
    qk_norm = True
