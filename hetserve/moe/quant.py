"""Weight quantizers of the CPU expert formats and the error bounds they promise.

Shared by the expert backends (`cpu_backends.py`, `cpu_native.py`) and the converted-experts
file format (`model/converted.py`); see `cpu_backends.py` for how the bounds compose per layer.
"""

from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128)


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns (q int8 [N, K], scale fp32 [N]) with
    w_hat = q * scale[:, None] and |w - w_hat| <= scale / 2."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero row: any scale
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_activation_step(x: torch.Tensor, kernel: str) -> torch.Tensor:
    """Per-row activation rounding step s_x for inputs x [T, K]: native kernels (int8 and int4)
    round to int16 per row, fbgemm to 7 bits per call."""
    x = x.float()
    if kernel == "native":
        return x.abs().amax(dim=1) / 16383.0
    full = x.amax().clamp(min=0) - x.amin().clamp(max=0)  # fbgemm: one scale per call
    return (full / 127.0).expand(x.shape[0])


def int8_linear_bound(
    x: torch.Tensor, w_hat: torch.Tensor, scale: torch.Tensor, kernel: str = "native"
) -> torch.Tensor:
    """The promised |y - x @ w.T| bound of `cpu-int8` for inputs x [T, K] (see module doc)."""
    s_x = int8_activation_step(x, kernel)
    return (
        x.float().abs().sum(dim=1, keepdim=True) * scale[None, :] / 2
        + s_x[:, None] / 2 * w_hat.abs().sum(dim=1)[None, :]
    )


def quantize_int4_groupwise(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 over input channels: returns (q int32 [N, K] in [0, 15],
    scale [N, K/g], minimum [N, K/g]) with w_hat = q * scale + minimum, |w - w_hat| <= scale/2."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    lo = wg.amin(dim=2)
    scale = (wg.amax(dim=2) - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: exact
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15)
    return q.to(torch.int32).reshape(n, k), scale, lo


def int4_linear_bound(
    x: torch.Tensor,
    scale: torch.Tensor,
    group_size: int,
    w_hat: torch.Tensor | None = None,
    kernel: str = "library",
) -> torch.Tensor:
    """The promised |y - x @ w.T| bound of `cpu-int4` for inputs x [T, K] (see module doc);
    the native kernel's activation term needs `w_hat`."""
    t, k = x.shape
    xg = x.float().abs().reshape(t, k // group_size, group_size).sum(dim=2)  # [T, K/g]
    bound = xg @ scale.t() / 2
    if kernel == "native":
        assert w_hat is not None, "the native bound needs w_hat"
        s_x = int8_activation_step(x, "native")
        bound = bound + s_x[:, None] / 2 * w_hat.abs().sum(dim=1)[None, :]
    return bound
