/* GGUF's grid i-quants, read as a file stores them: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
 * IQ1_S and IQ1_M (llama.cpp's ggml-common.h block formats; gguf-py's quants.py is their
 * Python definition, which tests/model/test_gguf_linears.py holds these readers to through
 * gguf_rows.c's embedding rows, and tests/moe/test_gguf_experts.py through the kernels).
 *
 * Each format stores, per 8 (IQ3: 4) columns, an index into a table of points ("grid") and,
 * except IQ1, 8 sign bits; per 16 or 32 columns a small integer scale; per super-block of 256
 * columns an fp16 d. Every weight is w = D * sc * v with v an integer:
 *   IQ2_XXS / IQ2_XS / IQ2_S: v = +-grid (8, 25 or 43), sc = 2 s + 1, D = d / 8;
 *   IQ3_XXS: v = +-grid (4 .. 62), sc = 2 s + 1, D = d / 4;  IQ3_S: v = +-grid (1 .. 15),
 *   sc = 2 s + 1, D = d;  IQ1_S / IQ1_M: v = 8 g +- 1 (g in -1, 0, 1: the grid's point plus
 *   the block's delta of +-1/8), sc = 2 s + 1, D = d / 8.
 * (gguf computes d * (0.5 + s) * 0.25 and so on: the same numbers, every product exact in fp32.)
 * The sign bits of IQ2_XXS / IQ2_XS / IQ3_XXS come as 7 bits whose 8th is their parity.
 *
 * A group of 32 columns is read as two vectors: mag (|v| as bytes, <= 62) and sgn (bytes
 * whose sign is v's, never 0), so that a kernel takes maddubs(mag, sign(x, sgn)); the scales
 * per 16 columns as 16 int8. The tables are gguf's own (hetserve/native/__init__.py hands them
 * over once the library is built: hetserve_iq_grids); IQ1's points are stored times 8.
 *
 * Put together per 8 (4) columns, a point costs a scalar index, a load and an insert: the grid
 * types ran at 0.1-0.25 of the read bandwidth, bound by that. With AVX512-VBMI the grids of 256
 * or 512 points (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS) are also kept as byte planes (plane j: byte j
 * of every point, 256 or 512 bytes) and their row kernels look 64 points up at a time by masked
 * vpermi2b, 128 points each, the activations in plane order to match (iqg_planes; the weights
 * stay as the file has them). IQ2_S (1024 points) and IQ1 (2048) keep the loads. */
#ifndef HETSERVE_MOE_IQG_H
#define HETSERVE_MOE_IQG_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "moe_job.h"

typedef struct {
    const uint64_t *iq2xxs, *iq2xs, *iq2s, *iq1s; /* 8 bytes a point (IQ1: int8, times 8) */
    const uint32_t *iq3xxs, *iq3s;                /* 4 bytes a point */
    uint64_t signs64[256];  /* 8 sign bits -> 8 bytes of -1 (bit set) or +1 */
    uint64_t ksigns64[128]; /* 7 sign bits and their parity -> the same */
    /* Byte planes of the grids with at most 512 points of 4 bytes or 256 of 8 (IQG_PLANES):
     * plane j holds byte j of every point, so that vpermi2b looks 64 points up at once. */
    uint8_t p3xxs[4][256] __attribute__((aligned(64)));
    uint8_t p3s[4][512] __attribute__((aligned(64)));
    uint8_t p2xxs[8][256] __attribute__((aligned(64)));
    uint8_t p2xs[8][512] __attribute__((aligned(64)));
} iq_grids_t;
extern iq_grids_t hs_iq_grids; /* gguf_rows.c: set by hetserve_iq_grids */

static inline int iqg_fmt(int fmt) {
    return fmt >= F_IQ2XXS && fmt <= F_IQ1M;
}

/* Where the build has AVX512-VBMI and BITALG (Zen 4 and 5, Ice Lake and later Xeons), the row
 * kernels of IQ3_XXS, IQ3_S, IQ2_XXS and IQ2_XS look a super-block's points up in registers, a byte
 * plane at a time (quad_iqg_planes in moe_kq.h): their activations are then in plane order
 * (iqg_plane_perm), and iqg_planes says how many planes a format has (bytes a point; 0: the
 * file's order, the points put together per 8 or 4 columns as below). */
#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#define HS_IQG_PLANES 1
#else
#define HS_IQG_PLANES 0
#endif

static inline int iqg_planes(int fmt) {
    if (!HS_IQG_PLANES) return 0;
    if (fmt == F_IQ3XXS || fmt == F_IQ3S) return 4;
    return fmt == F_IQ2XXS || fmt == F_IQ2XS ? 8 : 0;
}

/* Plane order of one super-block's 256 activations (n planes, 256 / n points): position
 * (256 / n) j + p holds column n p + j, byte j of point p. */
static inline void iqg_plane_perm(int8_t *x, int n) {
    int8_t t[256];
    const int np = 256 / n;
    for (int j = 0; j < n; j++)
        for (int p = 0; p < np; p++) t[np * j + p] = x[n * p + j];
    memcpy(x, t, sizeof(t));
}

