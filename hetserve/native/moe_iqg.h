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
 * types ran at 0.1-0.25 of the read bandwidth, bound by that. With AVX512-VBMI the grids of 4-byte
 * points (IQ3_XXS: 256, IQ3_S: 512) and IQ2_XXS's 256 points of 8 bytes are also kept as byte
 * planes (plane j: byte j of every point) and their row kernels look 64 points up at a time by
 * masked vpermi2b, 128 points each, the activations in plane order to match (iqg_planes; the
 * weights stay as the file has them). IQ2_XS (512 points of 8 bytes), IQ2_S (1024) and IQ1
 * (2048) keep the loads, on AVX-512 64 columns a vector with the rest vectorized (quad_iqgl). */
#ifndef HETSERVE_MOE_IQG_H
#define HETSERVE_MOE_IQG_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "moe_job.h"
#include "moe_q4k.h"

typedef struct {
    const uint64_t *iq2xxs, *iq2xs, *iq2s, *iq1s; /* 8 bytes a point (IQ1: int8, times 8) */
    const uint32_t *iq3xxs, *iq3s;                /* 4 bytes a point */
    uint64_t signs64[256];  /* 8 sign bits -> 8 bytes of -1 (bit set) or +1 */
    uint64_t ksigns64[128]; /* 7 sign bits and their parity -> the same */
    /* Byte planes of the grids with at most 512 points of 4 bytes or 256 of 8 (HS_IQG_PLANES):
     * plane j holds byte j of every point, so that vpermi2b looks 64 points up at once. */
    uint8_t p3xxs[4][256] __attribute__((aligned(64)));
    uint8_t p3s[4][512] __attribute__((aligned(64)));
    uint8_t p2xxs[8][256] __attribute__((aligned(64)));
    /* IQ2_XXS's two super-blocks' 64 points from their 128 bytes at 2 (vpermt2b indices):
     * pick2[0] their index bytes, [1] their sign-and-scale bytes */
    uint8_t pick2[2][64] __attribute__((aligned(64)));
} iq_grids_t;
extern iq_grids_t hs_iq_grids; /* gguf_rows.c: set by hetserve_iq_grids */

static inline int iqg_fmt(int fmt) {
    return fmt >= F_IQ2XXS && fmt <= F_IQ1M;
}

/* Where the build has AVX512-VBMI and BITALG (Zen 4 and 5, Ice Lake and later Xeons), the row
 * kernels of IQ3_XXS, IQ3_S and IQ2_XXS look a super-block's points up in registers, a byte
 * plane at a time (quad_iqg4 and quad_iqg8 below): their activations are then in plane order
 * (iqg_plane_perm), and iqg_planes says how many planes a format has (bytes a point; 0: the
 * file's order, the points put together per 8 or 4 columns as below). */
#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#define HS_IQG_PLANES 1
#else
#define HS_IQG_PLANES 0
#endif

/* The formats with planes kernels (on the builds that have them). */
static inline int iqg_planes_fmt(int fmt) {
    return fmt == F_IQ3XXS || fmt == F_IQ3S || fmt == F_IQ2XXS;
}

