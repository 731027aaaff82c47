"""Routers: hidden states -> (topk_weights, topk_ids). One class covers every family's rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hetserve import envs
from hetserve.native import optional_kernel

# Up to this many tokens (decode steps), CPU fp32 logits come from hetserve_router_logits: one
# C call (~2x faster than torch's GEMV at one token here), each dot product summed in a fixed
# order, which the fused decode step (model/fused_decode.py) also uses: the same bits.
NATIVE_LOGITS_MAX_TOKENS = 64


def native_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [T, H] . weight [E, H]^T in C, or None where it does not apply (GPU, not fp32,
    autograd, more than NATIVE_LOGITS_MAX_TOKENS tokens)."""
    t = x.shape[0]
    if (
        t > NATIVE_LOGITS_MAX_TOKENS
        or x.dim() != 2
        or x.dtype is not torch.float32
        or weight.dtype is not torch.float32
        or not (x.is_cpu and weight.is_cpu)
        or x.requires_grad
        or weight.requires_grad
        or not envs.native_kernels()
    ):
        return None
    fn = optional_kernel("hetserve_router_logits")
    if fn is None:
        return None
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty(t, weight.shape[0], dtype=torch.float32)
    fn(torch.get_num_threads(), t, weight.shape[0], weight.shape[1], x.data_ptr(),
       weight.data_ptr(), out.data_ptr())  # fmt: skip
    return out


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # Group-limited top-k (DeepSeek): pick `topk_group` of `n_group` groups first.
    n_group: int | None = None
    topk_group: int | None = None
    # How a group is scored: "max" (DeepSeek-V2 group_limited_greedy) or "top2sum" (V3 noaux_tc).
    group_score: str = "max"
    use_correction_bias: bool = False  # DeepSeek-V3 e_score_correction_bias (selection only)
    # Some families scale by routed_scaling_factor only when weights are not renormalised (V2).
    scale_only_if_not_normed: bool = False
    bias: bool = False  # a bias on the router's logits (gpt-oss)

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported scoring function {self.scoring!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.n_group is not None and self.n_group > 1:
            if self.num_experts % self.n_group:
                raise ValueError("num_experts must be divisible by n_group")
            if not self.topk_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError("topk_group must be in [1, n_group]")


class TopKRouter(nn.Module):
    """Gate projection plus selection; parameter names follow HF checkpoints."""

    def __init__(self, hidden_size: int, cfg: RouterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size))
        if cfg.use_correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.num_experts), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.bias else None

    def _apply(self, fn, recurse: bool = True):
        # The correction bias stays fp32 when the model is cast to bf16/fp16 (as transformers
        # keeps it): it is added to scores in [0, 1], and rounding values of a few units to
        # bf16 (steps of 1/64 at 2-4) would change which experts are chosen.
        super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias is not None and bias.dtype != torch.float32:
            bias.data = bias.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        # Routing decisions in fp32: ties and near-ties must not depend on the compute dtype.
        bias = None if self.bias is None else self.bias.float()
        logits = native_logits(x, self.weight) if bias is None else None
        if logits is None:
            logits = F.linear(x.float(), self.weight.float(), bias)
        if (
            cfg.scoring == "softmax"
            and (cfg.n_group is None or cfg.n_group <= 1)
            and self.e_score_correction_bias is None
            and logits.is_cpu
            and not logits.requires_grad
            and envs.native_kernels()
            and (fn := optional_kernel("hetserve_topk_softmax"))
        ):
            # One C call for softmax, top-k and renormalisation (six torch ops otherwise).
            logits = logits.contiguous()
            t = logits.shape[0]
            weights = torch.empty(t, cfg.top_k, dtype=torch.float32)
            ids = torch.empty(t, cfg.top_k, dtype=torch.long)
            renorm = cfg.norm_topk_prob and cfg.top_k > 1
            scale = 1.0 if renorm and cfg.scale_only_if_not_normed else cfg.routed_scaling_factor
            fn(torch.get_num_threads(), t, cfg.num_experts, cfg.top_k, int(renorm), scale,
               logits.data_ptr(), weights.data_ptr(), ids.data_ptr())  # fmt: skip
            return weights, ids
        if cfg.scoring == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if cfg.n_group is not None and cfg.n_group > 1:
            choice = self._mask_groups(choice)
        topk_ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_ids)
        if cfg.norm_topk_prob and cfg.top_k > 1:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
            if not cfg.scale_only_if_not_normed:
                topk_weights = topk_weights * cfg.routed_scaling_factor
        else:
            topk_weights = topk_weights * cfg.routed_scaling_factor
        return topk_weights, topk_ids

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        t = choice.shape[0]
        grouped = choice.view(t, cfg.n_group, -1)
        if cfg.group_score == "top2sum":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        # -inf, not 0: with a correction bias a kept expert's choice score can be negative, and
        # an expert of a dropped group must never win over it (the reference masks with -inf).
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, -1)
