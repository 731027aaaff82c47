/* GEMM tiles for the packed formats (the GGUF K-quants q4_K, q5_K, q6_K, the i-quants IQ4_XS
 * and IQ4_NL, q8_0's grouped int8; MXFP4 and int4): what prefill runs where an expert
 * (moe_prefill.c) or a linear (linear_kernels.c) meets 8 tokens or more, so that published
 * and downloaded files prefill on the int8 tiles' arithmetic instead of the row kernels two
 * tokens at a time. The formats with a float scale per group of 32-128 columns (kg_group) take
 * the same panel and flush each group's integer sums into fp32 (kg_pack_i8g, kg_pack_mxfp4,
 * kg_pack_i4 and kg_strip_gemm below). For the K-quants:
 *
 * Each format's weight is an integer times a float per row and super-block of 256 columns,
 * w = d * v - dmin * m_j (q4_K, q5_K: v = sc_j * q, sc_j and m_j the 6-bit numbers of sub-block
 * j of 32 columns; q6_K: v = sc * (q - 32), sc per 16 columns, no minimum; IQ4_XS: v = (ls_j -
 * 32) * kv[q]). Every v fits int16 (|v| <= 63 * 31 for q5_K, 128 * 32 for q6_K, 32 * 127 for
 * IQ4_XS), so a strip of 16 rows is dequantized once into the int8 tiles' panel ([K / 2][16
 * rows][2] int16, moe_gemm.h) with d, dmin and m beside it, and the tokens' int8 activations
 * (q8_K: amax / 127 per super-block, the row kernels' own) are widened to int16. The tile sums
 * a super-block's 256 products per row and token exactly in int32 (|sum| <= 256 * 4096 * 127 <
 * 2^31); each super-block then adds sum * (d * xd) - M * (dmin * xd) to the token's fp32 row,
 * M = sum_j m_j * (the activations' sum over sub-block j), also exact in int32. So the only
 * difference from the row kernels is the order of the fp32 additions (they keep 8 lanes per
 * row and sum them at the end): a few ulps of the result, inside their tests' 2e-6 relative.
 *
 * Column order is the activations': the row kernels' for q2_K-q6_K and IQ4_XS (moe_kq.h,
 * kq_act_perm; the loader's codes read as they lie, each position's scale its lane's), natural
 * for IQ4_NL (its d per 32 columns) and the grid i-quants but those looked up by planes (their
 * plane order, moe_iqg.h iqg_planes_sb), q4_K's own for q4_K (moe_q4k.h: its x8
 * rows follow the weights' vectors, so each 16 bytes of a row's vector become 16 panel columns
 * as they lie). */
#ifndef HETSERVE_MOE_KGEMM_H
#define HETSERVE_MOE_KGEMM_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "moe_gemm.h"
#include "moe_job.h"
#include "moe_kq.h"
#include "moe_q4k.h"

/* The K-quants and IQ4_XS: an integer scale per sub-block, a float one per super-block. */
static inline int kg_fmt(int fmt) {
    return fmt == F_Q4K || fmt == F_Q5K || fmt == F_Q6K || fmt == F_IQ4XS || fmt == F_Q3K ||
           fmt == F_Q2K || iqg_fmt(fmt);
}

/* Columns per float scale of the formats with tiles here, 0 for none: 256 for kg_fmt; 32 for
 * IQ4_NL and MXFP4; G for int8 with fp16 scales per group of G (GGUF q8_0: 32) and for int4
 * (a scale and a minimum per group). int8, int4 and MXFP4 meet int16 activations (one scale
 * per row) that the tiles read in place. */
static inline int kg_group(int fmt, int G) {
    if (kg_fmt(fmt)) return Q4K_SB;
    if (fmt == F_IQ4NL || fmt == F_MXFP4) return 32;
    if (fmt == F_I4) return G; /* 32, 64 or 128 */
    return fmt == F_I8 && G > 0 && G % 16 == 0 ? G : 0;
}

static inline int kg_has_mins(int fmt) {
    return fmt == F_Q4K || fmt == F_Q5K || fmt == F_Q2K;
}

/* Minimum pairs per super-block: q4_K and q5_K have 8 minimums (one per 32 columns), q2_K 16
 * (one per 16). An activation row's sums per sub-block are kept KG_MS per super-block. */
