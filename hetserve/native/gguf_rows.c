/* Rows of a GGUF matrix dequantized to fp32, for token embeddings kept in the file's blocks
 * (hetserve.layers.quant_embedding): the K-quants q2_K-q6_K and the i-quants.
 *
 * A decode step looks up one row per sequence; gguf's numpy dequantize spent 0.3-0.7 ms on
 * that one row (array set-up, not arithmetic), 16% of a 0.43 B MoE's decode step. Here a row of
 * 2,048 values takes microseconds.
 *
 * The numbers are gguf's own (gguf-py quants.py, the Python definition of the file's values),
 * operation for operation: a scale is d * sc in fp32, then y = scale * q (- d_min * m) with no
 * fused multiply-add (fp-contract off), so rows are bit for bit what gguf and hetserve's QMatrix
 * dequantize give (tests/model/test_gguf_linears.py).
 *
 * hetserve_gguf_rows(type, raw, row_bytes, rows, ids, n, cols, out): row ids[i] of `raw` (`rows`
 * rows of row_bytes bytes, each cols / 256 super-blocks, or cols / 32 blocks for IQ4_NL) into
 * out[i * cols ...]. type: the kernels' format number (F_* of moe_job.h, BlockRows.native in
 * Python) of a GGUF block type, q4_K .. IQ1_M. Returns 0, -1 for an
 * unknown type, -2 for an id outside [0, rows) (nothing written then). */
#include <immintrin.h>
#include <stdint.h>

#include "moe_kq.h" /* the row kernels' block readers: kq_f16, k4_unpack, IQ4_LEVELS */

#pragma GCC optimize("fp-contract=off")

/* q4_K (144 bytes: d, dmin, scales[12], qs[128]) and q5_K (176: d, dmin, scales[12], qh[32],
 * qs[128]): sub-block j = 2c + h is chunk c's low (h 0) or high (h 1) nibbles, + bit j of qh;
 * its 6-bit scale and minimum as the kernels unpack them (k4_unpack: sc 0-7, then m 0-7). */
static void kquant45(const uint8_t *b, int five, float *y) {
    const float d = kq_f16(b), dmin = kq_f16(b + 2);
    const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
    uint8_t sm[16];
    _mm_storeu_si128((__m128i *)sm, k4_unpack(b + 4));
    for (int j = 0; j < 8; j++) {
        const float dj = d * (float)sm[j], mj = dmin * (float)sm[8 + j];
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; l++) {
            int v = (q[l] >> shift) & 0xF;
            if (five) v |= ((qh[l] >> j) & 1) << 4;
            const float t = dj * (float)v;
            y[32 * j + l] = t - mj;
        }
    }
}

/* q6_K (210 bytes: ql[128], qh[64], scales[16] int8, d): group g (32 values) = half g / 4 of
 * ql, nibble (g % 4) / 2 at offset 32 * (g % 2), 2 high bits from qh's chunk g / 4 at 2 * (g % 4);
 * value v's scale is scales[v / 16]. */
static void q6k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = kq_f16(b + 208);
    for (int g = 0; g < 8; g++) {
        const int h = g / 4, r = g % 4;
        const uint8_t *lo = ql + 64 * h + 32 * (r % 2), *hi = qh + 32 * h;
        const int nshift = 4 * (r / 2), hshift = 2 * r;
        const float s[2] = {d * (float)sc[2 * g], d * (float)sc[2 * g + 1]};
        for (int l = 0; l < 32; l++) {
            const int q = (((lo[l] >> nshift) & 0xF) | (((hi[l] >> hshift) & 3) << 4)) - 32;
            y[32 * g + l] = s[l / 16] * (float)q;
        }
    }
}

/* IQ4_XS (136 bytes: d, scales_h u16, scales_l[4], qs[128]): sub-block ib's 6-bit scale - 32;
 * its 16 bytes give 16 low nibbles then 16 high nibbles, through the IQ4 table. */
