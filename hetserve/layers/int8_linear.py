"""Int8Linear: a drop-in for nn.Linear on CPU with int8 weights (per output channel) through
fbgemm's packed GEMM with dynamic activation quantization.

For CPU-only serving: the non-expert linears (attention, shared experts, lm_head) then stream
a quarter of their fp32 bytes per token. Error: weights round to within scale/2 per element;
activations are quantized per call (fbgemm's reduce_range, 7 bits), which dominates.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float().cpu()
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        zero = torch.zeros(q.shape[0], dtype=torch.long)
        bias = None if linear.bias is None else linear.bias.detach().float().cpu()
        with warnings.catch_warnings():  # quantized tensors are deprecated, fbgemm is not
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
            self._packed = torch.ops.quantized.linear_prepack(qw, bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.nbytes = q.numel() + scale.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]).float(), self._packed, True)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` (not `module` itself) by an Int8Linear."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
            count += 1
        else:
            count += quantize_linears(child)
    return count