static inline int iqg_planes(int fmt) {
    if (!HS_IQG_PLANES || !iqg_planes_fmt(fmt)) return 0;
    return fmt == F_IQ3XXS || fmt == F_IQ3S ? 4 : 8;
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

/* IQ1_M's fp16 d: the top nibbles of its four scale words (at 48), lowest word first. */
static inline float iq1m_d(const uint8_t *b) {
    uint64_t u;
    memcpy(&u, b + 48, 8);
    return _cvtsh_ss((uint16_t)(((u >> 12) & 0x000F) | ((u >> 24) & 0x00F0) |
                                ((u >> 36) & 0x0F00) | ((u >> 48) & 0xF000)));
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
        *D = iq1m_d(b) * 0.125f;
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

/* A super-block's exact integer sum t into a row's fp32 total, the same expression in every
 * grid kernel below (and so the same fma where the compiler contracts it): the planes kernels
 * of the AVX-512 VBMI build give the AVX2 build's bits. */
static inline void iqg_add(float *tot, int t, float D, float xd) {
    *tot += (float)t * (D * xd);
}

#ifdef HS_AVX512
/* IQ2_XS, IQ2_S, IQ1_S and IQ1_M on AVX-512 (quad_iqgl in moe_kq.h): 64 columns a vector.
 * Their grids (512, 1024 and 2048 points) are too large for one plane pair's in-register
 * lookups, so each point still costs a load; what these helpers take off the file-order path
 * is the rest: a super-block's 32 indices (and IQ1's deltas' signs) are put together in one
 * vector (vpermw, vpsrlvw) instead of ~5 scalar steps a point, and its 16 scales in another
 * instead of a byte array read back as a vector (a store-forwarding stall every super-block). */

/* A super-block's 16 scales 2 s + 1 (one per 16 columns, as dwords) and its D. */
static inline __attribute__((always_inline)) __m512i iqgl_head(int fmt, const uint8_t *b,
                                                               float *D) {
    __m512i w, sh;
    int bits = 7;
    if (fmt == F_IQ2S || fmt == F_IQ2XS) { /* a byte per 32 columns: low nibble, then high */
        const __m128i s8 = _mm_loadl_epi64((const __m128i *)(b + (fmt == F_IQ2S ? 74 : 66)));
        w = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(s8, s8));
        sh = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        bits = 15, *D = kq_f16(b) * 0.125f;
    } else if (fmt == F_IQ1S) { /* bits 12-14 of the qh word of each 32 columns */
        const __m128i qh = _mm_loadu_si128((const __m128i *)(b + 34));
        w = _mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
            _mm512_cvtepu16_epi32(_mm256_castsi128_si256(qh)));
        sh = _mm512_set1_epi32(12);
        *D = kq_f16(b) * 0.125f;
    } else { /* IQ1_M: 3 bits per 16 columns, four to a word whose top nibbles are d */
        const __m128i words = _mm_loadl_epi64((const __m128i *)(b + 48));
        w = _mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
            _mm512_cvtepu16_epi32(_mm256_castsi128_si256(words)));
        sh = _mm512_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9);
        *D = iq1m_d(b) * 0.125f;
    }
    const __m512i sv = _mm512_and_si512(_mm512_srlv_epi32(w, sh), _mm512_set1_epi32(bits));
    return _mm512_or_si512(_mm512_slli_epi32(sv, 1), _mm512_set1_epi32(1));
}

/* A super-block's 32 point indices into idx and, for IQ1, the points whose delta is -1/8 as a
 * mask (bit p: point p, columns 8 p .. 8 p + 7; else 0); for IQ2_XS its points' sign bytes
 * (7 bits and their parity) into sg. */