static void iq4xs(const uint8_t *b, float *y) {
    const float d = kq_f16(b);
    const unsigned sh = b[2] | b[3] << 8;
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++) {
        const int ls = (((sl[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)) - 32;
        const float dl = d * (float)ls;
        for (int l = 0; l < 16; l++) {
            y[32 * ib + l] = dl * (float)IQ4_LEVELS[qs[16 * ib + l] & 0xF];
            y[32 * ib + 16 + l] = dl * (float)IQ4_LEVELS[qs[16 * ib + l] >> 4];
        }
    }
}

/* q3_K (110 bytes: hmask[32], qs[64], scales[12], d) and q2_K (84: scales[16], qs[64], d,
 * dmin): value v = 128 n + 32 i + l takes bits 2 i of qs[32 n + l] and (q3_K) bit 4 n + i of
 * hmask[l] (clear: 4 subtracted); scale v / 16: q3_K's 6-bit one less 32 (q3k_scales), q2_K's
 * low nibble with its minimum in the high one. */
static void kquant23(const uint8_t *b, int three, float *y) {
    const uint8_t *qs = b + (three ? 32 : 16);
    int8_t sc[16];
    if (three) _mm_storeu_si128((__m128i *)sc, q3k_scales(b + 96));
    const float d = kq_f16(b + (three ? 108 : 80)), dmin = three ? 0.0f : kq_f16(b + 82);
    for (int v = 0; v < 256; v++) {
        const int n = v / 128, i = (v / 32) % 4, l = v % 32, g = v / 16;
        int q = (qs[32 * n + l] >> (2 * i)) & 3;
        if (three) {
            q -= ((b[l] >> (4 * n + i)) & 1) ? 0 : 4;
            y[v] = (d * (float)sc[g]) * (float)q;
        } else {
            const float t = (d * (float)(b[g] & 15)) * (float)q;
            y[v] = t - dmin * (float)(b[g] >> 4);
        }
    }
}

/* The grid i-quants' tables (moe_iqg.h), handed over once by hetserve/native/__init__.py from
 * gguf's own; the sign table is 7 bits and their parity. */
iq_grids_t hs_iq_grids;

void hetserve_iq_grids(const uint64_t *iq2xxs, const uint64_t *iq2xs, const uint64_t *iq2s,
                       const uint32_t *iq3xxs, const uint32_t *iq3s, const uint64_t *iq1s) {
    for (int i = 0; i < 256; i++) {
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint64_t)((i >> j) & 1 ? 0xFF : 0x01) << (8 * j);
        hs_iq_grids.signs64[i] = v;
    }
    for (int i = 0; i < 128; i++) /* the 8th sign: the parity of the 7 */
        hs_iq_grids.ksigns64[i] = hs_iq_grids.signs64[i | (__builtin_popcount(i) & 1) << 7];
    hs_iq_grids.iq2xxs = iq2xxs, hs_iq_grids.iq2xs = iq2xs, hs_iq_grids.iq2s = iq2s;
    hs_iq_grids.iq3xxs = iq3xxs, hs_iq_grids.iq3s = iq3s, hs_iq_grids.iq1s = iq1s;
    for (int i = 0; i < 512; i++) /* byte planes (moe_iqg.h, HS_IQG_PLANES) */
        for (int j = 0; j < 8; j++) {
            if (j < 4) hs_iq_grids.p3s[j][i] = (uint8_t)(iq3s[i] >> (8 * j));
            if (j < 4 && i < 256) hs_iq_grids.p3xxs[j][i] = (uint8_t)(iq3xxs[i] >> (8 * j));
            if (i < 256) hs_iq_grids.p2xxs[j][i] = (uint8_t)(iq2xxs[i] >> (8 * j));
        }
    for (int p = 0; p < 64; p++) { /* IQ2_XXS: words of 4 index bytes, 4 sign bytes */
        const int h = (p / 32) * 64, c = p % 32;
        hs_iq_grids.pick2[0][p] = (uint8_t)(h + 8 * (c / 4) + c % 4);
        hs_iq_grids.pick2[1][p] = (uint8_t)(h + 8 * (c / 4) + 4 + c % 4);
    }
}

/* A grid i-quant super-block: w = D * sc * v (moe_iqg.h), every product exact in fp32. */
static void iqgrid(int fmt, const uint8_t *b, float *y) {
    float D;
    int8_t sc[16], v[32];
    _mm_storeu_si128((__m128i *)sc, iqg_head(fmt, b, &D));
    for (int k = 0; k < 8; k++) {
        __m256i mag, sgn;
        iqg_group(fmt, b, k, &mag, &sgn);
        _mm256_storeu_si256((__m256i *)v, _mm256_sign_epi8(mag, sgn));
        for (int l = 0; l < 32; l++) y[32 * k + l] = D * (float)(sc[2 * k + l / 16] * v[l]);
    }
}

/* IQ4_NL (18 bytes per 32 values: d, qs[16]). */
static void iq4nl(const uint8_t *b, float *y) {
    const float d = kq_f16(b);
    for (int l = 0; l < 16; l++) {
        y[l] = d * (float)IQ4_LEVELS[b[2 + l] & 0xF];
        y[16 + l] = d * (float)IQ4_LEVELS[b[2 + l] >> 4];
    }
}

int hetserve_gguf_rows(int type, const uint8_t *raw, int64_t row_bytes, int64_t rows,
                       const int64_t *ids, int n, int cols, float *out) {
    if (type < F_Q4K || type > F_LAST) return -1;
    const int nl = type == F_IQ4NL; /* blocks of 32 values, 18 bytes, in the file's order */
    const int per = nl ? 32 : 256, bb = nl ? 18 : kq_bytes(type);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows) return -2;
    for (int i = 0; i < n; i++) {
        const uint8_t *row = raw + ids[i] * row_bytes;
        float *y = out + (int64_t)i * cols;
        for (int c = 0; c < cols / per; c++) {
            const uint8_t *b = row + (int64_t)c * bb;
            float *yc = y + (int64_t)c * per;
            switch (type) {
            case F_Q4K: kquant45(b, 0, yc); break;
            case F_Q5K: kquant45(b, 1, yc); break;
            case F_Q6K: q6k(b, yc); break;
            case F_IQ4XS: iq4xs(b, yc); break;
            case F_IQ4NL: iq4nl(b, yc); break;
            case F_Q3K: kquant23(b, 1, yc); break;
            case F_Q2K: kquant23(b, 0, yc); break;
            default: iqgrid(type, b, yc); break; /* the grid i-quants */
            }
        }
    }
    return 0;
}
