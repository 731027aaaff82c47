"""Weight quantizers of the CPU expert formats and the error bounds they promise.

Shared by the expert backends (`moe/cpu_backends.py`, `moe/cpu_native.py`), the int8 linears
(`layers/int8_linear.py`) and the converted-experts file format (`converted.py`).

Error bounds each backend promises, per linear `y = x @ w.T` (w one expert's [N, K] matrix):

- `cpu-fp32`: only fp32 rounding (|y - y_ref| <= 1e-5 relative in the tests).
- `cpu-int8`: weights w_hat = q * s[n], q = round(w / s[n]) in [-127, 127], s[n] = max|w[n]| / 127,
  so |w - w_hat| <= s[n] / 2 per element. Activations x_hat with step s_x, |x - x_hat| <= s_x / 2,
  where s_x = max|x| / 16383 per row (native) or (max(x, 0) - min(x, 0)) / 127 per call (fbgemm):
      |y[n] - y_ref[n]| <= s[n] / 2 * ||x||_1 + s_x / 2 * ||w_hat[n]||_1   (+ fp32 rounding);
  `int8_linear_bound` computes it. Both accumulate exactly in int32.
- `cpu-int4`: per group of `group_size` input channels, scale = (max - min) / 15 and
  w_hat = q * scale + min with q in [0, 15], so |w - w_hat| <= scale / 2 per element and
      |y[n] - y_ref[n]| <= sum_k |x[k]| * scale[n, k // group_size] / 2
                           (+ s_x / 2 * ||w_hat[n]||_1, native: int16 activations as above)
                           (+ fp32 rounding);
  `int4_linear_bound` computes the weight term (torch's op keeps activations fp32).
- `cpu-fp8`: e4m3 with a scale s = max|w| / 448 per 128 x 128 block: 3 mantissa bits and a
  subnormal step of s / 512, and the avx512bf16 build reads subnormals (below s / 64) as zero,
  so |w - w_hat| <= |w| / 16 + s / 32 per element (`fp8_weight_bound`). Activations: fp32, or
  on that build a sum of two bf16, |x - x_hat| <= 2^-16 |x|.
- `cpu-mxfp4`: e2m1 codes times 2^e per 32 columns, e = floor(log2 max|w|) - 2: the grid's
  widest step is 2 * 2^e up to 6 * 2^e, above which (up to 8 * 2^e) values saturate to 6 * 2^e,
  so |w - w_hat| <= 2 * 2^e per element (`mxfp4_weight_bound`); int16 activations as above.

The bounds hold at any size: a size off a kernel's multiple is padded with zero weights and
zero activations (quant/layout.py), which add nothing, and int4's last group of fewer columns
takes its scale from them alone.
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


def q8k_round(v: torch.Tensor) -> torch.Tensor:
    """The q4_K kernel's activation rounding (native/moe_q4k.h, llama.cpp's q8_K) in torch, for
    its references: int8 per 256 columns with step amax / 127, round to nearest even; v's last
    dimension a multiple of 256, result in v's dtype."""
    b = v.float().reshape(*v.shape[:-1], -1, 256)
    amax = b.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(b * inv).clamp(-127, 127) * (amax / 127)).reshape(v.shape).to(v.dtype)