#define KG_MS 16
static inline int kg_min_pairs(int fmt) {
    return fmt == F_Q2K ? 8 : 4;
}

/* One quad of a strip: q4_K quads live in pairs interleaved by 64-byte line (moe_q4k.h:
 * super-block s of quad i at base + 576 nq s, line l at + 64 (nq l + i)); grouped int8 quads
 * are moe_quads.h's with their fp16 scales sc [K / G][4]; the others' rows are the file's,
 * back to back (row r of the quad at base + r * K / 256 * kq_bytes). NULL: zeros. */
typedef struct {
    const uint8_t *base;
    int nq, i;
    const void *sc; /* grouped int8: fp16 [K / G][4]; MXFP4 (q[0] the strip's tile): e8m0 */
} kg_quad_t;

/* A strip dequantized: the panel and, per scale group g (kg_group's columns) and row r,
 * d [g][16]; per super-block s dmin [s][16] and the minimums as int16 pairs mins [s][8][16][2]
 * (pair p < kg_min_pairs: the sub-blocks whose activation sums kg_widen puts at 2p, 2p + 1); int4: its
 * minimums per group in dmin [g][16]. */
typedef struct {
    int16_t *panel, *mins;
    float *d, *dmin;
    int16_t *tmp; /* [16][256]: one super-block's rows before the transpose */
} kg_strip_t;

/* Bytes of a kg_strip_t's buffers for K columns (kg_strip_init carves them). */
static inline size_t kg_strip_bytes(int K) {
    const size_t nsb = (size_t)(K / Q4K_SB), ng = (size_t)(K / 16); /* groups: 16 columns or more */
    return (size_t)K * GEMM_ROWS * 2 + 2 * ng * GEMM_ROWS * 4 + nsb * 8 * GEMM_ROWS * 2 * 2 +
           GEMM_ROWS * Q4K_SB * 2;
}

static inline void kg_strip_init(kg_strip_t *s, char *buf, int K) {
    const size_t nsb = (size_t)(K / Q4K_SB);
    s->panel = (int16_t *)buf;
    s->d = (float *)(buf + (size_t)K * GEMM_ROWS * 2);
    s->dmin = s->d + (size_t)(K / 16) * GEMM_ROWS;
    s->mins = (int16_t *)(s->dmin + (size_t)(K / 16) * GEMM_ROWS);
    s->tmp = s->mins + nsb * 8 * GEMM_ROWS * 2;
}

/* 16 int8 v (signed: sx) times 16 int16 scales sc -> 16 int16 at dst. */
static inline void kg_put16(__m128i v, int sx, __m256i sc, int16_t *dst) {
    const __m256i w = sx ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
    _mm256_storeu_si256((__m256i *)dst, _mm256_mullo_epi16(w, sc));
}

/* 32 int8 v (column c .. c + 31), the first 16 scaled by s0, the next by s1. */
static inline void kg_put32(__m256i v, int sx, __m256i s0, __m256i s1, int16_t *dst) {
    kg_put16(_mm256_castsi256_si128(v), sx, s0, dst);
    kg_put16(_mm256_extracti128_si256(v, 1), sx, s1, dst + 16);
}

/* One q6_K / q5_K / q3_K / q2_K / IQ4_XS / IQ4_NL super-block b of a row -> v [256] in column
 * order, d (IQ4_NL: d [8], one per 32 columns) and, for q5_K and q2_K, dmin and m [8] / [16]. */
