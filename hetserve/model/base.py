"""Building blocks shared by the families: decoder layer, dense MLP, the causal LM shell.

Parameter names mirror HF checkpoints (model.layers.N.self_attn.q_proj.weight, ...) so the loader
maps names one to one; only fused routed experts need a mapping (see loader.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from hetserve.kv.cache_spec import LayerCacheSpec, paged_layout
from hetserve.kv.paged import KVCacheSpec
from hetserve.layers.attention import ForwardContext
from hetserve.layers.moe import FusedExperts, SparseMoE
from hetserve.layers.norm import RMSNorm
from hetserve.model.config import ModelConfig
from hetserve.moe.experts import ACTIVATIONS

_log = logging.getLogger(__name__)


class DenseMLP(nn.Module):
    def __init__(
        self, hidden: int, inter: int, act: str, names=("gate_proj", "up_proj", "down_proj")
    ):
        super().__init__()
        self._names = names
        setattr(self, names[0], nn.Linear(hidden, inter, bias=False))
        setattr(self, names[1], nn.Linear(hidden, inter, bias=False))
        setattr(self, names[2], nn.Linear(inter, hidden, bias=False))
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self._names)
        return down(self.act(gate(x)) * up(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h)). `attn_name` is the
    token mixer's checkpoint name (`self_attn`; Qwen3-Next's linear layers say `linear_attn`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        attn: nn.Module,
        mlp: nn.Module,
        mlp_name: str = "mlp",
        attn_name: str = "self_attn",
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_name = attn_name
        setattr(self, attn_name, attn)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.attn_name)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = x + self.mixer(self.input_layernorm(x), ctx)
        return h + getattr(self, self.mlp_name)(self.post_attention_layernorm(h), ctx)


class CausalLM(nn.Module):
    """embed -> decoder layers -> norm -> lm_head. Families supply `make_layer(i)`.

    Class attributes a family may set:
      checkpoint_aliases: (regex, replacement) pairs tried on checkpoint names that match no
        parameter (e.g. transformers' in-memory names of another layout).
      expert_weight_names: a routed expert's gate/up/down names in checkpoints.
    """

    checkpoint_aliases: list[tuple[str, str]] = []
    # How checkpoints name one routed expert's gate, up and down projections.
    expert_weight_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    sliding_window: int | None = None  # attention window of every layer, None = full causal
    routing_stats = None  # the RoutingStats being recorded (attach_routing_stats), if any

    def __init__(self, cfg: ModelConfig, make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(make_layer(i) for i in range(cfg.num_layers))
        for i, layer in enumerate(self.model.layers):
            for module in layer.modules():
                if isinstance(module, FusedExperts):
                    module.layer_index = i
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # A runner may set fused_step(model, x, ctx) -> bool: it either advances the embeddings
        # x through every decoder layer in place (True) or declines (False, x untouched).
        # ModelRunner sets model/fused_decode.py's.
        self.fused_step: Callable[[CausalLM, torch.Tensor, ForwardContext], bool] | None = None

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] (all sequences concatenated) -> final hidden states [T, H]."""
        x = self.model.embed_tokens(input_ids)
        step = self.fused_step
        if step is not None and ctx.meta.decode is not None and step(self, x, ctx):
            return self.model.norm(x)  # e.g. CPU-only decode: every layer in one native call
        pending = None
        for layer in self.model.layers:
            x = layer(x, ctx)
            if pending is not None:  # layer L's deferred experts land after layer L+1
                x = x + pending.result()
            pending, ctx.deferred = ctx.deferred, None
        assert pending is None, "the last MoE layer must not defer"
        return self.model.norm(x)

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        start: int,
        stop: int,
        x: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decoder layers [start, stop) of a prompt chunk (a layer slice: the same numbers as
        `forward`, over several calls): `x` is what layer `start - 1` returned (None at 0:
        the embeddings); the final norm follows the last layer."""
        layers = self.model.layers
        if x is None:
            assert start == 0, "a slice after the first layer continues from its hidden states"
            x = self.model.embed_tokens(input_ids)
        for layer in layers[start:stop]:
            x = layer(x, ctx)
            assert ctx.deferred is None, "prefill never defers experts"
        return self.model.norm(x) if stop == len(layers) else x

    def map_checkpoint_tensor(self, name: str, value):
        """Family hook: a checkpoint weight's name and value in this model's layout. `value` is
        a tensor, a QMatrix (quant/packed.py), or None when the loader asks only for the name."""
        return name, value

    def published_name(self, name: str) -> str:
        """The name a published checkpoint gives parameter `name` (the inverse of
        `map_checkpoint_tensor`'s renaming; tiny checkpoints are written with it)."""
        return name

    def published_value(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """Parameter `name`'s value as a checkpoint stores it: the inverse of what
        `map_checkpoint_tensor` does to a dense non-expert value (`hetserve convert` writes the
        rest of a model with it, so loading the output maps it back to the same numbers)."""
        return value

    def moe_layers(self) -> list[SparseMoE]:
        return [m for m in self.modules() if isinstance(m, SparseMoE)]

    def attach_routing_stats(self, stats) -> None:
        """Record every routing decision into `stats` (a RoutingStats), or stop with None."""
        self.routing_stats = stats
        for _, experts in self.routed_experts():
            experts.routing_stats = stats

    def set_expert_deferral(self, num_deferred: int) -> int:
        """Defer the `num_deferred` lowest-weighted experts of each decode token in every MoE
        layer but the last (whose output nothing follows); clamped so each token keeps two
        on-time experts per layer (logged). 0 restores exact computation. Returns the d applied."""
        layers = self.moe_layers()
        applied = [moe.set_deferral(num_deferred if i < len(layers) - 1 else 0)
                   for i, moe in enumerate(layers)]  # fmt: skip
        effective = max(applied[:-1], default=0)
        if effective < num_deferred and len(layers) > 1:
            top_k = layers[0].gate.cfg.top_k
            _log.warning(
                "expert deferral %d clamped to %d: a token keeps at least 2 non-deferred "
                "experts per layer (top_k=%d, so at most top_k - 2)",
                num_deferred, effective, top_k,
            )  # fmt: skip
        return effective

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def cache_specs(self) -> list[LayerCacheSpec]:
        """What every layer keeps between forwards (kv/cache_spec.py)."""
        return [layer.mixer.cache_spec() for layer in self.model.layers]

    def kv_cache_spec(self) -> KVCacheSpec:
        """The paged part of `cache_specs` (a layer with only a state has no entries)."""
        return paged_layout(self.cache_specs())

    def routed_experts(self) -> Iterator[tuple[str, FusedExperts]]:
        for name, module in self.named_modules():
            if isinstance(module, FusedExperts):
                yield name, module

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight
