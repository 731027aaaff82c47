"""Fused decode: every decoder layer of a CPU-only decode step in one native call.

Who calls it: `CausalLM.forward`, through its `fused_step` hook (which `ModelRunner` sets to
`run`), on a decode step, with the embeddings of the step's tokens; also on a step whose
decodes carry small prompt chunks (`FUSED_CHUNK_TOKENS`), each chunk token a row of decode
attention over its own context (within fp32 rounding of the prefill kernels' result, not the
same bits). `run(model, x, ctx)`
either advances `x` in place through all decoder layers and returns True, or returns False
having touched nothing; the caller then runs the modules, which compute the same thing (the C
side is the module path's own kernels chained: hetserve/native/decode_layers.c).

What it covers: `DecoderLayer`s of `GQAAttention` (q/k/v fused, or three where a GGUF file
gives them different types, and o, as native `Int8Linear`s; optional q/k RMSNorm and biases,
full rotary, no sliding window or sinks) followed by a
`SparseMoE` (softmax top-k router without group or correction bias, no shared experts, routed
experts on a native CPU backend) or a SwiGLU `DenseMLP` of native `Int8Linear`s: what CPU-only
serving of a GGUF or an int8-placed model runs. Anything else in any layer (LoRA wrappers, GPU
linears, expert deferral, routing statistics, MLA, windows, autograd) makes `run` return False.

Why: at one token per sequence the Python between a layer's kernels (norms, the q/k/v split,
rotary, cache write, attention, residual adds, router, the experts' wrapper) costs ~0.15 ms per
layer on a 2-core CPU, a quarter of the step; llama.cpp runs its graph without it.

Failure: a position or KV slot out of range raises RuntimeError, as the module path does; out
of memory raises MemoryError. The plan (the layers' constants as a C array) is built on the
first eligible step and rebuilt when the model's modules, expert backends or KV cache change.
"""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int, c_long, c_void_p
from dataclasses import dataclass

import torch
from torch import nn

from hetserve import envs
from hetserve.moe.router import NATIVE_LOGITS_MAX_TOKENS
from hetserve.native import optional_kernel

FFN_EXPERTS, FFN_DENSE = 1, 2
# A step beside decodes carries prompt chunks of at most this many tokens (all its chunks
# together) as rows of the fused step: each chunk token is one more row of decode attention
# over its own context, so it runs as the decodes run instead of the layers one by one, whose
# Python and per-kernel calls cost a 3-token chunk beside three decodes of the 1.7 B MoE ~7 ms
# of a 34 ms step (a six-token decode step: ~27 ms). Larger chunks take the prefill kernels
# (GEMM tiles, blocked causal attention), which read each context once.
FUSED_CHUNK_TOKENS = 16


class _QLin(ctypes.Structure):
    _fields_ = [
        ("fmt", c_int), ("group", c_int), ("n", c_int), ("k", c_int),
        ("w", c_void_p), ("s", c_void_p), ("bias", c_void_p),
    ]  # fmt: skip


class _Layer(ctypes.Structure):
    """hs_layer_t of decode_layers.c, field for field."""

    _fields_ = [
        ("hidden", c_int), ("nq", c_int), ("nkv", c_int), ("head_dim", c_int),
        ("interleaved", c_int), ("max_pos", c_int), ("block_size", c_int), ("num_blocks", c_int),
        ("num_slots", c_long),
        ("eps", c_float), ("qk_eps", c_float), ("scale", c_float),
        ("in_norm", c_void_p), ("post_norm", c_void_p), ("q_norm", c_void_p),
        ("k_norm", c_void_p), ("cos", c_void_p), ("sin", c_void_p),
        ("k_cache", c_void_p), ("v_cache", c_void_p),
        ("qkv", _QLin), ("o", _QLin),
        ("ffn", c_int),
        ("num_experts", c_int), ("top_k", c_int), ("renorm", c_int), ("efmt", c_int),
        ("einter", c_int), ("egroup", c_int), ("eact", c_int), ("ethreads", c_int),
        ("route_scale", c_float), ("ealpha", c_float), ("elimit", c_float),
        ("router", c_void_p),
        ("w13", c_void_p), ("s13", c_void_p), ("w2", c_void_p), ("s2", c_void_p),
        ("b13", c_void_p), ("b2", c_void_p),
        ("gate", _QLin), ("up", _QLin), ("down", _QLin),
        ("kv_half", c_int), ("k_scale", c_void_p), ("v_scale", c_void_p),
        ("split", c_int), ("k_lin", _QLin), ("v_lin", _QLin),
    ]  # fmt: skip


@dataclass
class _Plan:
    key: tuple  # what the plan was built from (see _key)
    layers: ctypes.Array | None  # None: the model is not eligible (until the key changes)
    keep: list  # tensors whose memory the C array points into


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _fp32_cpu(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype is torch.float32 and t.is_cpu and t.is_contiguous()


def _qlin(m: nn.Module | None, keep: list) -> _QLin | None:
    from hetserve.layers.int8_linear import Int8Linear

    if type(m) is not Int8Linear or m.kernel != "native":
        return None
    bias = m._bias
    if bias is not None and not _fp32_cpu(bias):
        return None
    keep += [m._q, m._scale, bias]
    return _QLin(m.kernel_fmt(), m.group, m.out_features, m.in_features, _ptr(m._q),
                 _ptr(m._scale), _ptr(bias))  # fmt: skip


def _decode_backend(experts: nn.Module):
    phases = experts._phase_backends
    return phases["decode"] if phases is not None else experts._backend


def _key(model: nn.Module, kv) -> tuple:
    """Identities of everything a plan depends on; cheap enough to check every step."""
    parts: list = [kv, model.routing_stats]
    for layer in model.model.layers:
        mods = layer._modules
        attn = mods.get("self_attn")
        mlp = mods.get(getattr(layer, "mlp_name", "mlp"))
        parts += [layer, attn, mlp]
        if attn is not None:
            am = attn._modules
            parts += [am.get(n) for n in ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj")]
        if mlp is not None:
            experts = mlp._modules.get("experts")
            parts.append(getattr(mlp, "num_deferred", None))
            if experts is not None:
                parts += [experts._backend, experts._phase_backends]
    return tuple(parts)


def _attention(layer: nn.Module, i: int, kv, keep: list) -> _Layer | None:
    from hetserve.layers.native_decode import qk_rope_cache_fits
    from hetserve.layers.norm import RMSNorm
    from hetserve.model.base import DecoderLayer
    from hetserve.model.llama import GQAAttention

    if type(layer) is not DecoderLayer:
        return None
    attn, n1, n2 = layer.mixer, layer.input_layernorm, layer.post_attention_layernorm
    if type(attn) is not GQAAttention or attn.window is not None or attn.sinks is not None:
        return None
    if attn.layer_idx != i or type(n1) is not RMSNorm or type(n2) is not RMSNorm:
        return None
    if n1.eps != n2.eps or not (_fp32_cpu(n1.weight) and _fp32_cpu(n2.weight)):
        return None
    entries = kv.layers[i]
    if len(entries) != 2:
        return None
    k_cache, v_cache = entries
    rope = attn.rotary[0]
    if not qk_rope_cache_fits(attn.q_norm, attn.k_norm, rope, k_cache, v_cache):
        return None
    if not (_fp32_cpu(rope.cos) and _fp32_cpu(rope.sin)):
        return None
    d, nq, nkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    o = _qlin(attn.o_proj, keep)
    split = attn.qkv_proj is None  # q, k, v apart (a GGUF file's of different types)
    if split:
        qkv, kp, vp = (_qlin(m, keep) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        if kp is None or vp is None or (kp.n, vp.n) != (nkv * d, nkv * d):
            return None
        if qkv is None or qkv.n != nq * d or kp.k != qkv.k or vp.k != qkv.k:
            return None
    else:
        qkv, kp, vp = _qlin(attn.qkv_proj, keep), _QLin(), _QLin()
        if qkv is None or qkv.n != (nq + 2 * nkv) * d:
            return None
    if o is None or o.k != nq * d:
        return None
    if k_cache.shape[1:] != (nkv, d) or qkv.k != n1.weight.shape[0] or o.n != qkv.k:
        return None
    norms = attn.q_norm is not None
    scales = kv.scales[i]  # int8: K's and V's [slots, nkv]; else none
    keep += [n1.weight, n2.weight, rope.cos, rope.sin, k_cache, v_cache, *scales]
    if norms:
        keep += [attn.q_norm.weight, attn.k_norm.weight]
    return _Layer(
        hidden=qkv.k, nq=nq, nkv=nkv, head_dim=d, interleaved=int(rope.interleaved),
        max_pos=rope.cos.shape[0], block_size=kv.block_size, num_blocks=kv.num_blocks,
        num_slots=k_cache.shape[0], eps=n1.eps, qk_eps=attn.q_norm.eps if norms else 0.0,
        scale=attn.scale, in_norm=_ptr(n1.weight), post_norm=_ptr(n2.weight),
        q_norm=_ptr(attn.q_norm.weight) if norms else None,
        k_norm=_ptr(attn.k_norm.weight) if norms else None,
        cos=_ptr(rope.cos), sin=_ptr(rope.sin), k_cache=_ptr(k_cache), v_cache=_ptr(v_cache),
        qkv=qkv, o=o, kv_half={torch.float16: 1, torch.int8: 2}.get(k_cache.dtype, 0),
        k_scale=_ptr(scales[0]) if scales else None, v_scale=_ptr(scales[1]) if scales else None,
        split=int(split), k_lin=kp, v_lin=vp,
    )  # fmt: skip


def _experts(mlp: nn.Module, out: _Layer, keep: list) -> bool:
    from hetserve.layers.moe import SparseMoE
    from hetserve.moe.cpu_native import _NativeExperts
    from hetserve.moe.router import TopKRouter

    if type(mlp) is not SparseMoE or mlp._shared_name is not None or mlp.num_deferred:
        return False
    gate, experts = mlp.gate, mlp.experts
    cfg = gate.cfg
    if type(gate) is not TopKRouter or cfg.scoring != "softmax" or (cfg.n_group or 1) > 1:
        return False
    if gate.bias is not None or gate.e_score_correction_bias is not None:
        return False
    if not _fp32_cpu(gate.weight) or experts.routing_stats is not None:
        return False
    b = _decode_backend(experts)
    if not isinstance(b, _NativeExperts) or b.hidden != out.hidden:
        return False
    if gate.weight.shape != (b.num_experts, out.hidden):
        return False
    renorm = cfg.norm_topk_prob and cfg.top_k > 1
    keep += [gate.weight, b]
    out.ffn, out.num_experts, out.top_k, out.renorm = FFN_EXPERTS, b.num_experts, cfg.top_k, renorm
    out.route_scale = 1.0 if renorm and cfg.scale_only_if_not_normed else cfg.routed_scaling_factor
    out.router = _ptr(gate.weight)
    out.efmt, out.einter, out.egroup = b.kernel_fmt(), b.inter, b.group_size
    out.ethreads = b._threads or 0
    out.eact, out.ealpha, out.elimit = b._act
    out.w13, out.s13, out.w2, out.s2 = b._ptrs
    out.b13, out.b2 = b._bias_ptrs
    return True


def _dense(mlp: nn.Module, out: _Layer, keep: list) -> bool:
    from hetserve.model.base import DenseMLP
    from hetserve.moe.experts import ACTIVATIONS

    if type(mlp) is not DenseMLP or mlp.act is not ACTIVATIONS["silu"]:
        return False
    gate, up, down = (_qlin(getattr(mlp, n), keep) for n in mlp._names)
    if gate is None or up is None or down is None:
        return False
    if gate.k != out.hidden or up.k != out.hidden or down.n != out.hidden:  # hidden size
        return False
    if up.n != gate.n or down.k != gate.n:  # intermediate size
        return False
    out.ffn, out.gate, out.up, out.down = FFN_DENSE, gate, up, down
    return True


def _build(model: nn.Module, kv, key: tuple) -> _Plan:
    keep: list = []
    layers = []
    for i, layer in enumerate(model.model.layers):
        fields = _attention(layer, i, kv, keep)
        mlp = getattr(layer, getattr(layer, "mlp_name", "mlp"), None)
        if fields is None or not (_experts(mlp, fields, keep) or _dense(mlp, fields, keep)):
            return _Plan(key, None, [])
        layers.append(fields)
    return _Plan(key, (_Layer * len(layers))(*layers), keep)


def _row_tables(meta, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [rows, W] and context lengths [rows] of every row of a step whose prompt
    chunks run as rows of decode attention: a decode's own, and for chunk token i of a
    sequence its sequence's table with the context up to and including itself (the layer
    writes every row's K/V before any row attends, so each sees the chunk's earlier tokens)."""
    d = meta.decode
    bs = d.block_size
    width = max([d.tables.shape[1]] + [-(-span.kv_len // bs) for span in meta.seqs])
    tables = torch.zeros(rows, width, dtype=torch.long)
    lens = torch.empty(rows, dtype=torch.long)
    tables[d.rows, : d.tables.shape[1]] = d.tables
    lens[d.rows] = d.lens
    for span in meta.seqs:
        nb = -(-span.kv_len // bs)
        rs = slice(span.q_start, span.q_start + span.q_len)
        tables[rs, :nb] = span.kv_slots[::bs][:nb] // bs
        lens[rs] = torch.arange(span.kv_len - span.q_len + 1, span.kv_len + 1)
    return tables, lens


def run(model: nn.Module, x: torch.Tensor, ctx) -> bool:
    """Advance the embeddings x [T, hidden] of a decode step (its prompt chunks, if any, no
    more than FUSED_CHUNK_TOKENS tokens) through every decoder layer in place and return True,
    or return False (x untouched) where the fused step does not apply."""
    meta = ctx.meta
    d = meta.decode
    if (
        d is None
        or sum(span.q_len for span in meta.seqs) > FUSED_CHUNK_TOKENS
        or x.shape[0] > NATIVE_LOGITS_MAX_TOKENS  # the router module's logits are torch's
        or meta.sliding_window is not None
        or x.dtype is not torch.float32
        or not x.is_cpu
        or x.requires_grad
        or not x.is_contiguous()
        or meta.positions.dtype is not torch.long
        or meta.slot_mapping.dtype is not torch.long
        or not envs.native_kernels()
        or ctx.states is not None  # linear-attention layers: not in the C plan
    ):
        return False
    fn = optional_kernel("hetserve_decode_layers")
    if fn is None:
        return False
    key = _key(model, ctx.kv)
    plan = model.__dict__.get("_fused_decode_plan")
    if plan is None or plan.key != key:
        plan = _build(model, ctx.kv, key)
        model.__dict__["_fused_decode_plan"] = plan
    if plan.layers is None:
        return False
    tables, lens = _row_tables(meta, x.shape[0]) if meta.seqs else (d.tables, d.lens)
    tables, lens = tables.contiguous(), lens.contiguous()
    rc = fn(
        torch.get_num_threads(), len(plan.layers), ctypes.addressof(plan.layers), x.shape[0],
        x.data_ptr(),
        meta.positions.data_ptr(), meta.slot_mapping.data_ptr(), tables.data_ptr(),
        tables.shape[1], lens.data_ptr(),
    )  # fmt: skip
    if rc == -4:
        raise RuntimeError("position or KV slot out of range in the attention layer")
    if rc == -1:
        raise MemoryError("fused decode step could not allocate its scratch buffers")
    if rc != 0:
        raise RuntimeError(f"fused decode step failed (code {rc})")
    return True