static inline __attribute__((always_inline)) __mmask32 iqgl_index(int fmt, const uint8_t *b,
                                                                  uint16_t *idx, uint8_t *sg) {
    __m512i qs, h, hb, neg = _mm512_setzero_si512();
    if (fmt == F_IQ2XS) { /* a word a point: 9 index bits, 7 sign bits */
        const __m512i e = _mm512_loadu_si512((const void *)(b + 2));
        const __m512i s7 = _mm512_srli_epi16(e, 9);
        __m512i p = _mm512_xor_si512(s7, _mm512_srli_epi16(s7, 4)); /* parity by folding */
        p = _mm512_xor_si512(p, _mm512_srli_epi16(p, 2));
        p = _mm512_xor_si512(p, _mm512_srli_epi16(p, 1));
        p = _mm512_slli_epi16(_mm512_and_si512(p, _mm512_set1_epi16(1)), 7);
        _mm256_store_si256((__m256i *)sg, _mm512_cvtepi16_epi8(_mm512_or_si512(s7, p)));
        _mm512_store_si512((void *)idx, _mm512_and_si512(e, _mm512_set1_epi16(511)));
        return 0;
    }
    if (fmt == F_IQ2S || fmt == F_IQ1S) { /* a qh byte (IQ2_S) or word (IQ1_S) per 4 points */
        const int s1 = fmt == F_IQ1S;
        qs = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 2)));
        const __m512i words =
            s1 ? _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b + 34)))
               : _mm512_castsi256_si512(
                     _mm256_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(b + 66))));
        const __m512i w = _mm512_permutexvar_epi16(
            _mm512_set_epi16(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4, 3, 3, 3, 3, 2, 2, 2,
                             2, 1, 1, 1, 1, 0, 0, 0, 0),
            words);
        /* point l of each 4: bits 3 l .. 3 l + 2 (IQ1_S, the delta's sign at 15) or 2 l, 2 l + 1 */
        h = _mm512_srlv_epi16(w, s1 ? _mm512_set4_epi32(0x00090006, 0x00030000, 0x00090006,
                                                        0x00030000)
                                    : _mm512_set4_epi32(0x00060004, 0x00020000, 0x00060004,
                                                        0x00020000));
        hb = _mm512_and_si512(h, _mm512_set1_epi16(s1 ? 7 : 3));
        if (s1) neg = _mm512_and_si512(w, _mm512_set1_epi16((short)0x8000));
    } else { /* IQ1_M: a nibble of qh a point, 3 index bits and the delta's sign at 3 */
        qs = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)b));
        const __m512i w = _mm512_permutexvar_epi16(
            _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8, 7, 7, 6,
                             6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
            _mm512_castsi256_si512(
                _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 32)))));
        h = _mm512_srlv_epi16(w, _mm512_set1_epi32(0x00040000));
        hb = _mm512_and_si512(h, _mm512_set1_epi16(7));
        neg = _mm512_and_si512(h, _mm512_set1_epi16(8));
    }
    _mm512_store_si512((void *)idx, _mm512_or_si512(qs, _mm512_slli_epi16(hb, 8)));
    return _mm512_test_epi16_mask(neg, neg);
}

/* Points ix[0 .. 7] of the grid g -> one vector (columns 8 l .. 8 l + 7 from point l). The
 * indices are read back from memory as two words of four and split by shifts: the compiler's
 * own choice, a vpextrw each, was ~10% slower. */
static inline __attribute__((always_inline)) __m512i iqgl_points(const uint64_t *g,
                                                                 const uint16_t *ix16) {
    uint64_t w0, w1;
    memcpy(&w0, ix16, 8), memcpy(&w1, ix16 + 4, 8);
    const __m128i p0 = _mm_insert_epi64(_mm_loadl_epi64((const __m128i *)(g + (w0 & 0xFFFF))),
                                        (long long)g[w0 >> 16 & 0xFFFF], 1);
    const __m128i p1 = _mm_insert_epi64(
        _mm_loadl_epi64((const __m128i *)(g + (w0 >> 32 & 0xFFFF))), (long long)g[w0 >> 48], 1);
    const __m128i p2 = _mm_insert_epi64(_mm_loadl_epi64((const __m128i *)(g + (w1 & 0xFFFF))),
                                        (long long)g[w1 >> 16 & 0xFFFF], 1);
    const __m128i p3 = _mm_insert_epi64(
        _mm_loadl_epi64((const __m128i *)(g + (w1 >> 32 & 0xFFFF))), (long long)g[w1 >> 48], 1);
    const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(p0), p1, 1);
    const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(p2), p3, 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
#endif

#if HS_IQG_PLANES
/* vpshufbitqmb's bit indices for plane j of a 4-byte grid: mask bit p (point p) from bit
 * 4 (p % 8) + j of qword p / 8, that qword holding the signs of columns 32 (p / 8) ..+ 31. */
static inline __m512i iqg_sign_bits4(int j) {
    return _mm512_add_epi8(_mm512_set1_epi64(0x1C1814100C080400LL), _mm512_set1_epi8((char)j));
}

/* Seven sign bits per byte (bits 0-6) -> the eighth, their parity, at bit 7. */
static inline __m512i iqg_parity(__m512i s7) {
    const __m512i par = _mm512_and_si512(_mm512_popcnt_epi8(s7), _mm512_set1_epi8(1));
    return _mm512_or_si512(s7, _mm512_slli_epi16(par, 7)); /* bit 0 of each byte to bit 7 */
}

