"""Int8Linear (CPU-only serving of non-expert linears): both kernels within the int8 bound."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetserve.layers.int8_linear import Int8Linear
from hetserve.native import native_unavailable_reason
from hetserve.quant.quantize import (
    int8_activation_step,
    int8_linear_bound,
    quantize_int8_per_channel,
)


@pytest.mark.parametrize("kernel", ["auto", "fbgemm"])
@pytest.mark.parametrize(
    "n,k,t,bias",
    [(64, 96, 1, False), (12, 32, 5, True), (8, 64, 33, True),
     # off the native kernel's units (rows in quads, columns in 32s): stored padded
     (6, 30, 3, True), (7, 100, 1, False), (13, 72, 5, True), (3, 130, 2, False),
     (70, 33, 34, True)],
)  # fmt: skip
def test_within_the_stated_bound(kernel, n, k, t, bias):
    g = torch.Generator().manual_seed(n + t)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.1)
        lin.weight[2, 5] = 2.0  # an outlier the per-channel scale must contain
    x = torch.randn(t, k, generator=g)
    q = Int8Linear(lin, kernel=kernel)
    if kernel == "auto":
        assert q.kernel == ("fbgemm" if native_unavailable_reason() else "native")
    with torch.no_grad():
        ref = lin(x)
    out = q(x.view(t, 1, k)).view(t, n)  # leading dims are kept
    qw, scale = quantize_int8_per_channel(lin.weight.detach())
    bound = int8_linear_bound(
        x, qw.float() * scale[:, None], scale, q.kernel if q.kernel == "native" else "fbgemm"
    )
    assert ((out - ref).abs() <= bound + 1e-5).all()


@pytest.mark.skipif(bool(native_unavailable_reason()), reason="native kernels unavailable")
@pytest.mark.parametrize(("n", "k"), [(6, 30), (7, 100), (13, 72), (70, 33)])
def test_any_shape_is_native_and_padding_adds_nothing(n, k):
    """Rows off whole quads and columns off 32s are stored with zero weights appended (the
    kernel pads the input, drops the padded outputs): the result is, bit for bit, the same
    kernel's on a linear padded by hand. kernel="fbgemm" still asks for the library op."""
    g = torch.Generator().manual_seed(n * k)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
    np_, kp = -(-n // 4) * 4, -(-k // 32) * 32
    big = nn.Linear(kp, np_)
    with torch.no_grad():
        big.weight.zero_()
        big.weight[:n, :k] = lin.weight
        big.bias.zero_()
        big.bias[:n] = lin.bias
    q = Int8Linear(lin)
    assert q.kernel == "native" and q._q.shape == (np_ // 4, kp // 16, 4, 16)
    x = torch.randn(5, k, generator=g)
    out = q(x)
    assert out.shape == (5, n)
    assert torch.equal(out, Int8Linear(big)(F.pad(x, (0, kp - k)))[:, :n])
    assert Int8Linear(lin, kernel="fbgemm").kernel == "fbgemm"


class _Attn(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(64, n, bias=bias) for n in (64, 32, 32))
        self.o_proj = nn.Linear(64, 64)
        self.qkv_proj = None

    def fused_projections(self):
        return {"qkv_proj": ("q_proj", "k_proj", "v_proj")}


@pytest.mark.parametrize("bias", [False, True])
def test_declared_projections_become_one_matrix(bias):
    from hetserve.layers.int8_linear import quantize_linears

    attn = _Attn(bias)
    separate = [Int8Linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    assert quantize_linears(attn) == 4
    assert attn.q_proj is None and attn.k_proj is None and attn.v_proj is None
    assert isinstance(attn.qkv_proj, Int8Linear) and isinstance(attn.o_proj, Int8Linear)
    x = torch.randn(3, 64)
    # Per-output-channel scales: fusing rows changes nothing about each row's quantization.
    assert torch.allclose(attn.qkv_proj(x), torch.cat([m(x) for m in separate], -1), atol=1e-6)


def _q4k(w: torch.Tensor):
    from hetserve.quant.packed import Q4KRows
    from hetserve.testing.tiny_gguf import quantize_q4_k

    return Q4KRows(torch.from_numpy(quantize_q4_k(w.numpy()).reshape(w.shape[0], -1, 144)))


def _q6k(w: torch.Tensor):
    from hetserve.quant.gguf import q6_k_rows
    from hetserve.quant.gguf_quants import quantize_q6_k

    return q6_k_rows(quantize_q6_k(w.numpy()))


def _q5k(w: torch.Tensor):
    from hetserve.quant.gguf import q5_k_rows
    from hetserve.quant.gguf_quants import quantize_q5_k

    return q5_k_rows(quantize_q5_k(w.numpy()))


def _k23(kind: str):
    def pack(w: torch.Tensor):
        from hetserve.quant.gguf import q2_k_rows, q3_k_rows
        from hetserve.quant.gguf_quants import quantize_q2_k, quantize_q3_k

        if kind == "q3_K":
            return q3_k_rows(quantize_q3_k(w.numpy()))
        return q2_k_rows(quantize_q2_k(w.numpy()))

    return pack


def _grid(kind: str):
    def pack(w: torch.Tensor):  # random blocks of w's shape (testing/gguf_quants.py)
        from hetserve.quant.gguf_grid import grid_reader
        from hetserve.testing.gguf_quants import random_iq_grid

        return grid_reader(kind)(random_iq_grid(kind, w.shape[0], w.shape[1], w.shape[0]))

    return pack


def _iq4(kind: str):
    def pack(w: torch.Tensor):  # random blocks of w's shape (testing/gguf_quants.py)
        from hetserve.quant.gguf_iq import iq4_nl_rows, iq4_xs_rows
        from hetserve.testing.gguf_quants import random_iq4

        rows = iq4_xs_rows if kind == "IQ4_XS" else iq4_nl_rows
        return rows(random_iq4(kind, w.shape[0], w.shape[1], w.shape[0]))

    return pack


GRIDS = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]  # F_* 12 .. 18


def _q8_0(w: torch.Tensor):
    from hetserve.quant.packed import Int8Rows

    return Int8Rows.q8_0(w)


@pytest.mark.skipif(bool(native_unavailable_reason()), reason="native kernels unavailable")
@pytest.mark.parametrize(
    ("fmt", "pack"),
    [
        (5, _q4k),
        (6, _q6k),
        (7, _q5k),
        (1, _q8_0),
        (8, _iq4("IQ4_XS")),
        (9, _iq4("IQ4_NL")),
        (10, _k23("q3_K")),
        (11, _k23("q2_K")),
        *((12 + i, _grid(k)) for i, k in enumerate(GRIDS)),
    ],  # fmt: skip
)
@pytest.mark.parametrize(
    ("t", "bias", "n"),
    [(1, False, 20), (3, True, 20), (34, False, 20), (1, False, 308), (3, True, 22),
     (2, False, 301)],
)  # fmt: skip
def test_checkpoint_matrices_served_as_they_are(fmt, pack, t, bias, n):
    """A linear carrying its checkpoint matrix (`packed_weight`, GGUF q4_K / q6_K / q5_K / q8_0 /
    IQ4_XS / IQ4_NL / q3_K / q2_K / the grid i-quants)
    runs on those numbers exactly: against x @ w_hat.T only the activation rounding is left,
    |y - x @ w_hat.T| <= sum over blocks of s_x / 2 * sum|w_hat| per output (plus fp32
    summation; q8_0: int16 per row, the K-quants: int8 per 256 columns as llama.cpp's q8_K), and
    the bytes streamed are the file's (q4_K: 9/16 of a byte per weight, q6_K 105/128). 308
    rows: 77 quads, so the work items hold an odd count unless rounded to the q4_K kernel's pairs
    of quads; 22 and 301 rows end in a padded quad (zero rows, outputs dropped)."""
    k = 512
    g = torch.Generator().manual_seed(t)
    lin = nn.Linear(k, n, bias=bias)
    packed = pack(torch.randn(n, k, generator=g) * 0.1)
    w_hat = packed.dequantize()
    with torch.no_grad():
        lin.weight.copy_(w_hat)
    lin.packed_weight = packed
    q = Int8Linear(lin)
    assert q.kernel == "native" and q.fmt == fmt and q.nbytes == packed.nbytes
    assert q.group == (32 if fmt == 1 else 0)
    x = torch.randn(t, k, generator=g)
    ref = x.double() @ w_hat.double().T
    if bias:
        ref += lin.bias.detach().double()
    if fmt != 1:  # a step per row and super-block of 256 columns
        s_x = x.reshape(t, -1, 256).abs().amax(dim=2) / 127
        per_block = w_hat.abs().reshape(n, -1, 256).sum(dim=2)
        bound = (s_x / 2).double() @ per_block.double().T + 1e-5 * ref.abs().max()
    else:
        s_x = int8_activation_step(x, "native")
        bound = s_x[:, None] / 2 * w_hat.abs().sum(dim=1)[None, :] + 1e-5 * ref.abs().max()
    assert ((q(x).double() - ref).abs() <= bound).all()


@pytest.mark.skipif(bool(native_unavailable_reason()), reason="native kernels unavailable")
def test_fused_projections_keep_their_checkpoint_matrices():
    from hetserve.layers.int8_linear import quantize_linears

    attn = _Attn(False)
    attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj = (
        nn.Linear(256, n, bias=False) for n in (64, 32, 32, 256)
    )
    g = torch.Generator().manual_seed(0)
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        m.packed_weight = _q4k(torch.randn(m.out_features, 256, generator=g) * 0.1)
        with torch.no_grad():
            m.weight.copy_(m.packed_weight.dequantize())
    separate = [Int8Linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    quantize_linears(attn)
    assert attn.qkv_proj.fmt == 5 and attn.o_proj.fmt == 1  # o_proj had no checkpoint matrix
    x = torch.randn(3, 256, generator=g)
    torch.testing.assert_close(attn.qkv_proj(x), torch.cat([m(x) for m in separate], -1))


def test_an_int8_residual_keeps_the_rounding_error_to_16_bit_class():
    """Int8Linear(residual=True) (linear attention's input projections under all-int8): the
    weights it applies are within max|w| / (2 * 127 * 254) of the linear's per row, where plain
    per-channel int8 is within max|w| / 254; read back through an identity input (rounded
    exactly: one nonzero per row)."""
    if native_unavailable_reason() is not None:
        pytest.skip(f"the residual runs on the native kernel: {native_unavailable_reason()}")
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=True)
    eye = torch.eye(96)
    plain, fine = Int8Linear(lin), Int8Linear(lin, residual=True)
    w, wmax = lin.weight.detach(), lin.weight.detach().abs().amax(1, keepdim=True)
    got = (fine(eye) - lin.bias.detach()).t()
    assert bool(((got - w).abs() <= wmax / (2 * 127 * 254) * 1.01).all())
    coarse = ((plain(eye) - lin.bias.detach()).t() - w).abs().max()
    assert (got - w).abs().max() < coarse / 50
    assert fine.nbytes == 2 * plain.nbytes and "residual" in repr(fine)
    x = torch.randn(5, 96)
    torch.testing.assert_close(fine(x), lin(x), atol=1e-3, rtol=0)


@pytest.mark.skipif(bool(native_unavailable_reason()), reason="native kernels unavailable")
def test_iq4_nl_linear_off_256_columns_pads_with_zero_blocks():
    """IQ4_NL rows of 96 columns (3 blocks of 32): the kernel reads whole super-blocks of 256,
    the padded blocks (d = 0) and activations (0) add nothing."""
    from hetserve.quant.gguf_iq import iq4_nl_rows
    from hetserve.testing.gguf_quants import random_iq4

    n, k = 10, 96
    packed = iq4_nl_rows(random_iq4("IQ4_NL", n, k, 7))
    lin = nn.Linear(k, n, bias=False)
    lin.packed_weight = packed
    q = Int8Linear(lin)
    assert (q.kernel, q.fmt, q.nbytes) == ("native", 9, packed.nbytes)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    w_hat = packed.dequantize()
    ref = x.double() @ w_hat.double().T
    s_x = x.abs().amax(dim=1) / 127  # one super-block: the 96 columns and 160 zeros
    bound = (s_x / 2)[:, None].double() * w_hat.abs().sum(dim=1)[None, :].double()
    assert ((q(x).double() - ref).abs() <= bound + 1e-5 * ref.abs().max()).all()
