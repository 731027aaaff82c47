/* Microkernels shared by the routed-experts kernel (moe_kernels.c) and the plain int8 linear
 * (linear_kernels.c): the int16 activation rounding and the fp32 / int8 / int4 quads. Each quad
 * computes out[r][m] = sum_k W[r, k] * x[m, k] for one quad of rows r < 4 stored quad-
 * interleaved, against MB tokens (<= 3 fp32, <= 2 integer). */
#ifndef HETSERVE_MOE_QUADS_H
#define HETSERVE_MOE_QUADS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define MBMAX 4 /* tokens per microkernel call, at most (F32_MB, I8_MB; the others take 2) */
#include "moe_formats.h"
#include "simd.h"

#define F32_MB 3 /* tokens per quad_f32 call */
#ifdef HS_AVX512
#define I8_MB 4 /* tokens per quad_i8 call: 16 accumulators in AVX-512's 32 registers */
#else
#define I8_MB 2
#endif

/* int16 activations keep |x16| <= ACT_Q, so a vpmaddwd lane gains at most 2 * 127 * ACT_Q per
 * 16 inputs and KBLOCK inputs fit int32 exactly (KBLOCK/16 * 2 * 127 * 16383 < 2^31). */
#define ACT_Q 16383
#define KBLOCK 4096
/* W8A8 (moe_job.h's F_A8): the rows rounded to |x16| <= ACT_Q8 instead, the int8 range. */
#define ACT_Q8 127

/* quad_i8's inner loop length: 256 inputs where K allows (else 16). A run-time value on
 * purpose: with a compile-time length (or none, one loop over the whole row) GCC 12 gives the
 * accumulators a second register each and copies them back every 16 inputs, and a one-token
 * int8 layer streamed its weights ~1.1x slower (same results, only the loop's shape differs). */
static inline int i8_kstep(int K) {
    return K % 256 == 0 ? 256 : 16;
}

/* out[r][m] = sum_k W[r, k] * x16[m, k] for one quad of int8 rows and MB tokens (<= 2; <= 4 on
 * AVX-512, whose 32 registers hold 16 accumulators): 16 weights per vpmovsxbw + vpmaddwd, a
 * third of the uops of converting to fp32. Each token's sums run the same whatever MB is.
 * Quad layout: for each 16 inputs, the 4 rows' 16 bytes back to back, so a quad is one
 * sequential stream of whole cache lines (four strided row streams ran at half the speed:
 * prefetch-bound). */
static inline __attribute__((always_inline)) void quad_i8(const int8_t *q, int K,
                                                          const int16_t *const *x, int MB,
                                                          float out[4][MBMAX]) {
    const int kstep = i8_kstep(K);
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < MB; m++) out[r][m] = 0.0f;
    for (int kb = 0; kb < K; kb += KBLOCK) {
        int ke = kb + KBLOCK < K ? kb + KBLOCK : K;
        __m256i acc[4][4];
        for (int r = 0; r < 4; r++)
            for (int m = 0; m < MB; m++) acc[r][m] = _mm256_setzero_si256();
        for (int k0 = kb; k0 < ke; k0 += kstep) /* kstep: see i8_kstep */
            for (int k = k0; k < k0 + kstep; k += 16) {
                hs_prefetch_mb(q + 4 * k, MB);
                __m256i w[4];
                for (int r = 0; r < 4; r++)
                    w[r] = _mm256_cvtepi8_epi16(
                        _mm_loadu_si128((const __m128i *)(q + 4 * k + 16 * r)));
                for (int m = 0; m < MB; m++) {
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(x[m] + k));
                    for (int r = 0; r < 4; r++)
                        acc[r][m] = hs_dpwssd(acc[r][m], w[r], xv);
                }
            }
        for (int r = 0; r < 4; r++)
            for (int m = 0; m < MB; m++) out[r][m] += (float)hs_hsum_i32(acc[r][m]);
    }
}