static inline void kg_row_sb(int fmt, const uint8_t *b, int16_t *v, float *d, float *dmin,
                             int16_t *m) {
#if HS_IQG_PLANES
    if (iqg_planes(fmt)) { /* looked up by planes, in the activations' plane order */
        iqg_planes_sb(fmt, b, v, d);
        return;
    }
#endif
    if (iqg_fmt(fmt)) { /* the grid i-quants: v = sign * point, scales per 16 columns */
        int8_t sc[16];
        _mm_storeu_si128((__m128i *)sc, iqg_head(fmt, b, d));
        for (int k = 0; k < 8; k++) {
            __m256i mag, sgn;
            iqg_group(fmt, b, k, &mag, &sgn);
            kg_put32(_mm256_sign_epi8(mag, sgn), 1, _mm256_set1_epi16(sc[2 * k]),
                     _mm256_set1_epi16(sc[2 * k + 1]), v + 32 * k);
        }
    } else if (fmt == F_Q3K || fmt == F_Q2K) { /* scales per 16 columns: column / 16 */
        int8_t sc[16];
        const uint8_t *h = fmt == F_Q3K ? b : NULL, *qs = b + (fmt == F_Q3K ? 32 : 16);
        if (fmt == F_Q3K) {
            _mm_storeu_si128((__m128i *)sc, q3k_scales(b + 96));
        } else {
            for (int j = 0; j < 16; j++) sc[j] = (int8_t)(b[j] & 15), m[j] = b[j] >> 4;
        }
        const __m256i off = _mm256_set1_epi8(fmt == F_Q3K ? 4 : 0);
        for (int n = 0; n < 2; n++) { /* lane i of half n's vectors: group 8 n + i */
            __m256i q[4], s0, s1;
            k2_values(qs, h, n, q);
            kq_lane_scales16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(sc + 8 * n))),
                             &s0, &s1);
            for (int i = 0; i < 4; i++)
                kg_put32(_mm256_sub_epi8(q[i], off), 1, s0, s1, v + 128 * n + 32 * i);
        }
        *d = kq_f16(b + (fmt == F_Q3K ? 108 : 80));
        if (fmt == F_Q2K) *dmin = kq_f16(b + 82);
    } else if (fmt == F_Q6K) {
        const __m256i off = _mm256_set1_epi8(32);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int n = 0; n < 2; n++) { /* lane i of half n's vectors: group 8 n + i */
            __m256i q[4], s0, s1;
            q6k_values(b, n, q);
            kq_lane_scales16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(sc + 8 * n))),
                             &s0, &s1);
            for (int i = 0; i < 4; i++)
                kg_put32(_mm256_sub_epi8(q[i], off), 1, s0, s1, v + 128 * n + 32 * i);
        }
        *d = kq_f16(b + 208);
    } else if (fmt == F_Q5K) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
        uint8_t sm[16];
        const __m128i sm4 = k4_unpack(b + 4);
        _mm_storeu_si128((__m128i *)sm, sm4);
        __m256i s0, s1; /* lane i of every vector: sub-block i */
        kq_lane_scales16(_mm_cvtepu8_epi16(sm4), &s0, &s1);
        for (int c = 0; c < 4; c++)
            for (int hh = 0; hh < 2; hh++)
                kg_put32(q5k_values(b, h, c, hh), 0, s0, s1, v + 32 * (2 * c + hh));
        for (int j = 0; j < 8; j++) m[j] = sm[8 + j];
        *d = kq_f16(b), *dmin = kq_f16(b + 2);
    } else if (fmt == F_IQ4NL) { /* 8 fp16 d, then the nibbles in the IQ4 kernels' order:
                                  * their d per 32 columns need the natural order here, so the
                                  * levels are put back (iq4_perm is its own inverse) */
        const __m256i lv =
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_LEVELS));
        const __m256i one = _mm256_set1_epi16(1);
        int8_t lev[Q4K_SB];
        for (int c = 0; c < 4; c++) {
            __m256i wl, wh;
            iq4_chunk(b + 16 + 32 * c, lv, &wl, &wh);
            _mm256_storeu_si256((__m256i *)(lev + 64 * c), wl);
            _mm256_storeu_si256((__m256i *)(lev + 64 * c + 32), wh);
        }
        iq4_perm(lev);
        for (int j = 0; j < 8; j++)
            kg_put32(_mm256_loadu_si256((const __m256i *)(lev + 32 * j)), 1, one, one, v + 32 * j);
        _mm256_storeu_ps(d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)));
    } else { /* IQ4_XS, in its activations' order (iq4_perm): chunk c's low nibbles are
              * positions 64 c .. + 31, its high ones 64 c + 32 .. + 63, and each 32 positions'
              * lane i (4 of them) is sub-block i, scale ls_i */
        const __m256i lv =
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_LEVELS));
        const __m256i ls = iq4xs_scales(b); /* ls - 32 for sub-blocks 0-7, on both lanes */
        __m256i s0, s1;
        kq_lane_scales16(_mm256_castsi256_si128(ls), &s0, &s1);
        for (int c = 0; c < 4; c++) {
            __m256i wl, wh;
            iq4_chunk(b + 8 + 32 * c, lv, &wl, &wh);
            kg_put32(wl, 1, s0, s1, v + 64 * c);
            kg_put32(wh, 1, s0, s1, v + 64 * c + 32);
        }
        *d = kq_f16(b);
    }
}

