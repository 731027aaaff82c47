"""RMSNorm, computed in fp32 like the reference so bf16 models keep their precision."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetserve import envs
from hetserve.native import optional_kernel


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == torch.float32:
            # On the CPU without autograd: one C call. torch's rms_norm is a composite of five
            # kernels (~1 ms per decode step of the small MoE over its 13 norms).
            # (cheapest tests first: this runs ~30 times per decode step)
            if (
                x.is_cpu
                and not (x.requires_grad or w.requires_grad)
                and w.dtype is torch.float32
                and envs.native_kernels()
                and (fn := optional_kernel("hetserve_rms_norm"))
            ):
                x = x.contiguous()
                out = torch.empty(x.shape, dtype=torch.float32)
                d = w.shape[0]
                fn(torch.get_num_threads(), x.numel() // d, d, self.eps, x.data_ptr(),
                   w.data_ptr(), out.data_ptr())  # fmt: skip
                return out
            return F.rms_norm(x, w.shape, w, self.eps)  # same math in fp32
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(dtype)