#ifdef HS_AVX512
#define HS_U8ROWS 1
/* quad_i8 for W8A8 rows (moe_job.h's F_A8: |x16| <= 127), bytes times bytes: the same integer
 * sums per KBLOCK, so the same floats. vpdpbusd multiplies unsigned by signed bytes, so it
 * reads each row shifted, u = x16 + 128 in [1, 255] (quantize_rows' u8 rows), and the block's
 * 128 * sum(w) is taken off again (the weights' sums by one more vpdpbusd against ones, shared
 * by the MB tokens). A 64-byte chunk of the quad (16 inputs of its 4 rows) is one zmm, and the
 * token's 16 bytes broadcast to its four 128-bit lanes meet all 4 rows in one instruction: 64
 * multiply-adds, where vpdpwssd does 16 on the widened weights (which cost 4 vpmovsxbw more
 * per 16 inputs). Lanes: at most 4 * 255 * 128 per step, KBLOCK / 16 steps: < 2^26. */
_Static_assert(MBMAX == 4, "quad_u8 stores out[4][MBMAX] as one vector");
static inline __attribute__((always_inline)) void quad_u8(const int8_t *q, int K,
                                                          const uint8_t *const *x, int MB,
                                                          float out[4][MBMAX]) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 tot = _mm512_setzero_ps(); /* lane MBMAX * r + m: out[r][m] */
    for (int kb = 0; kb < K; kb += KBLOCK) {
        const int ke = kb + KBLOCK < K ? kb + KBLOCK : K;
        __m512i acc[MBMAX], ws = _mm512_setzero_si512();
        for (int m = 0; m < MBMAX; m++) acc[m] = _mm512_setzero_si512();
        for (int k = kb; k < ke; k += 16) {
            hs_prefetch_mb(q + 4 * k, MB);
            const __m512i w = _mm512_loadu_si512(q + 4 * k);
            ws = _mm512_dpbusd_epi32(ws, ones, w);
            for (int m = 0; m < MB; m++)
                acc[m] = _mm512_dpbusd_epi32(
                    acc[m], _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x[m] + k))),
                    w);
        }
        const __m512i off = _mm512_slli_epi32(ws, 7); /* 128 * the weights' sums */
        for (int m = 0; m < MB; m++) acc[m] = _mm512_sub_epi32(acc[m], off);
        /* 128-bit lane r of acc[m]: row r's 4 partial sums. A 4 x 4 transpose-and-add per
         * lane leaves lane r = row r's sums for tokens 0..3 (tokens past MB: zeros) */
        const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[0], acc[1]),
                                             _mm512_unpackhi_epi32(acc[0], acc[1]));
        const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2], acc[3]),
                                             _mm512_unpackhi_epi32(acc[2], acc[3]));
        const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23),
                                           _mm512_unpackhi_epi64(s01, s23));
        tot = _mm512_add_ps(tot, _mm512_cvtepi32_ps(s)); /* rounded as (float) rounds */
    }
    _mm512_storeu_ps(&out[0][0], tot);
}
#else
#define HS_U8ROWS 0
#endif

/* out[r][m] = the lane sum of v[MBMAX * r + m] for r < 4, m < MB (both quad_f32 forms): 8 slots
 * at a time through hs_hsum8, which sums every slot's lanes in the same order. */
static inline void quad_f32_out(const __m256 v[4 * MBMAX], int MB, float out[4][MBMAX]) {
    float sums[16];
    for (int half = 0; half < 2; half++) { /* (r, m) slots 0-7, then 8-11 padded with zeros */
        __m256 h[8];
        for (int i = 0; i < 8; i++) {
            int pr = 8 * half + i, m = pr % MBMAX;
            h[i] = pr < 4 * MBMAX && m < MB ? v[pr] : _mm256_setzero_ps();
        }
        _mm256_storeu_ps(sums + 8 * half, hs_hsum8(h));
    }
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < MB; m++) out[r][m] = sums[MBMAX * r + m];
}

/* fp32 weights in their plain row-major layout (the model's own tensors, no copy): rows
 * w[r * K ...] for r < 4 against MB <= 3 fp32 tokens; K % 8 == 0. The AVX2 build's form (see
 * the AVX-512 one below for what it does better): the 4 rows side by side. Three tokens give 12
 * independent FMA chains (two FMA ports x 4 cycles of latency need at least 8, and 8 left the
 * loop stalling on every hiccup) in the 16 ymm registers with the 3 tokens and one weight. */