/* The 7-bit sign fields at bits 7 l (l < 4) of the dword in each qword's low half (hi = 0),
 * or of both dwords (hi = 1: bytes 4-7 from the high one) -> bytes with their parity. */
static inline __m512i iqg_ksign_bytes(__m512i words, int hi) {
    const __m512i ctl = _mm512_set1_epi64(0x352E2720150E0700LL);
    const __m512i s7 = _mm512_and_si512(_mm512_multishift_epi64_epi8(ctl, words),
                                        _mm512_set1_epi64(hi ? 0x7F7F7F7F7F7F7F7FLL
                                                             : 0x000000007F7F7F7FLL));
    return iqg_parity(s7);
}

/* One or two super-blocks of a planes format ready for its planes: the points' index bytes
 * qi (64 points: IQ3's one super-block, IQ2's two, the second's half zero where there is none)
 * with the masks choosing each masked vpermi2b's 128 points, the signs (sg), the scales per
 * lane q of vpdpbusd's sums, i.e. of points 4 q .. 4 q + 3, and D per super-block. */
typedef struct {
    __m512i qi, sg, sc;
    __mmask64 km[4];
    int fmt, nh; /* masked vpermi2b per plane */
    float D[2];
} iqg_sb_t;

/* IQ3_XXS / IQ3_S super-block b: 64 points of 4 bytes, scales per 32 columns (8 points). */
static inline __attribute__((always_inline)) void iqg4_load(int fmt, const uint8_t *b,
                                                            iqg_sb_t *S) {
    const int s3 = fmt == F_IQ3S;
    const __m512i qi = _mm512_loadu_si512((const void *)(b + 2));
    const __mmask64 k7 = _mm512_movepi8_mask(qi);
    __mmask64 kh = 0;
    __m512i sc;
    if (s3) { /* a nibble per 32 columns */
        memcpy(&kh, b + 66, 8); /* bit p: bit 8 of point p's index */
        S->sg = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)(b + 74)));
        sc = _mm512_srlv_epi32(_mm512_set1_epi32((int)iqg_u32(b + 106)),
                               _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24,
                                                 24, 28, 28));
    } else { /* group k's sign-and-scale word in qword k */
        const __m512i w = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)(b + 66)));
        S->sg = iqg_ksign_bytes(w, 0);
        sc = _mm512_srli_epi32(
            _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10,
                                                       12, 12, 14, 14), w), 28);
    }
    S->qi = qi, S->fmt = fmt, S->nh = s3 ? 4 : 2;
    S->sc = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(sc, _mm512_set1_epi32(15)), 1),
                            _mm512_set1_epi32(1));
    S->km[0] = ~(k7 | kh), S->km[1] = k7 & ~kh, S->km[2] = ~k7 & kh, S->km[3] = k7 & kh;
    S->D[0] = kq_f16(b) * (s3 ? 1.0f : 0.25f);
}

/* IQ2_XXS super-blocks b0 and b1 (NULL: none): 32 points of 8 bytes each. */
static inline __attribute__((always_inline)) void iqg8_load(int fmt, const uint8_t *b0,
                                                            const uint8_t *b1, iqg_sb_t *S) {
    const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi32(1);
    const __m512i A = _mm512_loadu_si512((const void *)(b0 + 2));
    const __m512i B = b1 ? _mm512_loadu_si512((const void *)(b1 + 2)) : zero;
    const uint8_t(*pick)[64] = hs_iq_grids.pick2;
    const __m512i qi = _mm512_permutex2var_epi8(A, _mm512_load_si512((const void *)pick[0]), B);
    /* aux: dword g the sign-and-scale word of group g */
    const __m512i aux = _mm512_permutex2var_epi8(A, _mm512_load_si512((const void *)pick[1]), B);
    const __mmask64 k7 = _mm512_movepi8_mask(qi);
    S->km[0] = ~k7, S->km[1] = k7;
    S->sg = iqg_ksign_bytes(aux, 1); /* byte p: point p's 8 signs */
    S->sc = _mm512_or_si512(_mm512_slli_epi32(_mm512_srli_epi32(aux, 28), 1), one);
    S->qi = qi, S->fmt = fmt, S->nh = 2;
    S->D[0] = kq_f16(b0) * 0.125f, S->D[1] = b1 ? kq_f16(b1) * 0.125f : 0.0f;
}

