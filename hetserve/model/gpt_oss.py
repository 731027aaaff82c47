"""gpt-oss (GptOssForCausalLM).

Attention: q/k/v/o with biases, per-head sink logits, layers alternating between a sliding
window and full attention (`layer_types`, `sliding_window`), YaRN rotary. MoE on every layer: a
router with a bias whose top-k logits are softmaxed (the same as renormalising the softmax over
all experts), experts with biases and a clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`).

Checkpoints store each layer's experts fused and transposed, `mlp.experts.gate_up_proj`
[E, H, 2I] with gate and up interleaved along the last dimension (gate = even columns) and
`down_proj` [E, I, H], or (as published) those two as MXFP4 blocks [E, 2I, H/32, 16] and
[E, H, I/32, 16]; `map_checkpoint_tensor` brings both into hetserve's layout (w13 = gate rows,
then up rows).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from hetserve.layers.moe import SparseMoE
from hetserve.model.base import CausalLM, DecoderLayer
from hetserve.model.config import ModelConfig
from hetserve.model.llama import GQAAttention, make_rotary
from hetserve.moe.experts import ClampedSwiGLU
from hetserve.moe.router import RouterConfig
from hetserve.quant.packed import QMatrix

_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")


def layer_windows(cfg: ModelConfig) -> list[int | None]:
    """Each layer's attention window: `sliding_window` for "sliding_attention" layers."""
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_layers)
    ]
    window = cfg.get("sliding_window")
    return [window if t == "sliding_attention" else None for t in types]


def _gate_up_order(n: int) -> torch.Tensor:
    """Interleaved rows (gate 0, up 0, gate 1, ...) -> gate rows, then up rows."""
    return torch.cat((torch.arange(0, n, 2), torch.arange(1, n, 2)))


class GptOssForCausalLM(CausalLM):
    checkpoint_aliases = [(r"\.mlp\.router\.", ".mlp.gate.")]

    def __init__(self, cfg: ModelConfig) -> None:
        rotary = make_rotary(cfg)
        windows = layer_windows(cfg)
        act = ClampedSwiGLU(
            alpha=float(cfg.get("swiglu_alpha", default=1.702)),
            limit=float(cfg.get("swiglu_limit", default=7.0)),
        )
        router = RouterConfig(
            num_experts=int(cfg.require("num_local_experts", "num_experts")),
            top_k=int(cfg.require("num_experts_per_tok", "experts_per_token")),
            norm_topk_prob=True,
            bias=True,
        )
        bias = bool(cfg.get("attention_bias", default=True))

        def make_layer(i: int) -> nn.Module:
            attn = GQAAttention(cfg, i, rotary, qkv_bias=bias, o_bias=bias)
            attn.window = windows[i]
            attn.sinks = nn.Parameter(torch.empty(cfg.num_heads))
            mlp = SparseMoE(cfg.hidden_size, router, cfg.intermediate_size, act, expert_bias=True)
            return DecoderLayer(cfg, attn, mlp)

        super().__init__(cfg, make_layer)
        self.rotary = rotary

    def map_checkpoint_tensor(self, name: str, value):
        m = _EXPERTS.match(name)
        if m is None:
            return name, value
        prefix, proj, is_bias = m.groups()
        gate_up = proj == "gate_up_proj"
        if is_bias:
            name = f"{prefix}.{'b13' if gate_up else 'b2'}"
            if value is not None and gate_up:
                value = value[:, _gate_up_order(value.shape[1])]
            return name, value
        if value is None:
            return name, None
        if not isinstance(value, QMatrix):  # dense: [E, in, out] -> [E, out, in]
            value = value.transpose(1, 2)
        if gate_up:
            order = _gate_up_order(value.shape[1])
            value = value.rows(order) if isinstance(value, QMatrix) else value[:, order]
        return name, value

    def hf_checkpoint_shapes(self):
        """(name, shape) of every tensor of a checkpoint as transformers saves this family."""
        for name, p in self.named_parameters():
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith(".experts"):
                e, h, i = p.shape[0], self.config.hidden_size, self.config.intermediate_size
                yield {
                    "w13": (f"{prefix}.gate_up_proj", (e, h, 2 * i)),
                    "w2": (f"{prefix}.down_proj", (e, i, h)),
                    "b13": (f"{prefix}.gate_up_proj_bias", (e, 2 * i)),
                    "b2": (f"{prefix}.down_proj_bias", (e, h)),
                }[leaf]
            else:
                yield name.replace(".mlp.gate.", ".mlp.router."), tuple(p.shape)
