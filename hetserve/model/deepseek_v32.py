"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`): DeepSeek-V3 with DeepSeek Sparse Attention.

Each MLA layer has a lightning indexer: a light query per token (`wq_b` of the query latent,
`index_n_heads` heads of `index_head_dim`), one key per token (`wk`, LayerNorm), both rotated on
their first `qk_rope_head_dim` channels (halves layout, unlike MLA's interleaved pairs). A query
scores every earlier token as sum_h w_h * relu(q_h . k * d^-1/2), w = weights_proj(x) *
n_heads^-1/2, and attends only to its `index_topk` best (all of them while it has fewer).

The cache keeps, per token and layer, the MLA row and the indexer key (`LayerKind.MLA_INDEXED`,
two paged entries). A decode step scores the context's indexer keys (cheap: one
index_head_dim vector per token) and then gathers, expands and attends over the selected
top-k rows only, so its attention cost follows k, not the context. Prefill chunks attend with a
mask (causal and selected): exactly the reference's dense computation for the same selection.
"""

from __future__ import annotations

import torch
from torch import nn

from hetserve import envs
from hetserve.kv.cache_spec import LayerKind, PagedLayerSpec
from hetserve.layers.attention import ForwardContext, batched_decode_sdpa, causal_mask, sdpa
from hetserve.layers.rotary import PartialRotaryEmbedding
from hetserve.model.config import ModelConfig
from hetserve.model.deepseek import MLAttention, _DeepseekFamily
from hetserve.native import optional_kernel


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, q_lora_rank: int, rotary) -> None:
        super().__init__()
        self.n_heads = int(cfg.require("index_n_heads"))
        self.head_dim = int(cfg.require("index_head_dim"))
        self.topk = int(cfg.require("index_topk"))
        self.wq_b = nn.Linear(q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.rotary = [rotary]  # shared by the layers: not a submodule

    def keys(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """[T, head_dim] keys of this forward's tokens (what the cache keeps)."""
        k = self.k_norm(self.wk(x)).unsqueeze(1)
        return self.rotary[0](k, pos).squeeze(1)

    def queries(
        self, q_latent: torch.Tensor, x: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [T, heads, head_dim] (fp32) and head weights [T, heads] (fp32)."""
        q = self.wq_b(q_latent).view(x.shape[0], self.n_heads, self.head_dim)
        q = self.rotary[0](q, pos).float() * self.head_dim**-0.5
        # transformers keeps this projection in fp32; a quantized one (all-int8) has no
        # `weight` and takes the activations as they come.
        wdt = getattr(self.weights_proj, "weight", x).dtype
        w = self.weights_proj(x.float() if x.dtype != wdt else x)
        return q, w.float() * self.n_heads**-0.5

    @staticmethod
    def scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [..., Tq, H, D], w [..., Tq, H], keys [..., L, D] -> [..., Tq, L]."""
        s = torch.relu(torch.einsum("...qhd,...ld->...qhl", q, keys.float()))
        return torch.einsum("...qh,...qhl->...ql", w, s)


class IndexedMLAttention(MLAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary, bias: bool, index_rope) -> None:
        super().__init__(cfg, layer_idx, rotary, bias)
        self.indexer = Indexer(cfg, int(cfg.require("q_lora_rank")), index_rope)

    def kv_spec(self) -> list[tuple[int, ...]]:
        return [(self.kv_lora_rank + self.rope_dim,), (self.indexer.head_dim,)]

    def cache_spec(self) -> PagedLayerSpec:
        return PagedLayerSpec(LayerKind.MLA_INDEXED, tuple(self.kv_spec()))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, pos = x.shape[0], ctx.meta.positions
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(t, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent)
        rope = self.rotary[0]
        q = torch.cat((q_nope, rope(q_pe, pos)), dim=-1)
        k_pe = rope(k_pe.unsqueeze(1), pos).squeeze(1)
        row = torch.cat((latent, k_pe), dim=-1)
        ctx.kv.write(self.layer_idx, ctx.meta.slot_mapping, row, self.indexer.keys(x, pos))
        iq, iw = self.indexer.queries(q_latent, x, pos)
        out = x.new_empty(t, self.num_heads, self.v_dim)
        if ctx.meta.decode is not None:
            d = ctx.meta.decode
            out[d.rows] = self._decode(q[d.rows], iq[d.rows], iw[d.rows], ctx)
        for j, s in enumerate(ctx.meta.seqs):
            rows, keys = ctx.kv.gather(self.layer_idx, s.kv_slots, x.dtype)
            sl = slice(s.q_start, s.q_start + s.q_len)
            mask = causal_mask(s.q_len, s.kv_len, None, x.device)
            if mask is None:  # plain causal (a whole prefill, or one token)
                mask = torch.ones(s.q_len, s.kv_len, dtype=torch.bool, device=x.device).tril(
                    s.kv_len - s.q_len
                )
            mask = mask & self._selected(self.indexer.scores(iq[sl], iw[sl], keys), mask)
            k, v = self._expand(rows, lambda lora, j=j, n=rows.shape[0]: lora.span_segments(j, n))
            out[sl] = sdpa(q[sl], k, v, mask, self.scale)
        return self.o_proj(out.reshape(t, -1))

    def _selected(self, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[..., Tq, L] bool: the top-k keys of each query among its valid ones (all of them
        while it has no more than k)."""
        n = scores.shape[-1]
        if n <= self.indexer.topk:
            return torch.ones_like(valid)
        top = scores.masked_fill(~valid, float("-inf")).topk(self.indexer.topk, dim=-1).indices
        return torch.zeros_like(valid).scatter_(-1, top, True)

    def _native_scores(self, iq: torch.Tensor, iw: torch.Tensor, ctx, n: int):
        """The indexer's scores [B, n] of the decode rows over their contexts (-inf past each
        length) on the native kernel, reading the paged keys in place; None where it does not
        apply (not CPU fp32, a window, sizes off its vectors, native kernels off)."""
        d, layer = ctx.meta.decode, self.layer_idx
        cache = ctx.kv.layers[layer][1]
        half = {torch.float32: 0, torch.float16: 1, torch.int8: 2}.get(cache.dtype)
        fn = optional_kernel("hetserve_index_scores")
        h, dim = iq.shape[1], iq.shape[2]
        if (fn is None or half is None or not envs.native_kernels() or not iq.is_cpu
                or iq.dtype != torch.float32 or d.sliding_window is not None
                or h % 8 or dim % 8):  # fmt: skip
            return None
        q, w = iq.contiguous(), iw.contiguous()
        tables, lens = d.tables.contiguous(), d.lens.contiguous()
        out = torch.empty(q.shape[0], n, dtype=torch.float32)
        scales = ctx.kv.scales[layer][1].data_ptr() if half == 2 else None
        rc = fn(
            *(torch.get_num_threads(), q.shape[0], h, dim, d.block_size, tables.shape[1], n),
            *(ctx.kv.num_blocks, half, q.data_ptr(), w.data_ptr(), cache.data_ptr(), scales),
            *(tables.data_ptr(), lens.data_ptr(), out.data_ptr()),
        )
        if rc != 0:
            raise RuntimeError(f"native indexer scores failed (code {rc})")
        return out

    def _decode(self, q: torch.Tensor, iq: torch.Tensor, iw: torch.Tensor, ctx) -> torch.Tensor:
        """One token per sequence: score the context's indexer keys, then gather the top-k rows
        and attend over them alone, in the latent space where kv_b_proj can be absorbed (else
        expanded as prefill does)."""
        d = ctx.meta.decode
        bs = d.block_size
        b, n = d.tables.shape[0], d.tables.shape[1] * bs
        scores = self._native_scores(iq, iw, ctx, n)
        if scores is None:
            # widened to q's dtype where the cache is narrower (--kv-cache-dtype)
            keys = ctx.kv.rows(self.layer_idx, 1, d.slots.flatten(), q.dtype).view(b, n, -1)
            scores = self.indexer.scores(iq.unsqueeze(1), iw.unsqueeze(1), keys).squeeze(1)
            scores = scores.masked_fill(~d.mask.view(b, n), float("-inf"))
        k = min(self.indexer.topk, n)
        best, top = scores.topk(k, dim=-1)  # [b, k]
        valid = best > float("-inf")  # a context shorter than k picks padding too
        slots = d.tables.gather(1, top // bs) * bs + top % bs
        picked = ctx.kv.rows(self.layer_idx, 0, slots.flatten(), q.dtype)
        forms = self._absorbed(q)
        if forms is not None:  # attend in the latent space (MLAttention._absorbed_decode)
            q_all = self._absorb_query(q, forms)
            o_lat = self._latent_attention(q_all, picked.view(b, k, -1), valid)
            return forms.output(o_lat)
        keys_k, values = self._expand(picked, lambda lora: lora.decode_segments(k))
        mask = valid[:, None, None, :]
        return batched_decode_sdpa(
            q, keys_k.view(b, k, *keys_k.shape[1:]), values.view(b, k, *values.shape[1:]),
            mask, self.scale,
        )  # fmt: skip


class DeepseekV32ForCausalLM(_DeepseekFamily):
    v3 = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        # A submodule, so the loader builds its cos/sin tables (the model starts on "meta").
        self.index_rotary = self.model.layers[0].self_attn.indexer.rotary[0]

    def _make_attention(self, cfg: ModelConfig, i: int, rotary, bias: bool, shared: dict):
        if "index_rope" not in shared:  # one cos/sin table for every layer's indexer
            shared["index_rope"] = PartialRotaryEmbedding(
                rotary.dim, cfg.max_position_embeddings, cfg.rope
            )
        return IndexedMLAttention(cfg, i, rotary, bias, shared["index_rope"])