/* Plane j: byte j of every point (|v|), by S->nh masked vpermi2b of 128 points each. */
static inline __attribute__((always_inline)) __m512i iqg_plane(const iqg_sb_t *S, int j) {
    const uint8_t *t = S->fmt == F_IQ3S     ? hs_iq_grids.p3s[j]
                       : S->fmt == F_IQ3XXS ? hs_iq_grids.p3xxs[j]
                                            : hs_iq_grids.p2xxs[j];
    const __m512i *T = (const __m512i *)t;
    __m512i mag = S->qi;
    for (int h = 0; h < S->nh; h++)
        mag = _mm512_mask2_permutex2var_epi8(T[2 * h], mag, S->km[h], T[2 * h + 1]);
    return mag;
}

/* The points whose byte j is negative, as a mask (bit p: point p). */
static inline __attribute__((always_inline)) __mmask64 iqg_neg(const iqg_sb_t *S, int j) {
    if (S->fmt == F_IQ3S || S->fmt == F_IQ3XXS)
        return _mm512_bitshuffle_epi64_mask(S->sg, iqg_sign_bits4(j));
    return _mm512_test_epi8_mask(S->sg, _mm512_set1_epi8((char)(1 << j)));
}

/* A quad of IQ3_XXS or IQ3_S rows (4-byte points, 64 per super-block) against MB <= 2
 * tokens whose activations are in plane order: per plane j one vector of 64 points' byte j,
 * looked up from the plane's table (256 or 512 bytes) by 2 or 4 masked vpermi2b, each
 * choosing its 128 points by the index's bits 7 (and 8); the signs of plane j's columns
 * gathered into a mask (vpshufbitqmb) and put on the activations; vpdpbusd's lane q then sums
 * columns 16 q .. 16 q + 15 over the planes, one scale each. The same integer per super-block
 * as quad_iqg, so the same bits. */
static inline __attribute__((always_inline)) void quad_iqg4(const uint8_t *q, int fmt, int K,
                                                            const q4k_act_t a[2], int MB,
                                                            float out[][MBMAX]) {
    const int nsb = K / Q4K_SB, bb = iqg_bytes(fmt);
    const __m512i zero = _mm512_setzero_si512();
    for (int r = 0; r < 4; r++) {
        const uint8_t *row = q + (size_t)r * nsb * bb;
        float tot[2] = {0.0f, 0.0f};
        for (int s = 0; s < nsb; s++) {
            const uint8_t *b = row + (size_t)s * bb;
            for (int o = 0; o < bb; o += 64) hs_prefetch_mb(b + o, MB);
            iqg_sb_t S;
            iqg4_load(fmt, b, &S);
            __m512i acc[2] = {zero, zero};
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const __m512i mag = iqg_plane(&S, j);
                const __mmask64 neg = iqg_neg(&S, j);
                for (int m = 0; m < MB; m++) {
                    const __m512i x =
                        _mm512_loadu_si512((const void *)(a[m].x + (size_t)s * Q4K_SB + 64 * j));
                    const __m512i sx = _mm512_mask_sub_epi8(x, neg, zero, x);
                    acc[m] = _mm512_dpbusd_epi32(acc[m], mag, sx);
                }
            }
            for (int m = 0; m < MB; m++)
                iqg_add(&tot[m], _mm512_reduce_add_epi32(_mm512_mullo_epi32(acc[m], S.sc)),
                        S.D[0], a[m].d[s]);
        }
        for (int m = 0; m < MB; m++) out[r][m] = tot[m];
    }
}

