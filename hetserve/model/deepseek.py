"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and fine-grained MoE.

MLA's cache holds one row per token: the normalised compressed latent (kv_lora_rank) plus the
rotated shared rope key (qk_rope_head_dim), not per-head K/V. A prefill expands keys and values
from the latent with kv_b_proj; a decode batch attends in the latent space instead (kv_b_proj's
key half folded into the query, its value half applied to the attended latent: DeepSeek-V2's
weight absorption), so each cached row is read once and nothing per key is expanded: under the
all-int8 rules on a CPU, expanding a 4k context costs 4k x 512 x heads x 256 multiply-adds per
layer and token. An int8 (or GGUF) kv_b_proj is absorbed through its dequantized matrix, read
off the kernel once (the layer applied to the identity) and kept beside it in the activations'
dtype (heads x 256 x 512 numbers a layer: 67 MB in fp32 at DeepSeek-V3's 128 heads). Where
kv_b_proj carries LoRA slots decode expands as prefill does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from hetserve import envs
from hetserve.kv.cache_spec import LayerKind, PagedLayerSpec
from hetserve.layers.attention import ForwardContext, batched_decode_sdpa, sdpa
from hetserve.layers.lora import LoRABatch, LoRALinear, Segments, lora_project
from hetserve.layers.moe import SparseMoE
from hetserve.layers.native_decode import native_decode_attention, native_decode_ok
from hetserve.layers.native_prefill import native_dense_attention
from hetserve.layers.norm import RMSNorm
from hetserve.layers.rotary import yarn_softmax_scale
from hetserve.model.base import CausalLM, DecoderLayer, DenseMLP
from hetserve.model.config import ModelConfig
from hetserve.model.llama import make_rotary
from hetserve.moe.router import RouterConfig
from hetserve.native import optional_kernel


class MLAttention(nn.Module):
    # kept beside its int8 form once decode has absorbed it (memory_facts counts it)
    absorbed_projections = ("kv_b_proj",)

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary, bias: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.q_lora_rank = cfg.get("q_lora_rank")
        self.kv_lora_rank = int(cfg.require("kv_lora_rank"))
        self.nope_dim = int(cfg.require("qk_nope_head_dim"))
        self.rope_dim = int(cfg.require("qk_rope_head_dim"))
        self.v_dim = int(cfg.require("v_head_dim"))
        qk_dim = self.nope_dim + self.rope_dim
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=bias)
        self.rotary = [rotary]
        self.scale = yarn_softmax_scale(cfg.rope, qk_dim**-0.5)

    def kv_spec(self) -> list[tuple[int, ...]]:
        return [(self.kv_lora_rank + self.rope_dim,)]

    def cache_spec(self) -> PagedLayerSpec:
        return PagedLayerSpec(LayerKind.MLA, tuple(self.kv_spec()))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent)
        rope, pos = self.rotary[0], ctx.meta.positions
        if rope is not None:  # (Kimi-Linear's MLA has no rotary: its shared key stays as is)
            q_pe, k_pe = rope(q_pe, pos), rope(k_pe.unsqueeze(1), pos).squeeze(1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        ctx.kv.write(self.layer_idx, ctx.meta.slot_mapping, torch.cat((latent, k_pe), dim=-1))

        out = x.new_empty(t, self.num_heads, self.v_dim)
        d = ctx.meta.decode
        if d is not None:
            forms = self._absorbed(x)
            if forms is not None:
                out[d.rows] = self._absorbed_decode(q[d.rows], d, ctx, forms)
            else:
                b, n = d.slots.shape
                (rows,) = ctx.kv.gather(self.layer_idx, d.slots.flatten(), x.dtype)
                k, v = self._expand(rows, lambda lora: lora.decode_segments(n))
                out[d.rows] = batched_decode_sdpa(
                    q[d.rows],
                    k.view(b, n, *k.shape[1:]),
                    v.view(b, n, *v.shape[1:]),
                    d.mask,
                    self.scale,
                )
        for j, s in enumerate(ctx.meta.seqs):
            (rows,) = ctx.kv.gather(self.layer_idx, s.kv_slots, x.dtype)
            k, v = self._expand(rows, lambda lora, j=j, n=rows.shape[0]: lora.span_segments(j, n))
            sl = slice(s.q_start, s.q_start + s.q_len)
            native = native_dense_attention(q[sl], k, v, self.scale, s.window, ctx.kv.bf16_prefill)
            out[sl] = sdpa(q[sl], k, v, s.mask, self.scale) if native is None else native
        return self.o_proj(out.reshape(t, -1))

    def nbytes(self) -> int:
        """Bytes of the absorbed kv_b_proj kept beside an int8 one (0 until the first decode)."""
        cached = self.__dict__.get("_absorbed_cache")
        return 0 if cached is None else cached.nbytes()

    def _absorbed(self, like: torch.Tensor) -> _Absorbed | None:
        """kv_b_proj's per-head halves for decode with activations like `like`, or None where
        decode must expand (LoRA slots, a bias, a float weight of another dtype). A float
        kv_b_proj is used as it is; another one (int8, GGUF) is read off its kernel once (the
        layer applied to the identity) and kept: as fp16 matrices for the native per-head
        products on the CPU in fp32, else in the activations' dtype."""
        lin = self.kv_b_proj
        if type(lin) is nn.Linear:
            return _Absorbed(self, lin.weight) if lin.weight.dtype == like.dtype else None
        if isinstance(lin, LoRALinear) or getattr(lin, "bias", None) is not None:
            return None
        cached = self.__dict__.get("_absorbed_cache")
        if cached is None or not cached.serves(like):
            eye = torch.eye(self.kv_lora_rank, dtype=like.dtype, device=like.device)
            with torch.no_grad():
                w = lin(eye).t().contiguous()  # [H * (nope + v), rank]
            half = like.is_cpu and like.dtype == torch.float32 and _heads_kernel() is not None
            cached = _Absorbed(self, w, half)
            self.__dict__["_absorbed_cache"] = cached  # not a parameter: derived, never saved
        return cached

    def _absorbed_decode(
        self, q: torch.Tensor, d, ctx: ForwardContext, forms: _Absorbed
    ) -> torch.Tensor:
        """q [B, H, nope + rope] of the decode rows -> [B, H, v]. Scores q_nope . (W_uk latent)
        + q_pe . k_pe are (q_nope W_uk) . latent + q_pe . k_pe, and the output sum_l p_l W_uv
        latent_l is W_uv (sum_l p_l latent_l): attention with one key head of rank + rope
        dims whose values are its first rank dims. On the CPU in fp32 that is the native decode
        kernel over the paged rows in place (values = whole rows, the rope columns dropped
        after); elsewhere gathered rows and two batched products, softmax in fp32."""
        q_all = self._absorb_query(q, forms)
        entries, scales = ctx.kv.layers[self.layer_idx], ctx.kv.scales[self.layer_idx]
        if native_decode_ok(q_all, entries):
            rows = entries[0].view(entries[0].shape[0], 1, -1)  # one key head per slot
            both = [scales[0], scales[0]] if scales else None
            o_lat = native_decode_attention(
                q_all, rows, rows, d, ctx.kv, self.scale, d.sliding_window, None, both
            )[..., : self.kv_lora_rank]
        else:
            b, n = d.slots.shape
            (rows,) = ctx.kv.gather(self.layer_idx, d.slots.flatten(), q.dtype)
            o_lat = self._latent_attention(q_all, rows.view(b, n, -1), d.mask.view(b, n))
        return forms.output(o_lat)

    def _absorb_query(self, q: torch.Tensor, forms: _Absorbed) -> torch.Tensor:
        """q [B, H, nope + rope] -> (q_nope W_uk | q_pe) [B, H, rank + rope]."""
        q_lat = forms.query(q[..., : self.nope_dim])
        return torch.cat((q_lat, q[..., self.nope_dim :]), dim=-1)

    def _latent_attention(
        self, q_all: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """q_all [B, H, rank + rope] over rows [B, L, rank + rope] where valid [B, L] ->
        the attended latent [B, H, rank] (softmax in fp32)."""
        scores = torch.bmm(q_all, rows.transpose(1, 2)).float() * self.scale  # [B, H, L]
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        p = torch.softmax(scores, dim=-1).to(rows.dtype)
        return torch.bmm(p, rows[..., : self.kv_lora_rank])

    def _expand(
        self, rows: torch.Tensor, lora_segments: Callable[[LoRABatch], Segments]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached rows [L, r + rope] -> per-head keys [L, H, nope + rope] and values [L, H, v].
        `lora_segments` says which rows belong to which LoRA adapter (they are not this
        forward's tokens)."""
        n = rows.shape[0]
        latent, k_pe = rows.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = lora_project(self.kv_b_proj, latent, lora_segments)
        kv = kv.view(n, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_pe = k_pe.unsqueeze(1).expand(n, self.num_heads, self.rope_dim)
        return torch.cat((k_nope, k_pe), dim=-1), v


@functools.cache
def _heads_kernel():
    return optional_kernel("hetserve_heads_gemv_f16")


class _Absorbed:
    """kv_b_proj's halves as decode uses them: q_nope -> q_nope W_uk (per head, [nope] ->
    [rank]) and the attended latent -> W_uv latent ([rank] -> [v]). Either views of a float
    matrix [H * (nope + v), rank] (bmm), or, with `half`, fp16 copies laid out for the native
    per-head products (W_uk transposed [H, rank, nope], W_uv [H, v, rank]): half the bytes
    of fp32 and both cores on them; fp16 keeps 11 bits, finer than the int8 rows they come from."""

    def __init__(self, attn: MLAttention, w: torch.Tensor, half: bool = False) -> None:
        h, nope, v = attn.num_heads, attn.nope_dim, attn.v_dim
        heads = w.view(h, nope + v, attn.kv_lora_rank)
        self.half, self.dtype, self.device = half, w.dtype, w.device
        if half:
            self.uk_t = heads[:, :nope].transpose(1, 2).to(torch.float16).contiguous()
            self.uv = heads[:, nope:].to(torch.float16).contiguous()
        else:
            self.uk, self.uv = heads[:, :nope], heads[:, nope:]

    def serves(self, like: torch.Tensor) -> bool:
        return self.dtype == like.dtype and self.device == like.device

    def nbytes(self) -> int:
        parts = (self.uk_t, self.uv) if self.half else (self.uk, self.uv)
        return sum(t.numel() * t.element_size() for t in parts)

    def _native(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out[b, h] = w[h] @ x[b, h] on the kernel (fp16 w [H, N, K], fp32 x [B, H, K])."""
        x = x.contiguous()
        b, h, k = x.shape
        out = torch.empty(b, h, w.shape[1], dtype=torch.float32)
        _heads_kernel()(torch.get_num_threads(), b, h, w.shape[1], k,
                        w.data_ptr(), x.data_ptr(), out.data_ptr())  # fmt: skip
        return out

    def query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[B, H, nope] -> [B, H, rank]."""
        if self.half:
            if envs.native_kernels():
                return self._native(self.uk_t, q_nope)
            return torch.bmm(q_nope.transpose(0, 1), self.uk_t.float().transpose(1, 2)).transpose(
                0, 1
            )
        return torch.bmm(q_nope.transpose(0, 1), self.uk).transpose(0, 1)

    def output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """[B, H, rank] -> [B, H, v]."""
        if self.half:
            if envs.native_kernels():
                return self._native(self.uv, o_lat)
            return torch.bmm(o_lat.transpose(0, 1), self.uv.float().transpose(1, 2)).transpose(0, 1)
        return torch.bmm(o_lat.transpose(0, 1), self.uv.transpose(1, 2)).transpose(0, 1)


def deepseek_mlp_maker(
    cfg: ModelConfig, router: RouterConfig, shared: int, first_dense: int
) -> Callable[[int], nn.Module]:
    """Layer index -> its MLP, in DeepSeek's layout (GLM-4.5 keeps it): the first
    `first_k_dense_replace` layers dense, the others routed experts plus `n_shared_experts`
    shared ones as one dense MLP n times as wide. `shared` and `first_dense` are the defaults
    for a config that leaves those keys out (they differ between the families)."""
    moe_inter = int(cfg.require("moe_intermediate_size"))
    n_shared = int(cfg.get("n_shared_experts", default=shared))
    n_dense = int(cfg.get("first_k_dense_replace", default=first_dense))

    def make_mlp(i: int) -> nn.Module:
        if i < n_dense:
            return DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        shared_mlp = None
        if n_shared:
            shared_mlp = DenseMLP(cfg.hidden_size, moe_inter * n_shared, cfg.hidden_act)
        return SparseMoE(cfg.hidden_size, router, moe_inter, cfg.hidden_act, shared=shared_mlp)

    return make_mlp


class _DeepseekFamily(CausalLM):
    v3 = False

    def __init__(self, cfg: ModelConfig) -> None:
        rope_dim = int(cfg.require("qk_rope_head_dim"))
        rotary = make_rotary(
            cfg, rope_dim, interleaved=bool(cfg.get("rope_interleave", default=True))
        )
        bias = bool(cfg.get("attention_bias", default=False))
        make_mlp = deepseek_mlp_maker(cfg, self._router_config(cfg), shared=0, first_dense=0)
        shared: dict = {}  # what a family's attention layers share (V3.2: the indexer's rotary)

        def make_layer(i: int) -> nn.Module:
            attn = self._make_attention(cfg, i, rotary, bias, shared)
            return DecoderLayer(cfg, attn, make_mlp(i))

        super().__init__(cfg, make_layer)
        self.rotary = rotary

    def _make_attention(self, cfg: ModelConfig, i: int, rotary, bias: bool, shared: dict):
        return MLAttention(cfg, i, rotary, bias)

    def _router_config(self, cfg: ModelConfig) -> RouterConfig:
        method = cfg.get("topk_method", default="noaux_tc" if self.v3 else "greedy")
        grouped = method in ("group_limited_greedy", "noaux_tc")
        return RouterConfig(
            num_experts=int(cfg.require("n_routed_experts", "num_local_experts")),
            top_k=int(cfg.require("num_experts_per_tok")),
            scoring=cfg.get("scoring_func", default="sigmoid" if self.v3 else "softmax"),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", default=self.v3)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", default=1.0)),
            n_group=cfg.get("n_group") if grouped else None,
            topk_group=cfg.get("topk_group") if grouped else None,
            group_score="top2sum" if method == "noaux_tc" else "max",
            use_correction_bias=self.v3,
            # DeepSeek-V2's rule: renormalised weights are not scaled again.
            scale_only_if_not_normed=not self.v3,
        )


class DeepseekV2ForCausalLM(_DeepseekFamily):
    v3 = False


class DeepseekV3ForCausalLM(_DeepseekFamily):
    v3 = True