/* Quad i of a q4_K pair's super-block (sb: its first byte, nq quads interleaved) -> rows v [4]
 * [256] (v + 256 r) in q4_K's column order, d [4], dmin [4], m [4][KG_MS] (m + KG_MS r). Vector k's
 * 16 bytes of row r (sub-blocks 4 (k % 2) + i', 4 columns each) give columns 32 k .. + 15 (low
 * nibbles) and 32 k + 16 .. + 31 (high ones) of the activations' order. */
static inline void kg_q4k_sb(const uint8_t *sb, int nq, int i, int16_t *v, float *d, float *dmin,
                             int16_t *m) {
    const uint8_t *h = q4k_line(sb, nq, 0, i);
    uint8_t sc[32], mn[32];
    _mm256_storeu_si256((__m256i *)sc, q4k_six(h, 0));
    _mm256_storeu_si256((__m256i *)mn, q4k_six(h, 1));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int r = 0; r < 4; r++) {
        d[r] = kq_f16(h + 2 * r), dmin[r] = kq_f16(h + 8 + 2 * r);
        for (int j = 0; j < 8; j++) m[KG_MS * r + j] = mn[16 * (j / 4) + 4 * r + j % 4];
        for (int g = 0; g < 2; g++) { /* sub-blocks 4 g + i' of row r: bytes 16 g + 4 r + i' */
            int32_t four;
            memcpy(&four, sc + 16 * g + 4 * r, 4);
            const __m128i sb4 = _mm_shuffle_epi8(_mm_cvtsi32_si128(four), spread);
            const __m256i s = _mm256_cvtepu8_epi16(sb4);
            for (int k = g; k < 8; k += 2) {
                const __m128i b =
                    _mm_loadu_si128((const __m128i *)(q4k_line(sb, nq, 1 + k, i) + 16 * r));
                kg_put16(_mm_and_si128(b, low), 0, s, v + 256 * r + 32 * k);
                kg_put16(_mm_and_si128(_mm_srli_epi16(b, 4), low), 0, s, v + 256 * r + 32 * k + 16);
            }
        }
    }
}

/* Grouped int8 (G columns per fp16 scale): the quads as moe_gemm.h packs them, the scales
 * per group and row as floats. */
static inline void kg_pack_i8g(const kg_quad_t q[4], int K, int G, kg_strip_t *s) {
    static const int8_t zero[64];
    const int8_t *w[4];
    for (int t = 0; t < 4; t++) w[t] = (const int8_t *)q[t].base;
    gemm_pack_n(w, K, s->panel, zero);
    for (int g = 0; g < K / G; g++)
        for (int t = 0; t < 4; t++) {
            float *d = s->d + (size_t)GEMM_ROWS * g + 4 * t;
            if (q[t].base == NULL) {
                for (int r = 0; r < 4; r++) d[r] = 0.0f;
                continue;
            }
            const uint16_t *sc = (const uint16_t *)q[t].sc + 4 * g;
            _mm_storeu_ps(d, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)sc)));
        }
}

/* MXFP4: the strip is one tile of 16 rows (q->base, e8m0 scales q->sc [K / 32][16]), whose
 * decoded pair vectors (moe_formats.h's tile_mxfp4: 256 x the doubled code per int16, pairs in
 * the activations' order) are the panel's rows as they come: pair 4 c + i of block b is panel
 * row 16 b + 4 c + i; the scales e8m0_scaled8's. */
static inline void kg_pack_mxfp4(const kg_quad_t *q, int K, kg_strip_t *s) {
    const __m256i lut = mxfp4_lut();
    const uint8_t *e8 = (const uint8_t *)q->sc;
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *qb = q->base + 256 * (size_t)b;
        for (int c = 0; c < 4; c++)
            for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 */
                __m256i w[4];
                mxfp4_pairs(_mm256_loadu_si256((const __m256i *)(qb + 64 * c + 32 * h)), lut, w);
                for (int i = 0; i < 4; i++) {
                    const size_t kp = (size_t)16 * b + 4 * c + i;
                    _mm256_storeu_si256((__m256i *)(s->panel + (kp * GEMM_ROWS + 8 * h) * 2), w[i]);
                }
            }
        _mm256_storeu_ps(s->d + GEMM_ROWS * b, e8m0_scaled8(e8 + GEMM_ROWS * b));
        _mm256_storeu_ps(s->d + GEMM_ROWS * b + 8, e8m0_scaled8(e8 + GEMM_ROWS * b + 8));
    }
}

