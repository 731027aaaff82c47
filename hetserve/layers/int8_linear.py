"""Int8Linear: a drop-in for nn.Linear on CPU with int8 weights (per output channel).

For CPU-only serving: the non-expert linears (attention, shared experts, lm_head) then stream
a quarter of their fp32 bytes per token. Weights round to within scale/2 per element. Two
kernels:

- native (where hetserve's AVX2 kernels build, out_features % 4 == 0 and in_features % 32 == 0):
  the routed experts' int8 kernel on one matrix (`hetserve_int8_linear`); activations rounded to
  int16 per row, so the weight rounding dominates the error. Streams ~2x fbgemm's bytes/s at
  one token here.
- fbgemm's packed GEMM with dynamic activation quantization (per call, reduce_range: 7 bits),
  which dominates its error.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


def _native_ok(n: int, k: int) -> bool:
    from hetserve import envs
    from hetserve.native import native_unavailable_reason

    return n % 4 == 0 and k % 32 == 0 and envs.native_kernels() and not native_unavailable_reason()


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, kernel: str = "auto") -> None:
        super().__init__()
        w = linear.weight.detach().float().cpu()
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().float().cpu()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.nbytes = q.numel() + scale.numel() * 4
        self.kernel = "native" if kernel != "fbgemm" and _native_ok(*q.shape) else "fbgemm"
        if self.kernel == "native":
            from hetserve.native import kernel
            from hetserve.native.layout import interleave_quads

            self._fn = kernel("hetserve_int8_linear")
            self._q = interleave_quads(q.unsqueeze(0), 16)[0]
            self._scale = scale.contiguous()
            self._bias = bias
            return
        zero = torch.zeros(q.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated, fbgemm is not
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
            self._packed = torch.ops.quantized.linear_prepack(qw, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "native" and x.dim() == 2 and x.dtype is torch.float32:
            return self._native(x)  # the decode step's case: no reshapes or casts around it
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if self.kernel == "native":
            y = self._native(x2)
        else:
            y = torch.ops.quantized.linear_dynamic(x2, self._packed, True)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _native(self, x2: torch.Tensor) -> torch.Tensor:
        x2 = x2.contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        rc = self._fn(
            torch.get_num_threads(), x2.shape[0], self.out_features, self.in_features,
            x2.data_ptr(), y.data_ptr(), self._q.data_ptr(), self._scale.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("native int8 linear could not allocate its activation buffer")
        return y if self._bias is None else y.add_(self._bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int8 ({self.kernel})"
        )


def _fuse(module: nn.Module) -> int:
    """Where `module` declares projections that read the same input (`fused_projections`, e.g.
    attention's q/k/v), store them as one Int8Linear: one weight stream and one kernel call
    instead of three. The separate projections become None."""
    count = 0
    declared = getattr(module, "fused_projections", None)
    for fused_name, parts in (declared() if declared else {}).items():
        lins = [getattr(module, p, None) for p in parts]
        if not all(type(lin) is nn.Linear for lin in lins):
            continue
        if len({lin.in_features for lin in lins}) != 1:
            continue
        if len({lin.bias is None for lin in lins}) != 1:
            continue
        with torch.no_grad():
            big = nn.Linear(lins[0].in_features, sum(lin.out_features for lin in lins),
                            bias=lins[0].bias is not None, device="meta")  # fmt: skip
            big.weight = nn.Parameter(torch.cat([lin.weight for lin in lins]))
            if lins[0].bias is not None:
                big.bias = nn.Parameter(torch.cat([lin.bias for lin in lins]))
        setattr(module, fused_name, Int8Linear(big))
        for p in parts:
            setattr(module, p, None)
        count += len(parts)
    return count


def quantize_linears(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` (not `module` itself) by an Int8Linear."""
    count = _fuse(module)
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
            count += 1
        else:
            count += quantize_linears(child)
    return count