def quantize_int4_groupwise(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 over input channels: returns (q int32 [N, K] in [0, 15],
    scale [N, ceil(K/g)], minimum [N, ceil(K/g)]) with w_hat = q * scale + minimum,
    |w - w_hat| <= scale/2. A last group of fewer than g columns takes its scale and minimum
    from those columns alone."""
    n, k = w.shape
    groups = -(-k // group_size)
    wf = w.float()
    if groups * group_size != k:  # repeats of the last column change neither min nor max
        wf = torch.cat((wf, wf[:, -1:].expand(n, groups * group_size - k)), dim=1)
    wg = wf.reshape(n, groups, group_size)
    lo = wg.amin(dim=2)
    scale = (wg.amax(dim=2) - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: exact
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15)
    return q.to(torch.int32).reshape(n, -1)[:, :k].contiguous(), scale, lo


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
    xa = x.float().abs()
    xa = torch.cat((xa, xa.new_zeros(t, -k % group_size)), dim=1)  # a partial last group
    xg = xa.reshape(t, -1, group_size).sum(dim=2)  # [T, ceil(K/g)]
    bound = xg @ scale.t() / 2
    if kernel == "native":
        assert w_hat is not None, "the native bound needs w_hat"
        s_x = int8_activation_step(x, "native")
        bound = bound + s_x[:, None] / 2 * w_hat.abs().sum(dim=1)[None, :]
    return bound


# -- FP8 e4m3 with block scales (DeepSeek-V3 / Qwen3 FP8: 128 x 128 blocks) -----------------------
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8_blocks(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], scale_inv fp32 [ceil(N/bn), ceil(K/bk)]) with
    w ~ fp8 * scale_inv per block, scale_inv = max|w| / 448 over the block (as DeepSeek's
    checkpoints store it; edge blocks may be partial)."""
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    padded = w.float().new_zeros(gn * bn, gk * bk)
    padded[:n, :k] = w.float()
    amax = padded.abs().reshape(gn, bn, gk, bk).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / expand_blocks(scale, block, n, k)).to(torch.float8_e4m3fn)
    return q, scale


def fp8_weight_bound(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The promised |w - w_hat| per element of `cpu-fp8` for w [N, K] quantized in 128 x 128
    blocks with scales `scale_inv` (quantize_fp8_blocks'; see module doc)."""
    n, k = w.shape
    return w.float().abs() / 16 + expand_blocks(scale_inv.float(), (128, 128), n, k) / 32


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """Block scales [.., ceil(N/bn), ceil(K/bk)] -> one value per element [.., N, K]."""
    s = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return s[..., :n, :k]


def dequantize_fp8_blocks(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """fp8 [.., N, K] * its block scales -> fp32 (exact: fp8 values and their products with an
    fp32 scale fit fp32's 24-bit significand)."""
    n, k = q.shape[-2:]
    return q.float() * expand_blocks(scale_inv.float(), block, n, k)


# -- MXFP4 (OCP microscaling; gpt-oss experts): e2m1 values, 32-element blocks, e8m0 scales -----
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_BLOCK = 32


def fp4_table() -> torch.Tensor:
    """The 16 e2m1 codes as fp32: code = sign << 3 | magnitude index."""
    mag = torch.tensor(FP4_VALUES)
    return torch.cat((mag, -mag))


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [.., N, K] (K % 32 == 0) -> (blocks uint8 [.., N, K/32, 16], scales uint8 [.., N, K/32])
    as gpt-oss stores them: byte j of a block holds element 2j in its low nibble and 2j + 1 in
    its high nibble; scale = 2^(e - 127) with e = floor(log2(max|x|)) - 2 + 127 (OCP MX rule;
    elements beyond 6 x scale saturate)."""
    *lead, n, k = w.shape
    x = w.float().reshape(*lead, n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = x.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    v = x / torch.exp2(exp).unsqueeze(-1)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    idx = torch.bucketize(v.abs().contiguous(), mids)  # nearest magnitude (ties: the larger)
    code = (idx | (((v < 0) & (idx > 0)).to(torch.int64) << 3)).to(torch.uint8)  # no -0
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [.., N, G, 16], scales [.., N, G] -> fp32 [.., N, 32 G] (exact)."""
    table = fp4_table()
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)
    vals = table[codes.long()] * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return vals.reshape(*blocks.shape[:-2], -1)


def mxfp4_weight_bound(scales: torch.Tensor) -> torch.Tensor:
    """The promised |w - w_hat| per element of `cpu-mxfp4` from the e8m0 scales [.., N, K/32]
    (quantize_mxfp4's; see module doc): twice each block's scale."""
    return (2 * torch.exp2(scales.float() - 127)).repeat_interleave(MXFP4_BLOCK, dim=-1)
