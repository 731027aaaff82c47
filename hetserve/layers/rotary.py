"""Rotary position embeddings with the scaling variants found in HF configs.

Supported `rope_type`s: default, linear, dynamic (identical to default inside
max_position_embeddings, which is also our context limit), llama3, yarn. cos/sin tables are built
once for every position up to the context limit; applying them is a gather plus two FMAs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from hetserve import envs
from hetserve.errors import ModelLoadError
from hetserve.native import optional_kernel

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    params: tuple[tuple[str, float | int | bool | None], ...] = ()

    def get(self, key: str, default=None):
        return dict(self.params).get(key, default)

    @classmethod
    def from_hf(cls, hf: dict) -> RopeConfig:
        """Reads transformers 5 `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
        params = dict(hf.get("rope_parameters") or {})
        if not params:
            params = dict(hf.get("rope_scaling") or {})
            params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        if rope_type not in ROPE_TYPES:
            raise ModelLoadError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        items = tuple(sorted((k, v) for k, v in params.items() if not isinstance(v, list | dict)))
        return cls(theta=theta, rope_type=rope_type, params=items)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(rope: RopeConfig, scale: float) -> float:
    """DeepSeek multiplies the attention softmax scale by mscale(factor, mscale_all_dim)^2."""
    if rope.rope_type == "default":
        return scale
    all_dim = rope.get("mscale_all_dim") or 0
    if all_dim:
        m = _yarn_mscale(rope.get("factor"), all_dim)
        scale = scale * m * m
    return scale


def inv_freq_and_factor(
    rope: RopeConfig, dim: int, max_position: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin post-scale (`attention_factor`)."""
    base = rope.theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = rope.rope_type
    if kind in ("default", "dynamic"):
        return inv.float(), 1.0
    if kind == "linear":
        return (inv / rope.get("factor")).float(), 1.0
    if kind == "llama3":
        return _llama3(rope, inv).float(), 1.0
    return _yarn(rope, dim, max_position)


def _llama3(rope: RopeConfig, inv: torch.Tensor) -> torch.Tensor:
    factor = rope.get("factor")
    low, high = rope.get("low_freq_factor"), rope.get("high_freq_factor")
    old_len = rope.get("original_max_position_embeddings")
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    base = rope.theta
    orig = rope.get("original_max_position_embeddings")
    factor = rope.get("factor") or max_position / orig
    attn_factor = rope.get("attention_factor")
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if attn_factor is None:
        if mscale and mscale_all:
            attn_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attn_factor = _yarn_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attn_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to [T, heads, dim] tensors at the given positions.

    `interleaved=True` is DeepSeek's layout (pairs (x0,x1),(x2,x3)...). We de-interleave before
    rotating; q and k get the same permutation, so q.k is unchanged and the cached k stays valid.
    """

    def __init__(
        self, dim: int, max_position: int, rope: RopeConfig, interleaved: bool = False
    ) -> None:
        super().__init__()
        self.dim, self.max_position, self.rope = dim, max_position, rope
        self.interleaved = interleaved
        if torch.empty(0).is_meta:  # a model built on meta: the loader calls init_buffers
            # Any arithmetic on meta tensors imports torch._dynamo (1.5-6 s of start-up here),
            # and so does empty_like under the meta device (torch._refs: 0.7 s): two empties.
            shape = (self.max_position, self.dim // 2)
            self.register_buffer("cos", torch.empty(shape), persistent=False)
            self.register_buffer("sin", torch.empty(shape), persistent=False)
            self._angles = None
            return
        self.init_buffers()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)build the fp32 cos/sin tables, e.g. after the model was created on 'meta'."""
        inv, factor = inv_freq_and_factor(self.rope, self.dim, self.max_position)
        t = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv.to(device))
        self.register_buffer("cos", freqs.cos() * factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * factor, persistent=False)
        self._angles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Every layer (q and k) of a forward rotates at the same positions tensor: look the
        # angles up once. Holding `positions` keeps the identity test sound, as long as no
        # one refills a positions tensor in place between forwards (decode_graphs.py hands
        # each forward a new view of its static buffer).
        cached = self._angles
        if cached is not None and cached[0] is positions:
            cos, sin = cached[1], cached[2]
        else:
            cos = self.cos[positions].unsqueeze(1)  # [T, 1, dim / 2], contiguous
            sin = self.sin[positions].unsqueeze(1)
            self._angles = (positions, cos, sin)
        if (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and not x.requires_grad
            and envs.native_kernels()
            and (fn := optional_kernel("hetserve_rope"))
        ):
            x = x.contiguous()
            out = torch.empty_like(x)
            c, s = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
            fn(torch.get_num_threads(), x.shape[0], x.numel() // (x.shape[0] * x.shape[-1]),
               x.shape[-1] // 2, int(self.interleaved), x.data_ptr(), c.data_ptr(),
               s.data_ptr(), out.data_ptr())  # fmt: skip
            return out
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        dtype = x.dtype
        x1, x2 = x1.float(), x2.float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


class PartialRotaryEmbedding(RotaryEmbedding):
    """RoPE over the first `dim` channels of each head; the remaining channels pass through
    unrotated (GLM-4 MoE's `partial_rotary_factor`). The rotated channels use the layout of
    `RotaryEmbedding` (halves, or pairs with `interleaved`) among themselves."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == self.dim:
            return super().forward(x, positions)
        rotated = super().forward(x[..., : self.dim], positions)
        return torch.cat((rotated, x[..., self.dim :]), dim=-1)