/* int4 (moe_quads.h's tile_i4): the strip is one tile of 16 rows at q->base, per group of G
 * its nibbles (8 G bytes: per 8 inputs each row's 4 bytes), then 16 fp32 scales and 16
 * minimums; the masks and shifts give pairs in the activations' order, panel row k / 2 + i for
 * the 8 inputs from k. */
static inline void kg_pack_i4(const kg_quad_t *q, int K, int G, kg_strip_t *s) {
    const __m256i low = _mm256_set1_epi16(0x000F);
    for (int g = 0; g < K / G; g++) {
        const uint8_t *qg = q->base + I4_GROUP_BYTES(G) * g;
        for (int k = g * G; k < (g + 1) * G; k += 8)
            for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 */
                const __m256i v =
                    _mm256_loadu_si256((const __m256i *)(qg + 8 * (size_t)(k - g * G) + 32 * h));
                const __m256i w[4] = {_mm256_and_si256(v, low),
                                      _mm256_and_si256(_mm256_srli_epi16(v, 8), low),
                                      _mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                      _mm256_srli_epi16(v, 12)};
                for (int i = 0; i < 4; i++) {
                    const size_t kp = (size_t)k / 2 + i;
                    _mm256_storeu_si256((__m256i *)(s->panel + (kp * GEMM_ROWS + 8 * h) * 2), w[i]);
                }
            }
        memcpy(s->d + (size_t)GEMM_ROWS * g, qg + 8 * (size_t)G, GEMM_ROWS * sizeof(float));
        memcpy(s->dmin + (size_t)GEMM_ROWS * g, qg + 8 * (size_t)G + 64, GEMM_ROWS * sizeof(float));
    }
}

/* Dequantizes the strip's 4 quads q (format fmt, G its int8 / int4 groups, K columns) into s. */
static inline void kg_pack(int fmt, int G, const kg_quad_t q[4], int K, kg_strip_t *s) {
    if (fmt == F_I4) {
        kg_pack_i4(q, K, G, s);
        return;
    }
    if (fmt == F_I8) {
        kg_pack_i8g(q, K, G, s);
        return;
    }
    if (fmt == F_MXFP4) {
        kg_pack_mxfp4(q, K, s);
        return;
    }
    const int nsb = K / Q4K_SB, bb = kq_bytes(fmt), nl = fmt == F_IQ4NL; /* IQ4_NL: 8 d per row */
    for (int sb = 0; sb < nsb; sb++) {
        float *d = s->d + GEMM_ROWS * sb, *dmin = s->dmin + GEMM_ROWS * sb;
        float dn[GEMM_ROWS][8];
        int16_t m[GEMM_ROWS][KG_MS];
        for (int t = 0; t < 4; t++) {
            int16_t *v = s->tmp + 4 * t * Q4K_SB;
            if (q[t].base == NULL) {
                memset(v, 0, 4 * Q4K_SB * sizeof(int16_t));
                memset(m[4 * t], 0, sizeof(m[0]) * 4);
                memset(dn[4 * t], 0, sizeof(dn[0]) * 4);
                for (int r = 0; r < 4 && !nl; r++) d[4 * t + r] = dmin[4 * t + r] = 0.0f;
            } else if (nl) {
                for (int r = 0; r < 4; r++)
                    kg_row_sb(fmt, q[t].base + ((size_t)r * nsb + sb) * bb, v + r * Q4K_SB,
                              dn[4 * t + r], NULL, NULL);
            } else if (fmt == F_Q4K) {
                kg_q4k_sb(q[t].base + (size_t)Q4K_QUAD_BYTES * q[t].nq * sb, q[t].nq, q[t].i, v,
                          d + 4 * t, dmin + 4 * t, m[4 * t]);
            } else {
                for (int r = 0; r < 4; r++)
                    kg_row_sb(fmt, q[t].base + ((size_t)r * nsb + sb) * bb, v + r * Q4K_SB,
                              d + 4 * t + r, dmin + 4 * t + r, m[4 * t + r]);
            }
        }
        /* [16 rows][128 pairs] -> panel [128 pairs][16 rows], 8 x 8 blocks of int32 */
        const float *src = (const float *)s->tmp;
        float *dst = (float *)(s->panel + (size_t)sb * Q4K_SB * GEMM_ROWS);
        for (int rb = 0; rb < GEMM_ROWS; rb += 8)
            for (int kb = 0; kb < Q4K_SB / 2; kb += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + (rb + i) * 128 + kb);
                hs_tr8(r);
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + (kb + i) * GEMM_ROWS + rb, r[i]);
            }
        for (int j = 0; j < 8 && nl; j++) /* IQ4_NL's d: group 8 sb + j of 32 columns */
            for (int r = 0; r < GEMM_ROWS; r++)
                s->d[(size_t)GEMM_ROWS * (8 * sb + j) + r] = dn[r][j];
        /* the minimums in pairs as kg_widen orders the sums: q4_K (p, p + 4), q5_K and q2_K
         * (2p, 2p + 1) */
        if (kg_has_mins(fmt)) {
            int16_t *mp = s->mins + (size_t)sb * 8 * GEMM_ROWS * 2;
            for (int p = 0; p < kg_min_pairs(fmt); p++)
                for (int r = 0; r < GEMM_ROWS; r++) {
                    mp[(p * GEMM_ROWS + r) * 2] = m[r][fmt == F_Q4K ? p : 2 * p];
                    mp[(p * GEMM_ROWS + r) * 2 + 1] = m[r][fmt == F_Q4K ? p + 4 : 2 * p + 1];
                }
        }
    }
}