static inline __attribute__((always_inline)) void quad_f32_avx2(const float *w, int K,
                                                           const float *const x[MBMAX], int MB,
                                                           float out[4][MBMAX]) {
    __m256 acc[4][MBMAX];
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < MB; m++) acc[r][m] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        __m256 xv[MBMAX];
        if ((k & 15) == 0) /* the next quad's rows (adjacent in memory): 4 rows x K ahead */
            for (int r = 0; r < 4; r++) _mm_prefetch((const char *)(w + (size_t)(4 + r) * K + k), PF_HINT);
        for (int m = 0; m < MB; m++) xv[m] = _mm256_loadu_ps(x[m] + k);
        for (int r = 0; r < 4; r++) {
            __m256 wv = _mm256_loadu_ps(w + (size_t)r * K + k);
            /* keep wv in a register: folded into each FMA it would be loaded MB times, and
             * the loop would be bound by loads rather than FMAs */
            __asm__("" : "+x"(wv));
            for (int m = 0; m < MB; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
        }
    }
    quad_f32_out(acc[0], MB, out); /* acc[r][m] is slot MBMAX * r + m */
}

#ifdef HS_AVX512
/* The AVX-512 build's quad_f32, 16 lanes. Each (row, token) sums into two accumulators (inputs
 * k mod 32 below 16, and the rest; a tail of K % 32 into the first), the same whatever MB is,
 * so a token's result is the same alone or batched. One token reads the rows one after the
 * other, so the quad is a single sequential stream (its rows are adjacent); 4 rows side by side
 * are 4 streams 4K bytes apart, which hold a one-token layer at K = 2048 to ~0.73 of the read
 * probe instead of ~0.91. Two or three tokens keep the rows side by side: each weight and
 * activation vector is then loaded once for all of them (24 accumulators in the 32 registers),
 * where rows one by one would reload the activations for every row. */
static inline __attribute__((always_inline)) void quad_f32(const float *w, int K,
                                                           const float *const x[MBMAX], int MB,
                                                           float out[4][MBMAX]) {
    __m512 acc[4][2][MBMAX];
    for (int r = 0; r < 4; r++)
        for (int u = 0; u < 2; u++)
            for (int m = 0; m < MB; m++) acc[r][u][m] = _mm512_setzero_ps();
    const int k32 = K - K % 32;
    if (MB == 1) {
        for (int r = 0; r < 4; r++) {
            const float *wr = w + (size_t)r * K;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            for (int k = 0; k < k32; k += 32) {
                hs_prefetch(wr + k); /* 2 lines per step; runs on into the next rows */
                hs_prefetch(wr + k + 16);
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k), _mm512_loadu_ps(x[0] + k), a0);
                a1 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k + 16), _mm512_loadu_ps(x[0] + k + 16),
                                     a1);
            }
            acc[r][0][0] = a0;
            acc[r][1][0] = a1;
        }
    } else {
        for (int k = 0; k < k32; k += 32) {
            for (int r = 0; r < 4; r++) { /* the next quad's rows (adjacent): 4 rows x K ahead */
                _mm_prefetch((const char *)(w + (size_t)(4 + r) * K + k), PF_HINT);
                _mm_prefetch((const char *)(w + (size_t)(4 + r) * K + k + 16), PF_HINT);
            }
            for (int u = 0; u < 2; u++) {
                __m512 xv[MBMAX];
                for (int m = 0; m < MB; m++) xv[m] = _mm512_loadu_ps(x[m] + k + 16 * u);
                for (int r = 0; r < 4; r++) {
                    __m512 wv = _mm512_loadu_ps(w + (size_t)r * K + k + 16 * u);
                    HS_PIN(wv); /* loaded once for the MB tokens, not folded into each FMA */
                    for (int m = 0; m < MB; m++)
                        acc[r][u][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][u][m]);
                }
            }
        }
    }
    for (int k = k32; k < K; k += 16) { /* K % 32 != 0: the last 8s into the first accumulator */
        const __mmask16 mk = K - k >= 16 ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        for (int r = 0; r < 4; r++) {
            const __m512 wv = _mm512_maskz_loadu_ps(mk, w + (size_t)r * K + k);
            for (int m = 0; m < MB; m++) {
                const __m512 xv = _mm512_maskz_loadu_ps(mk, x[m] + k);
                acc[r][0][m] = _mm512_fmadd_ps(wv, xv, acc[r][0][m]);
            }
        }
    }
    __m256 v[4 * MBMAX];
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < MB; m++) {
            const __m512 t = _mm512_add_ps(acc[r][0][m], acc[r][1][m]);
            const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1));
            v[MBMAX * r + m] = _mm256_add_ps(_mm512_castps512_ps256(t), hi);
        }
    quad_f32_out(v, MB, out);
}
#else
#define quad_f32 quad_f32_avx2
#endif