/* A quad of IQ2_XXS rows (8-byte points, 32 per super-block) against MB <= 2 tokens in plane
 * order, two super-blocks a vector (points 0-31 the first's, 32-63 the second's; an odd last
 * one alone, the other half zero): per plane one vector of the 64 points' byte j by two masked
 * vpermi2b; vpdpbusd's lane q sums points 4 q .. 4 q + 3, i.e. group q % 8 (32 columns, one
 * scale) of super-block s + q / 8, over the 8 planes. (IQ2_XS, a scale per 16 columns and 512
 * points, took four vpermi2b a plane and a second sum for its first two points: 25 ns a
 * super-block on one core where its points' loads take 20, quad_iqgl in moe_kq.h.) */
static inline __attribute__((always_inline)) void quad_iqg8(const uint8_t *q, int fmt, int K,
                                                            const q4k_act_t a[2], int MB,
                                                            float out[][MBMAX]) {
    const int nsb = K / Q4K_SB, bb = iqg_bytes(fmt);
    const __m512i zero = _mm512_setzero_si512();
    for (int r = 0; r < 4; r++) {
        const uint8_t *row = q + (size_t)r * nsb * bb;
        float tot[2] = {0.0f, 0.0f};
        for (int s = 0; s < nsb; s += 2) {
            const int two = s + 1 < nsb;
            const uint8_t *b0 = row + (size_t)s * bb;
            for (int o = 0; o < bb * (1 + two); o += 64) hs_prefetch_mb(b0 + o, MB);
            iqg_sb_t S;
            iqg8_load(fmt, b0, two ? b0 + bb : NULL, &S);
            __m512i acc[2] = {zero, zero};
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m512i mag = iqg_plane(&S, j);
                const __mmask64 neg = iqg_neg(&S, j);
                for (int m = 0; m < MB; m++) {
                    const int8_t *x = a[m].x + (size_t)s * Q4K_SB + 32 * j;
                    const __m256i x0 = _mm256_loadu_si256((const __m256i *)x);
                    const __m256i x1 = two ? _mm256_loadu_si256((const __m256i *)(x + Q4K_SB))
                                           : _mm256_setzero_si256();
                    __m512i xx = _mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1);
                    xx = _mm512_mask_sub_epi8(xx, neg, zero, xx);
                    acc[m] = _mm512_dpbusd_epi32(acc[m], mag, xx);
                }
            }
            for (int m = 0; m < MB; m++) {
                const __m512i t = _mm512_mullo_epi32(acc[m], S.sc);
                iqg_add(&tot[m], hs_hsum_i32(_mm512_castsi512_si256(t)), S.D[0], a[m].d[s]);
                if (two)
                    iqg_add(&tot[m], hs_hsum_i32(_mm512_extracti64x4_epi64(t, 1)), S.D[1],
                            a[m].d[s + 1]);
            }
        }
        for (int m = 0; m < MB; m++) out[r][m] = tot[m];
    }
}

/* One planes-format super-block b as the prefill tiles' v [256] int16 (sc * v, in plane
 * order, the activations' own) and its D. */
static inline void iqg_planes_sb(int fmt, const uint8_t *b, int16_t *v, float *d) {
    const int n = iqg_planes(fmt), np = 256 / n;
    iqg_sb_t S;
    if (n == 4) iqg4_load(fmt, b, &S);
    else iqg8_load(fmt, b, NULL, &S);
    /* each point's scale as a byte: lane q's low byte to its 4 bytes */
    const __m512i bcast = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0x00000000);
    const __m512i scp = _mm512_shuffle_epi8(S.sc, bcast);
    const __m512i sc16[2] = {_mm512_cvtepu8_epi16(_mm512_castsi512_si256(scp)),
                             _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(scp, 1))};
    for (int j = 0; j < n; j++) {
        const __m512i mag = iqg_plane(&S, j);
        const __mmask64 neg = iqg_neg(&S, j);
        for (int h = 0; h < np / 32; h++) {
            const __m256i m8 = h ? _mm512_extracti64x4_epi64(mag, 1) : _mm512_castsi512_si256(mag);
            const __m512i w = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(m8), sc16[h]);
            _mm512_storeu_si512((void *)(v + np * j + 32 * h),
                                _mm512_mask_sub_epi16(w, (__mmask32)(neg >> (32 * h)),
                                                      _mm512_setzero_si512(), w));
        }
    }
    *d = S.D[0];
}
#endif

#endif