/* One token's activation row for the tiles: the row kernels' int8 x8 [K] widened to x16 [K]
 * and (q4_K, q5_K, q2_K) its sums per sub-block, 8 (q2_K: 16) per super-block in the pairs'
 * order (ms [K / 256][KG_MS]), from gs (q4_K: its own order, already paired; q5_K: sums per 16
 * columns, added in twos; q2_K: those sums as they are). */
static inline void kg_widen(int fmt, const int8_t *x8, const int16_t *gs, int K, int16_t *x16,
                            int16_t *ms) {
    if (fmt == F_IQ4NL) { /* the row kernels' order put back to the columns' (kg_row_sb) */
        int8_t nat[Q4K_SB];
        for (int sb = 0; sb < K / Q4K_SB; sb++) {
            memcpy(nat, x8 + (size_t)sb * Q4K_SB, Q4K_SB);
            iq4_perm(nat);
            for (int k = 0; k < Q4K_SB; k += 16)
                _mm256_storeu_si256(
                    (__m256i *)(x16 + (size_t)sb * Q4K_SB + k),
                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(nat + k))));
        }
        return;
    }
    for (int k = 0; k < K; k += 16)
        _mm256_storeu_si256((__m256i *)(x16 + k),
                            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x8 + k))));
    if (!kg_has_mins(fmt)) return;
    for (int sb = 0; sb < K / Q4K_SB; sb++) {
        const int16_t *g = gs + 16 * sb;
        if (fmt == F_Q2K) {
            memcpy(ms + KG_MS * sb, g, 16 * sizeof(int16_t));
            continue;
        }
        for (int j = 0; j < 8; j++)
            ms[KG_MS * sb + j] = fmt == F_Q4K ? g[j] : (int16_t)(g[2 * j] + g[2 * j + 1]);
    }
}

/* next (or NULL): the next strip's bytes, fetched into L2 while the first tokens' tiles run
 * (gemm_strip's; 16 K bytes, at least a strip of any of these formats).
 * out[m][0..15] = the strip's rows against n tokens: their int16 rows (kg_widen's, or the
 * row-scaled formats' own) packed by gemm_pack_x (xp: the first token's group), per group of
 * gk columns the integer sums scaled by the rows' d and the token's scale xd[m][g gk / span]
 * (span: 256 for scales per super-block, K for one per row), less the minimums (q4_K, q5_K:
 * ms[m] the sub-block sums) or, for int4, plus its minimums times the token's group sums
 * xg[m][g]. isum: scratch [n][16]. The row kernels of
 * the GGUF formats keep 4-8 fp32 lanes per row and sum them at the end: there a token's output
 * in a batch of 8 or more differs from its own call by the order of fp32 additions (a few ulp,
 * and now and then one activation across a rounding boundary in the next phase); int4 and
 * MXFP4 give the same bits either way (below), as the int8 tiles do. */