/* x16[p] = round(x[p] / scale[p]), scale[p] = max|x[p]| / lim, for rows [p0, p1) (lim: ACT_Q,
 * or ACT_Q8 for W8A8); with G > 0 also gsum[p, g] = sum of x16[p] over group g (exact: |sum|
 * <= 128 * ACT_Q < 2^24); with u8 (W8A8 on AVX-512, else NULL) also u8[p] = x16[p] + 128 as
 * bytes (quad_u8's rows).
 * perm = 1 stores each 8 in the order of the nibble tiles' pairs (tile_mxfp4, tile_i4):
 * [0 4 2 6 1 5 3 7]. */
static void quantize_rows(const float *x, int K, int p0, int p1, int16_t *x16, float *scale,
                          int perm, int G, float *gsum, int lim, uint8_t *u8) {
    /* K % 32 == 0 (checked by the caller). Vectorized, the reorder and the group sums too: at
     * one token this runs on one thread before and between the phases, where scalar loops
     * would take ~3 us of a ~200 us layer (2048 + 6 x 512 inputs). */
    const __m256i ord = _mm256_setr_epi8(0, 1, 8, 9, 4, 5, 12, 13, 2, 3, 10, 11, 6, 7, 14, 15,
                                         0, 1, 8, 9, 4, 5, 12, 13, 2, 3, 10, 11, 6, 7, 14, 15);
    const __m256i ones = _mm256_set1_epi16(1);
#if !HS_U8ROWS
    (void)u8; /* never asked for without AVX-512 */
#endif
    for (int p = p0; p < p1; p++) {
        const float *row = x + (size_t)p * K;
        int16_t *out = x16 + (size_t)p * K;
        float mx = hs_absmax(row, K);
        float s = mx > 0.0f ? mx / (float)lim : 1.0f;
        const __m256 inv = _mm256_set1_ps(1.0f / s);
        const __m256i hi = _mm256_set1_epi32(lim), lo = _mm256_set1_epi32(-lim);
        __m256i gacc = _mm256_setzero_si256(); /* the group's pair sums so far */
        for (int k = 0; k < K; k += 32) {
            for (int half = 0; half < 2; half++) {
                /* round to nearest even (MXCSR default), clamp, pack 2 x 8 int32 -> 16 int16 */
                const int k16 = k + 16 * half;
                __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k16), inv));
                __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k16 + 8), inv));
                a = _mm256_max_epi32(_mm256_min_epi32(a, hi), lo);
                b = _mm256_max_epi32(_mm256_min_epi32(b, hi), lo);
                __m256i h = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
                if (G > 0) { /* G % 16 == 0: int4 groups are 32, 64 or 128 (INT4_GROUP_SIZES) */
                    gacc = _mm256_add_epi32(gacc, _mm256_madd_epi16(h, ones));
                    if ((k16 + 16) % G == 0) {
                        gsum[(size_t)p * (K / G) + k16 / G] = (float)hs_hsum_i32(gacc);
                        gacc = _mm256_setzero_si256();
                    }
                }
#if HS_U8ROWS
                if (u8 != NULL) /* quad_u8's rows (lim = ACT_Q8, perm = 0): x16 + 128 */
                    _mm_storeu_si128((__m128i *)(u8 + (size_t)p * K + k16),
                                     _mm_xor_si128(_mm256_cvtepi16_epi8(h), _mm_set1_epi8(-128)));
#endif
                if (perm) h = _mm256_shuffle_epi8(h, ord); /* within each 8: 0 4 2 6 1 5 3 7 */
                _mm256_storeu_si256((__m256i *)(out + k16), h);
            }
        }
        scale[p] = s;
    }
}

