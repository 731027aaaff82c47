"""Reference q6_K, q5_K, q3_K and q2_K quantizers (numpy): plain round-to-nearest into
llama.cpp's published block formats (ggml-common.h's block_q6_K, block_q5_K, block_q3_K and
block_q2_K): the GGUF
loader converts types no kernel reads to them (quant/gguf_convert.py), and tests write files and
check kernels with them where llama.cpp's own quantizer is not at hand. They are not llama.cpp's
search for the best scales; what matters here is that the bytes are valid blocks, which tests
check against the `gguf` package's dequantizer."""

from __future__ import annotations

import numpy as np


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _nan0(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    return out


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[rows, K] fp32 (K % 256 == 0) -> q6_K bytes [rows, K / 256 * 210]: per 16 columns an int8
    scale of the super-block's fp16 d, q = round(w / (d * sc)) + 32 in [0, 63]."""
    rows, k = w.shape
    x = w.astype(np.float32).reshape(rows, k // 256, 16, 16)
    amax = np.abs(x).max(axis=-1)
    sub = amax / 31.0  # the step per 16 columns
    d = _f16(sub.max(axis=-1) / 127.0)
    df = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(_nan0(np.round(sub / df)), -128, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.clip(_nan0(np.round(x / step)), -32, 31).astype(np.int32) + 32
    q = q.reshape(rows, k // 256, 2, 4, 32)  # [.., n, i, l]: column 128 n + 32 i + l
    ql = np.empty((rows, k // 256, 2, 64), np.uint8)
    ql[..., :32] = (q[..., 0, :] & 15) | ((q[..., 2, :] & 15) << 4)
    ql[..., 32:] = (q[..., 1, :] & 15) | ((q[..., 3, :] & 15) << 4)
    qh = sum(((q[..., i, :] >> 4) & 3) << (2 * i) for i in range(4)).astype(np.uint8)
    parts = (ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8),
             d[..., None].view(np.uint8))  # fmt: skip
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _six_bit(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """q4_K / q5_K's 12 bytes of 6-bit scales and minimums."""
    out = np.empty((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return out


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """[rows, K] fp32 (K % 256 == 0) -> q5_K bytes [rows, K / 256 * 176]: per 32 columns
    scale = (max - min) / 31 and offset -min (min <= 0) as 6-bit multiples of d and dmin."""
    rows, k = w.shape
    x = w.astype(np.float32).reshape(rows, k // 256, 8, 32)
    lo = np.minimum(x.min(axis=-1), 0.0)
    scale = (x.max(axis=-1) - lo) / 31.0
    d, dmin = _f16(scale.max(axis=-1) / 63.0), _f16((-lo).max(axis=-1) / 63.0)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(_nan0(np.round(scale / df)), 0, 63).astype(np.uint8)
        m = np.clip(_nan0(np.round(-lo / dminf)), 0, 63).astype(np.uint8)
        s_eff, o_eff = (df * sc)[..., None], (dminf * m)[..., None]
        q = np.clip(_nan0(np.round((x + o_eff) / s_eff)), 0, 31).astype(np.uint8)
    q = q.reshape(rows, k // 256, 4, 2, 32)  # [.., c, h, l]: column 64 c + 32 h + l
    qs = ((q[..., 0, :] & 15) | ((q[..., 1, :] & 15) << 4)).reshape(rows, -1, 128)
    qh = sum(((q[..., c, h, :] >> 4) & 1) << (2 * c + h) for c in range(4) for h in range(2))
    parts = (d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), _six_bit(sc, m),
             qh.astype(np.uint8), qs)  # fmt: skip
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """Values [rows, nsb, 256] in [0, 3] -> qs [rows, nsb, 64]: column 128 n + 32 i + l at bits
    2 i of byte 32 n + l (q3_K's low bits, q2_K's values)."""
    q = q.reshape(*q.shape[:-1], 2, 4, 32).astype(np.uint8)  # [.., n, i, l]
    qs = sum((q[..., i, :] & 3) << (2 * i) for i in range(4))
    return np.asarray(qs, np.uint8).reshape(*q.shape[:-3], 64)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """[rows, K] fp32 (K % 256 == 0) -> q3_K bytes [rows, K / 256 * 110]: per 16 columns a
    signed step that takes the column of largest |w| to -4, as a 6-bit multiple (sc - 32 in
    [-32, 31]) of the super-block's fp16 d; q = round(w / step) in [-4, 3], stored + 4."""
    rows, k = w.shape
    x = w.astype(np.float32).reshape(rows, k // 256, 16, 16)
    idx = np.abs(x).argmax(axis=-1)[..., None]
    step = -np.take_along_axis(x, idx, axis=-1)[..., 0] / 4.0  # signed, per 16 columns
    big = np.take_along_axis(step, np.abs(step).argmax(axis=-1)[..., None], axis=-1)
    d = _f16(-big[..., 0] / 32.0)
    df = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(_nan0(np.round(step / df)), -32, 31).astype(np.int32)
        q = np.clip(_nan0(np.round(x / (df * sc)[..., None])), -4, 3).astype(np.int32) + 4
    q = q.reshape(rows, k // 256, 256)
    hb = (q >> 2).reshape(rows, k // 256, 8, 32)  # bit 2 of column 32 j + l at bit j of l
    hmask = np.asarray(sum(hb[..., j, :] << j for j in range(8)), np.uint8)
    s6 = (sc + 32).astype(np.uint8)  # [.., 16]
    packed = np.empty((rows, k // 256, 12), np.uint8)
    packed[..., 0:8] = (s6[..., 0:8] & 15) | ((s6[..., 8:16] & 15) << 4)
    packed[..., 8:12] = sum(((s6[..., 4 * t : 4 * t + 4] >> 4) & 3) << (2 * t) for t in range(4))
    parts = (hmask, _two_bit_planes(q & 3), packed, d[..., None].view(np.uint8))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """[rows, K] fp32 (K % 256 == 0) -> q2_K bytes [rows, K / 256 * 84]: per 16 columns
    scale = (max - min) / 3 and offset -min (min <= 0) as 4-bit multiples of d and dmin."""
    rows, k = w.shape
    x = w.astype(np.float32).reshape(rows, k // 256, 16, 16)
    lo = np.minimum(x.min(axis=-1), 0.0)
    scale = (x.max(axis=-1) - lo) / 3.0
    d, dmin = _f16(scale.max(axis=-1) / 15.0), _f16((-lo).max(axis=-1) / 15.0)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(_nan0(np.round(scale / df)), 0, 15).astype(np.uint8)
        m = np.clip(_nan0(np.round(-lo / dminf)), 0, 15).astype(np.uint8)
        s_eff, o_eff = (df * sc)[..., None], (dminf * m)[..., None]
        q = np.clip(_nan0(np.round((x + o_eff) / s_eff)), 0, 3).astype(np.uint8)
    parts = (sc | (m << 4), _two_bit_planes(q.reshape(rows, k // 256, 256)),
             d[..., None].view(np.uint8), dmin[..., None].view(np.uint8))  # fmt: skip
    return np.concatenate(parts, axis=-1).reshape(rows, -1)