static inline void kg_strip_gemm(const kg_strip_t *s, int fmt, int K, int gk, int span,
                                 const int32_t *xp, const float *const *xd,
                                 const int16_t *const *ms, const float *const *xg, int n,
                                 int32_t *isum, float *out, const char *next) {
    /* int4 and MXFP4: each row in its own lane in the row kernels too (tile_i4, tile_mxfp4), so
     * the same steps give the same bits: a token's output does not depend on its batch */
    const int mins = kg_has_mins(fmt), i4 = fmt == F_I4, lanes = i4 || fmt == F_MXFP4;
    for (int i = 0; i < n * GEMM_ROWS; i++) out[i] = 0.0f;
    for (int g = 0; g < K / gk; g++) {
        memset(isum, 0, sizeof(int32_t) * GEMM_ROWS * (size_t)n);
        for (int m0 = 0; m0 < n; m0 += GEMM_NT) {
            const int nt = n - m0 < GEMM_NT ? n - m0 : GEMM_NT;
            int32_t *c[GEMM_NT];
            for (int m = 0; m < nt; m++) c[m] = isum + (size_t)(m0 + m) * GEMM_ROWS;
            gemm_tile_n(s->panel, g * gk / 2, (g + 1) * gk / 2, xp + (size_t)m0 * (K / 2), c,
                        nt, m0 == 0 ? next : NULL);
        }
        const int xi = g * gk / span; /* the token's scale for this group */
        const float *dr = s->d + GEMM_ROWS * g, *dm = s->dmin + GEMM_ROWS * g;
        const int16_t *mp = s->mins + (size_t)g * 8 * GEMM_ROWS * 2;
        for (int m = 0; m < n; m++) {
            const __m256 xs = _mm256_set1_ps(xd[m][xi]);
            for (int h = 0; h < GEMM_ROWS; h += 8) {
                float *o = out + (size_t)m * GEMM_ROWS + h;
                const int32_t *im = isum + m * GEMM_ROWS + h;
                const __m256 is = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)im));
                if (lanes) { /* the row kernels' own steps: fma by the scale (int4: then by the
                              * minimum and the group sum); the token's scale at the end */
                    __m256 t = _mm256_fmadd_ps(is, _mm256_loadu_ps(dr + h), _mm256_loadu_ps(o));
                    if (i4)
                        t = _mm256_fmadd_ps(_mm256_loadu_ps(dm + h), _mm256_set1_ps(xg[m][g]), t);
                    _mm256_storeu_ps(o, t);
                    continue;
                }
                const __m256 dx = _mm256_mul_ps(_mm256_loadu_ps(dr + h), xs);
                __m256 acc = _mm256_add_ps(_mm256_loadu_ps(o), _mm256_mul_ps(is, dx));
                if (mins) { /* gk = 256: group g is super-block g */
                    __m256i M = _mm256_setzero_si256();
                    for (int p = 0; p < kg_min_pairs(fmt); p++) {
                        int32_t pair;
                        memcpy(&pair, ms[m] + KG_MS * g + 2 * p, 4);
                        const __m256i w = _mm256_loadu_si256(
                            (const __m256i *)(mp + (p * GEMM_ROWS + h) * 2));
                        M = _mm256_add_epi32(M, _mm256_madd_epi16(w, _mm256_set1_epi32(pair)));
                    }
                    const __m256 mx = _mm256_mul_ps(_mm256_loadu_ps(dm + h), xs);
                    acc = _mm256_sub_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(M), mx));
                }
                _mm256_storeu_ps(o, acc);
            }
        }
    }
    if (lanes) /* times the token's scale, as quad_int does */
        for (int m = 0; m < n; m++)
            for (int r = 0; r < GEMM_ROWS; r++) out[(size_t)m * GEMM_ROWS + r] *= xd[m][0];
}

#endif