/* Bytes of a super-block (256 columns). */
static inline int iqg_bytes(int fmt) {
    switch (fmt) {
    case F_IQ2XXS: return 66;
    case F_IQ2XS: return 74;
    case F_IQ2S: return 82;
    case F_IQ3XXS: return 98;
    case F_IQ3S: return 110;
    case F_IQ1S: return 50;
    default: return 56; /* IQ1_M */
    }
}

static inline uint32_t iqg_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint16_t iqg_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Four 8-byte points -> one vector (columns 8 l .. 8 l + 7 from point l), put together by
 * loads and inserts (never through the stack: four 8-byte stores read back as one 32-byte load
 * would stall store forwarding). */
static inline __m256i iqg_points8(const uint64_t *g, unsigned i0, unsigned i1, unsigned i2,
                                  unsigned i3) {
    const __m128i lo = _mm_insert_epi64(_mm_loadl_epi64((const __m128i *)(g + i0)),
                                        (long long)g[i1], 1);
    const __m128i hi = _mm_insert_epi64(_mm_loadl_epi64((const __m128i *)(g + i2)),
                                        (long long)g[i3], 1);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* Eight 4-byte points (IQ3) at the indices idx[0..7] -> one vector, likewise. */
static inline __m256i iqg_points4(const uint32_t *g, const unsigned idx[8]) {
    __m128i lo = _mm_cvtsi32_si128((int)g[idx[0]]), hi = _mm_cvtsi32_si128((int)g[idx[4]]);
    lo = _mm_insert_epi32(lo, (int)g[idx[1]], 1), hi = _mm_insert_epi32(hi, (int)g[idx[5]], 1);
    lo = _mm_insert_epi32(lo, (int)g[idx[2]], 2), hi = _mm_insert_epi32(hi, (int)g[idx[6]], 2);
    lo = _mm_insert_epi32(lo, (int)g[idx[3]], 3), hi = _mm_insert_epi32(hi, (int)g[idx[7]], 3);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* Four sign bytes at p (byte l: the signs of columns 8 l .. 8 l + 7, bit j for column
 * 8 l + j) -> 32 bytes of -1 (bit set) or +1: the 32 bits as a mask (vpmovm2b) where the
 * build has AVX512-BW (IQ2_S's layer 1.26x faster on Zen 4), else each 8 looked up whole.
 * (IQ2_XXS's and IQ3_XXS's 7 bits and parity put together for it: 1.17x slower; the IQ3
 * points by vpgatherdd instead of inserts: 1.7x slower.) */
static inline __m256i iqg_signs(const uint8_t *p) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_or_si256(_mm256_movm_epi8((__mmask32)iqg_u32(p)), _mm256_set1_epi8(1));
#else
    return iqg_points8(hs_iq_grids.signs64, p[0], p[1], p[2], p[3]);
#endif
}

/* The four 7-bit sign indices at bits 7 l of w (l < 4) -> the same 32 bytes. */
static inline __m256i iqg_ksigns(uint32_t w) {
    return iqg_points8(hs_iq_grids.ksigns64, w & 127, (w >> 7) & 127, (w >> 14) & 127,
                       (w >> 21) & 127);
}

/* A super-block b's D and its 16 scales sc (one per 16 columns; int8, 1 .. 31). */
static inline __attribute__((always_inline)) __m128i iqg_head(int fmt, const uint8_t *b,
                                                              float *D) {
    uint8_t s[16];
    switch (fmt) {
    case F_IQ2XXS: /* the top 4 bits of each group's second word */
    case F_IQ3XXS: {
        const uint8_t *w = b + (fmt == F_IQ2XXS ? 2 + 4 : 66);
        const int step = fmt == F_IQ2XXS ? 8 : 4;
        for (int k = 0; k < 8; k++) s[2 * k] = s[2 * k + 1] = (uint8_t)(2 * (w[step * k + 3] >> 4) + 1);
        *D = kq_f16(b) * (fmt == F_IQ2XXS ? 0.125f : 0.25f);
        break;
    }
    case F_IQ2XS: /* a byte per 32 columns: low nibble, then high, per 16 */
    case F_IQ2S: {
        const uint8_t *w = b + (fmt == F_IQ2XS ? 66 : 74);
        for (int k = 0; k < 8; k++)
            s[2 * k] = (uint8_t)(2 * (w[k] & 15) + 1), s[2 * k + 1] = (uint8_t)(2 * (w[k] >> 4) + 1);
        *D = kq_f16(b) * 0.125f;
        break;
    }
    case F_IQ3S: /* a nibble per 32 columns */
        for (int k = 0; k < 8; k++) s[2 * k] = s[2 * k + 1] = (uint8_t)(2 * ((b[106 + k / 2] >> (4 * (k % 2))) & 15) + 1);
        *D = kq_f16(b);
        break;
    case F_IQ1S: /* bits 12-14 of each group's qh */
        for (int k = 0; k < 8; k++) s[2 * k] = s[2 * k + 1] = (uint8_t)(2 * ((iqg_u16(b + 34 + 2 * k) >> 12) & 7) + 1);
        *D = kq_f16(b) * 0.125f;
        break;
    default: { /* IQ1_M: 3 bits per 16 columns, four to a 16-bit word whose top nibbles are d */
        uint16_t w[4];
        memcpy(w, b + 48, 8);
        for (int j = 0; j < 16; j++) s[j] = (uint8_t)(2 * ((w[j / 4] >> (3 * (j % 4))) & 7) + 1);
        const uint16_t h = (uint16_t)((w[0] >> 12) | ((w[1] >> 8) & 0x00F0) |
                                      ((w[2] >> 4) & 0x0F00) | (w[3] & 0xF000));
        *D = _cvtsh_ss(h) * 0.125f;
        break;
    }
    }
    return _mm_loadu_si128((const __m128i *)s);
}

/* Group k (columns 32 k .. 32 k + 31) of super-block b: |v| in *mag, v's signs in *sgn. */
static inline __attribute__((always_inline)) void iqg_group(int fmt, const uint8_t *b, int k,
                                                            __m256i *mag, __m256i *sgn) {
    const iq_grids_t *G = &hs_iq_grids;
    switch (fmt) {
    case F_IQ2XXS: {
        const uint32_t a0 = iqg_u32(b + 2 + 8 * k), a1 = iqg_u32(b + 6 + 8 * k);
        *mag = iqg_points8(G->iq2xxs, a0 & 255, (a0 >> 8) & 255, (a0 >> 16) & 255, a0 >> 24);
        *sgn = iqg_ksigns(a1);
        break;
    }
    case F_IQ2XS: {
        uint16_t e[4];
        memcpy(e, b + 2 + 8 * k, 8);
        *mag = iqg_points8(G->iq2xs, e[0] & 511, e[1] & 511, e[2] & 511, e[3] & 511);
        *sgn = iqg_points8(G->ksigns64, e[0] >> 9, e[1] >> 9, e[2] >> 9, e[3] >> 9);
        break;
    }
    case F_IQ2S: {
        const uint8_t *q = b + 2 + 4 * k;
        const unsigned h = b[66 + k];
        *mag = iqg_points8(G->iq2s, q[0] | (h & 3) << 8, q[1] | (h >> 2 & 3) << 8,
                           q[2] | (h >> 4 & 3) << 8, q[3] | (h >> 6 & 3) << 8);
        *sgn = iqg_signs(b + 34 + 4 * k);
        break;
    }
    case F_IQ3XXS: {
        const uint8_t *q = b + 2 + 8 * k;
        const unsigned idx[8] = {q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7]};
        *mag = iqg_points4(G->iq3xxs, idx);
        *sgn = iqg_ksigns(iqg_u32(b + 66 + 4 * k));
        break;
    }
    case F_IQ3S: {
        const uint8_t *q = b + 2 + 8 * k;
        const unsigned h = b[66 + k];
        unsigned idx[8];
        for (int j = 0; j < 8; j++) idx[j] = q[j] | ((h >> j) & 1) << 8;
        *mag = iqg_points4(G->iq3s, idx);
        *sgn = iqg_signs(b + 74 + 4 * k);
        break;
    }
    case F_IQ1S: {
        const uint8_t *q = b + 2 + 4 * k;
        const unsigned h = iqg_u16(b + 34 + 2 * k);
        const __m256i g = iqg_points8(G->iq1s, q[0] | (h & 7) << 8, q[1] | (h >> 3 & 7) << 8,
                                      q[2] | (h >> 6 & 7) << 8, q[3] | (h >> 9 & 7) << 8);
        const __m256i v = _mm256_add_epi8(g, _mm256_set1_epi8(h & 0x8000 ? -1 : 1));
        *mag = _mm256_abs_epi8(v), *sgn = v;
        break;
    }
    default: { /* IQ1_M: per 8 columns a nibble of qh, 3 index bits and the delta's sign */
        const uint8_t *q = b + 4 * k;
        const unsigned h0 = b[32 + 2 * k], h1 = b[33 + 2 * k];
        const unsigned n[4] = {h0 & 15, h0 >> 4, h1 & 15, h1 >> 4};
        const __m256i g = iqg_points8(G->iq1s, q[0] | (n[0] & 7) << 8, q[1] | (n[1] & 7) << 8,
                                      q[2] | (n[2] & 7) << 8, q[3] | (n[3] & 7) << 8);
        const long long one = 0x0101010101010101LL, minus = -1LL; /* bytes of +1 / -1 */
        const __m256i dl = _mm256_setr_epi64x(n[0] & 8 ? minus : one, n[1] & 8 ? minus : one,
                                              n[2] & 8 ? minus : one, n[3] & 8 ? minus : one);
        const __m256i v = _mm256_add_epi8(g, dl);
        *mag = _mm256_abs_epi8(v), *sgn = v;
        break;
    }
    }
}

#endif