/* int4: w = q * scale + minimum per group of G inputs, q in [0, 15], read 16 rows at a time
 * as MXFP4 is (moe_formats.h, tile_mxfp4): per 8 inputs, each row's 4 bytes (element 2i in
 * byte i's low nibble) at byte 4r, so each row owns a 32-bit lane. Per tile and group, the
 * nibbles (8G bytes) are followed by the 16 rows' fp32 scales and then their minimums, so a
 * tile is one stream (quant/layout.py, int4_group_tiles). Masks and shifts within 16-bit
 * lanes give elements (0, 4), (2, 6), (1, 5), (3, 7) of the 8, which meet the activation pairs
 * stored in that order (quantize_rows, perm = 1). With int16 activations, w . x16 = sum_g
 * scale_g * (q_g . x16_g) + minimum_g * sum(x16_g): the nibbles go straight into vpmaddwd
 * (exact per group: at most 128 products of 15 x 16383 per lane) and the minimum needs only
 * the group sums. */
#define I4_GROUP_BYTES(G) (8 * (size_t)(G) + 128)
#define I4_TILE_BYTES(K, G) ((size_t)((K) / (G)) * I4_GROUP_BYTES(G))

static inline __attribute__((always_inline)) void tile_i4(const uint8_t *q, int K, int G,
                                                          const int16_t *const x[2],
                                                          const float *const gs[2], int MB,
                                                          float out[][MBMAX]) {
#ifdef HS_AVX512
    const __m512i low = _mm512_set1_epi16(0x000F);
    __m512 tot[2];
    for (int m = 0; m < MB; m++) tot[m] = _mm512_setzero_ps();
    for (int g = 0; g < K / G; g++) {
        __m512i acc[2][2];
        for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
        const uint8_t *qg = q + I4_GROUP_BYTES(G) * g;
        for (int k = g * G; k < (g + 1) * G; k += 8) {
            const uint8_t *qc = qg + 8 * (size_t)(k - g * G); /* 16 rows x 4 bytes */
            hs_prefetch_mb(qc, MB);
            const __m512i v = _mm512_loadu_si512(qc);
            const __m512i w[4] = {_mm512_and_si512(v, low),
                                  _mm512_and_si512(_mm512_srli_epi16(v, 8), low),
                                  _mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                  _mm512_srli_epi16(v, 12)};
            for (int m = 0; m < MB; m++) tile_dot5(acc[m], w, x[m] + k);
        }
        const float *sz = (const float *)(qg + 8 * (size_t)G); /* 16 scales, 16 minimums */
        const __m512 s = _mm512_loadu_ps(sz), z = _mm512_loadu_ps(sz + TILE_ROWS);
        for (int m = 0; m < MB; m++) {
            tot[m] = _mm512_fmadd_ps(tile_sum5(acc[m]), s, tot[m]);
            tot[m] = _mm512_fmadd_ps(z, _mm512_set1_ps(gs[m][g]), tot[m]);
        }
    }
    tile_out5(tot, MB, out);
#else
    const __m256i low = _mm256_set1_epi16(0x000F);
    __m256 tot[2][2];
    for (int m = 0; m < MB; m++) tot[m][0] = tot[m][1] = _mm256_setzero_ps();
    for (int g = 0; g < K / G; g++) {
        const uint8_t *qg = q + I4_GROUP_BYTES(G) * g;
        const float *sz = (const float *)(qg + 8 * (size_t)G); /* 16 scales, 16 minimums */
        for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 */
            __m256i acc[2][2];
            for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
            for (int k = g * G; k < (g + 1) * G; k += 8) {
                const uint8_t *qc = qg + 8 * (size_t)(k - g * G);
                if (h == 0) hs_prefetch_mb(qc, MB);
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qc + 32 * h));
                const __m256i w[4] = {_mm256_and_si256(v, low),
                                      _mm256_and_si256(_mm256_srli_epi16(v, 8), low),
                                      _mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                      _mm256_srli_epi16(v, 12)};
                for (int m = 0; m < MB; m++) tile_dot(acc[m], w, x[m] + k);
            }
            const __m256 s = _mm256_loadu_ps(sz + 8 * h);
            const __m256 z = _mm256_loadu_ps(sz + TILE_ROWS + 8 * h);
            for (int m = 0; m < MB; m++) {
                tot[m][h] = _mm256_fmadd_ps(tile_sum(acc[m]), s, tot[m][h]);
                tot[m][h] = _mm256_fmadd_ps(z, _mm256_set1_ps(gs[m][g]), tot[m][h]);
            }
        }
    }
    tile_out(tot, MB, out);
#endif
}

#endif
