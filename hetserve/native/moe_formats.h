/* Microkernels of the routed-experts kernel for the formats checkpoints publish, beside the
 * int8 / int4 / fp32 ones in moe_kernels.c: int8 with a scale per group of columns (GGUF
 * q8_0), MXFP4 (gpt-oss: e2m1 codes with an e8m0 scale per 32) and FP8 e4m3 with a scale per
 * group of columns (DeepSeek-V3 / Qwen3 FP8 block scales, one value per row and block).
 *
 * Each computes out[r][m] = sum_k W[r, k] * x[m, k] for one quad of rows r < 4 stored quad-
 * interleaved (for every 16 input bytes, the 4 rows' 16 bytes back to back), group parameters
 * stored [group][4 rows]; MXFP4 for a tile of 16 rows (tile_mxfp4). The integer ones take
 * int16 activations (see quantize_rows in moe_kernels.c) and leave the activation scale to the
 * caller; FP8 takes fp32 activations (or, on the bf16 path, two bf16 rows).
 */
#ifndef HETSERVE_MOE_FORMATS_H
#define HETSERVE_MOE_FORMATS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#ifndef MBMAX
#define MBMAX 4
#endif

/* Software prefetch distance in bytes. One cache line per loop iteration is consumed; the
 * out-of-order window alone keeps only ~15 lines in flight (~10 GB/s per core at DRAM latency),
 * so the stream is prefetched ahead (it runs into the next unit, which is adjacent). Every line
 * is asked for (leaving three in four to the hardware prefetcher ran 1.5-1.9x slower), once,
 * 8 KiB ahead: a one-token layer runs alike anywhere from 6 to 16 KiB, and slower nearer. */
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T0
#endif
#ifndef PF_DIST
#define PF_DIST 8192
#endif

/* Prefetches the stream at p (the line being read) PF_DIST ahead. always_inline: as a plain
 * static inline, GCC 12 compiled the MXFP4 tile's caller ~1.15x slower, though no call was
 * left. */
static inline __attribute__((always_inline)) void hs_prefetch(const void *p) {
    _mm_prefetch((const char *)p + PF_DIST, PF_HINT);
}

/* hs_prefetch for a kernel that reads each line for MB tokens. With MB >= 2 a line costs MB + 1
 * multiplies or more, and at 32 tokens (64 experts of 2048 x 512, top-6: ~3 tokens an expert)
 * the int8 layer read 0.57-0.68 of the probe when memory is fast (~50 GB/s, 2 threads): the
 * out-of-order window fills with the arithmetic and the lines asked for into L1 no longer
 * cover the memory's latency. Such loops also ask for each line into L2 PF_FAR ahead, and into
 * L1 PF_NEAR ahead: that layer 6.4 -> 5.0 ms (int16 activations), 5.4 -> 4.6 ms (W8A8), the
 * K-quants 3-10%, grouped int8 (q8_0), MXFP4, int4 and FP8 6-8% (bench moe-kernel, Zen 4); T1
 * alone lost 3-5% at one token, which keeps hs_prefetch alone. Near 2 KiB or 8 KiB, far 8 KiB
 * or 32 KiB: no better. */
#ifndef PF_NEAR
#define PF_NEAR 4096
#endif
#ifndef PF_FAR
#define PF_FAR 16384
#endif
static inline __attribute__((always_inline)) void hs_prefetch_mb(const void *p, int MB) {
    if (MB >= 2) {
        _mm_prefetch((const char *)p + PF_FAR, _MM_HINT_T1);
        _mm_prefetch((const char *)p + PF_NEAR, PF_HINT);
    } else {
        hs_prefetch(p);
    }
}

/* Prefetches a format's second stream, its scales read beside the weights at 1/ratio of their
 * bytes (MXFP4: 16 per 256), as far ahead as hs_prefetch reaches in the weights. Left to the
 * hardware prefetcher, MXFP4's scale stream cost ~6% of a one-token layer when memory is fast
 * (~85 GB/s); the thinner scale streams of q8_0 and FP8 gain nothing from it. */
static inline __attribute__((always_inline)) void hs_prefetch_side(const void *p, int ratio) {
    _mm_prefetch((const char *)p + PF_DIST / ratio, PF_HINT);
}

/* The sums of lanes 0-3 and 4-7 of t (two rows of a quad, 4 lanes each). */
static inline void pair_out(__m256 t, float *r0, float *r1) {
    __m128 lo = _mm256_castps256_ps128(t), hi = _mm256_extractf128_ps(t, 1);
    __m128 s = _mm_hadd_ps(lo, hi); /* [lo0+lo1, lo2+lo3, hi0+hi1, hi2+hi3] */
    s = _mm_hadd_ps(s, s);
    *r0 = _mm_cvtss_f32(s);
    *r1 = _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
}

#ifdef HS_AVX512
/* The 512-bit forms of the quad spreads (FP8): a quad's rows 0-1 in the low half of a vector
 * and rows 2-3 in the high half, 4 lanes per row. */

/* The 4 rows' values v[0..3] (one per row of a quad) as [v0 x4, v1 x4 | v2 x4, v3 x4]. */
static inline __m512 quad_spread5(__m128 v) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}

/* The rows of a 512-bit pair accumulator, as pair_out on each half. */
static inline void quad_out5(__m512 t, float out[4][MBMAX], int m) {
    pair_out(_mm512_castps512_ps256(t), &out[0][m], &out[1][m]);
    pair_out(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)), &out[2][m],
             &out[3][m]);
}
#endif

/* int8 rows with an fp16 scale per group of G inputs (G % 16 == 0; GGUF q8_0's own fp16
 * scales: fp32 copies would stream 12.5% on top of the weights instead of 6.25%): per group,
 * exact int32 sums (16 products per vpmaddwd), then one FMA by the group's scale (converted
 * with F16C). */
static inline __attribute__((always_inline)) void quad_i8g(const int8_t *q, const uint16_t *sc, int K,
                                                           int G, const int16_t *const x[2],
                                                           int MB, float out[4][MBMAX]) {
    __m256 tot[4][2];
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < MB; m++) tot[r][m] = _mm256_setzero_ps();
    for (int g = 0; g < K / G; g++) {
        __m256i acc[4][2];
        for (int r = 0; r < 4; r++)
            for (int m = 0; m < MB; m++) acc[r][m] = _mm256_setzero_si256();
        for (int k = g * G; k < (g + 1) * G; k += 16) {
            hs_prefetch_mb(q + 4 * k, MB);
            for (int r = 0; r < 4; r++) {
                __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 4 * k + 16 * r)));
                for (int m = 0; m < MB; m++)
                    acc[r][m] = hs_dpwssd(acc[r][m], w,
                                          _mm256_loadu_si256((const __m256i *)(x[m] + k)));
            }
            for (int r = 0; r < 4; r++)
                for (int m = 0; m < MB; m++) HS_PIN(acc[r][m]);
        }
        float s4[4];
        _mm_storeu_ps(s4, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + 4 * g))));
        for (int r = 0; r < 4; r++) {
            __m256 s = _mm256_broadcast_ss(s4 + r);
            for (int m = 0; m < MB; m++)
                tot[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][m]), s, tot[r][m]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < MB; m++) out[r][m] = hs_hsum(tot[r][m]);
}

/* e2m1 codes times two (so every value is an integer): 0 .5 1 1.5 2 3 4 6, then negated. */
static inline __m256i mxfp4_lut(void) {
    return _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                            0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
}

/* One 32-byte half chunk v of an MXFP4 tile (8 rows x 4 bytes) as the 4 pair vectors the
 * activations meet: 256 x the doubled values of elements (0, 4), (2, 6), (1, 5), (3, 7) of each
 * row's 8 (see below); lut = mxfp4_lut(). */
static inline __attribute__((always_inline)) void mxfp4_pairs(__m256i v, __m256i lut,
                                                              __m256i w[4]) {
    const __m256i nib = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi16((short)0xFF00);
    const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, nib));
    const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
    w[0] = _mm256_slli_epi16(lo, 8), w[1] = _mm256_and_si256(lo, high);
    w[2] = _mm256_slli_epi16(hi, 8), w[3] = _mm256_and_si256(hi, high);
}

/* MXFP4 rows are read 16 at a time (a tile), each row in its own 32-bit lane, so per block of
 * 32 inputs every lane sums its own row's products and meets its own scale: no per-lane scale
 * spreading, no horizontal sums, one conversion and FMA per block for 16 rows. Tile layout, per
 * block: four 64-byte chunks, chunk c holding for each row r (at byte 4r) its published bytes
 * 4c .. 4c + 3 (byte i: element 2i in the low nibble, 2i + 1 in the high one); scales
 * [block][16 rows] as published e8m0 bytes. vpshufb maps each nibble to its signed doubled value
 * in place; a shift left by 8, or a mask of the high byte, makes 16-bit lanes of 256 x the
 * values of elements (0, 4), (2, 6), (1, 5), (3, 7) of the chunk's 8, which meet activation
 * pairs stored in that order (quantize_rows, perm = 1) by vpmaddwd / vpdpwssd. Per block and
 * row 32 products of at most 3072 x 16383: < 2^31, exact; then one conversion and one FMA, in
 * the same order in both builds (bit-identical results). */
#define TILE_ROWS 16 /* rows per tile (MXFP4 here, int4 in moe_quads.h) */

typedef int32_t __attribute__((may_alias)) i32a; /* two int16 activations read as one */

/* e8m0 bytes e as 2^(e - 136): the scale 2^(e - 127), halved for the doubled codes and divided
 * by 256 for the codes' place in the high byte of an int16; e < 10 (scales below 2^-117) -> 0. */
static inline __m256 e8m0_scaled8(const uint8_t *e) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e));
    __m256i bits = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(9)), 23);
    __m256i ok = _mm256_cmpgt_epi32(v, _mm256_set1_epi32(9));
    return _mm256_castsi256_ps(_mm256_and_si256(bits, ok));
}

/* The helpers both tiles (MXFP4, int4) share. tile_dot: one chunk's four pair vectors w
 * against the 8 activations from x (pairs in the tile's order), alternating between two
 * accumulators (shorter chains); tile_sum: their block sum as fp32; tile_out: the 16 rows of
 * each token's totals (two 8-row halves on AVX2) into out[r][m]. */
static inline __attribute__((always_inline)) void tile_dot(__m256i acc[2], const __m256i w[4],
                                                           const int16_t *x) {
    const i32a *xp = (const i32a *)x;
    for (int i = 0; i < 4; i++)
        acc[i & 1] = hs_dpwssd(acc[i & 1], w[i], _mm256_set1_epi32(xp[i]));
    HS_PIN(acc[0]);
    HS_PIN(acc[1]);
}

static inline __m256 tile_sum(const __m256i acc[2]) {
    return _mm256_cvtepi32_ps(_mm256_add_epi32(acc[0], acc[1]));
}

static inline void tile_out(__m256 tot[][2], int MB, float out[][MBMAX]) {
    float t[2][TILE_ROWS];
    for (int m = 0; m < MB; m++) {
        _mm256_storeu_ps(t[m], tot[m][0]);
        _mm256_storeu_ps(t[m] + 8, tot[m][1]);
    }
    for (int r = 0; r < TILE_ROWS; r++)
        for (int m = 0; m < MB; m++) out[r][m] = t[m][r];
}

#ifdef HS_AVX512
/* e8m0_scaled8 for 16 rows. */
static inline __m512 e8m0_scaled16(const uint8_t *e) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)e));
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(
        _mm512_cmpgt_epi32_mask(v, _mm512_set1_epi32(9)), _mm512_sub_epi32(v, _mm512_set1_epi32(9)),
        23));
}

static inline __attribute__((always_inline)) void tile_dot5(__m512i acc[2], const __m512i w[4],
                                                            const int16_t *x) {
    const i32a *xp = (const i32a *)x;
    for (int i = 0; i < 4; i++)
        acc[i & 1] = _mm512_dpwssd_epi32(acc[i & 1], w[i], _mm512_set1_epi32(xp[i]));
    HS_PIN(acc[0]);
    HS_PIN(acc[1]);
}

static inline __m512 tile_sum5(const __m512i acc[2]) {
    return _mm512_cvtepi32_ps(_mm512_add_epi32(acc[0], acc[1]));
}

static inline void tile_out5(const __m512 tot[], int MB, float out[][MBMAX]) {
    float t[2][TILE_ROWS];
    for (int m = 0; m < MB; m++) _mm512_storeu_ps(t[m], tot[m]);
    for (int r = 0; r < TILE_ROWS; r++)
        for (int m = 0; m < MB; m++) out[r][m] = t[m][r];
}
#endif

static inline __attribute__((always_inline)) void tile_mxfp4(const uint8_t *q, const uint8_t *sc,
                                                             int K, const int16_t *const x[2],
                                                             int MB, float out[][MBMAX]) {
#ifdef HS_AVX512
    const __m512i nib = _mm512_set1_epi8(0x0F), lut = _mm512_broadcast_i64x4(mxfp4_lut());
    const __m512i high = _mm512_set1_epi16((short)0xFF00);
    __m512 tot[2];
    for (int m = 0; m < MB; m++) tot[m] = _mm512_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *qb = q + 256 * (size_t)b;
        __m512i acc[2][2];
        for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            hs_prefetch_mb(qb + 64 * c, MB);
            const __m512i v = _mm512_loadu_si512(qb + 64 * c);
            const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, nib));
            const __m512i hi =
                _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
            const __m512i w[4] = {_mm512_slli_epi16(lo, 8), _mm512_and_si512(lo, high),
                                  _mm512_slli_epi16(hi, 8), _mm512_and_si512(hi, high)};
            for (int m = 0; m < MB; m++) tile_dot5(acc[m], w, x[m] + 32 * b + 8 * c);
        }
        hs_prefetch_side(sc + TILE_ROWS * (size_t)b, 16);
        const __m512 scale = e8m0_scaled16(sc + TILE_ROWS * (size_t)b);
        for (int m = 0; m < MB; m++) tot[m] = _mm512_fmadd_ps(tile_sum5(acc[m]), scale, tot[m]);
    }
    tile_out5(tot, MB, out);
#else
    const __m256i lut = mxfp4_lut();
    __m256 tot[2][2];
    for (int m = 0; m < MB; m++) tot[m][0] = tot[m][1] = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *qb = q + 256 * (size_t)b;
        for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 */
            __m256i acc[2][2];
            for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                if (h == 0) hs_prefetch_mb(qb + 64 * c, MB);
                __m256i w[4];
                mxfp4_pairs(_mm256_loadu_si256((const __m256i *)(qb + 64 * c + 32 * h)), lut, w);
                for (int m = 0; m < MB; m++) tile_dot(acc[m], w, x[m] + 32 * b + 8 * c);
            }
            if (h == 0) hs_prefetch_side(sc + TILE_ROWS * (size_t)b, 16);
            const __m256 scale = e8m0_scaled8(sc + TILE_ROWS * (size_t)b + 8 * h);
            for (int m = 0; m < MB; m++)
                tot[m][h] = _mm256_fmadd_ps(tile_sum(acc[m]), scale, tot[m][h]);
        }
    }
    tile_out(tot, MB, out);
#endif
}

/* 16 e4m3 bytes -> 16 fp32 in two vectors, each 2^-8 times the value: the byte shifted left
 * by 7 is the fp16 pattern of value / 256 once its sign moves from bit 14 to bit 15 (adding
 * bit 14 to itself); subnormals map to fp16 subnormals, exactly. (e4m3fn's NaN is not kept.) */
static inline __attribute__((always_inline)) void fp8x16(const uint8_t *p, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    h = _mm256_add_epi16(h, _mm256_and_si256(h, _mm256_set1_epi16(0x4000)));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

/* FP8 quad, one token: weights converted in registers and multiplied with the fp32 inputs;
 * per group of G inputs (G % 16 == 0) the sums are scaled by the row's scale (which the
 * caller stores times 256, undoing fp8x16's 2^-8). */
static inline __attribute__((always_inline)) void quad_fp8(const uint8_t *q, const float *sc,
                                                           int K, int G, const float *x,
                                                           float out[4][MBMAX]) {
#ifdef HS_AVX512
    /* 16 lanes: one 32-byte load is two rows' 16 bytes, widened and converted as fp8x16 does;
     * the same products, summed in another order (fp32 rounding, not bit-identical). */
    __m512 tot5[4];
    for (int r = 0; r < 4; r++) tot5[r] = _mm512_setzero_ps();
    for (int g = 0; g < K / G; g++) {
        __m512 acc[4];
        for (int r = 0; r < 4; r++) acc[r] = _mm512_setzero_ps();
        for (int k = g * G; k < (g + 1) * G; k += 16) {
            hs_prefetch(q + 4 * k);
            const __m512 xv = _mm512_loadu_ps(x + k);
            for (int pr = 0; pr < 2; pr++) {
                __m512i h = _mm512_cvtepu8_epi16(
                    _mm256_loadu_si256((const __m256i *)(q + 4 * k + 32 * pr)));
                h = _mm512_slli_epi16(h, 7);
                h = _mm512_add_epi16(h, _mm512_and_si512(h, _mm512_set1_epi16(0x4000)));
                const __m512 w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
                const __m512 w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
                acc[2 * pr] = _mm512_fmadd_ps(w0, xv, acc[2 * pr]);
                acc[2 * pr + 1] = _mm512_fmadd_ps(w1, xv, acc[2 * pr + 1]);
            }
        }
        for (int r = 0; r < 4; r++)
            tot5[r] = _mm512_fmadd_ps(acc[r], _mm512_set1_ps(sc[4 * g + r]), tot5[r]);
    }
    for (int r = 0; r < 4; r++) out[r][0] = _mm512_reduce_add_ps(tot5[r]);
#else
    __m256 tot[4];
    for (int r = 0; r < 4; r++) tot[r] = _mm256_setzero_ps();
    for (int g = 0; g < K / G; g++) {
        __m256 acc[4];
        for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
        for (int k = g * G; k < (g + 1) * G; k += 16) {
            hs_prefetch(q + 4 * k);
            __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
            for (int r = 0; r < 4; r++) {
                __m256 w0, w1;
                fp8x16(q + 4 * k + 16 * r, &w0, &w1);
                acc[r] = _mm256_fmadd_ps(w0, x0, _mm256_fmadd_ps(w1, x1, acc[r]));
            }
        }
        for (int r = 0; r < 4; r++) tot[r] = _mm256_fmadd_ps(acc[r], _mm256_set1_ps(sc[4 * g + r]), tot[r]);
    }
    for (int r = 0; r < 4; r++) out[r][0] = hs_hsum(tot[r]);
#endif
}

#if HS_FP8_BF16
/* e4m3 -> bf16 by moving bits, one GFNI affine op per output byte (each output bit one input
 * bit): the sign to bit 15, the 4 exponent bits to the bf16 exponent's low 4, the 3 mantissa
 * bits to the mantissa's top 3. That is the bf16 of value x 2^-120 for every normal e4m3
 * (exponent fields 1-15 are normal bf16 exponents too), zero stays zero, and a subnormal (|v| <
 * 2^-6, below 1/28672 of the format's 448) becomes a bf16 denormal, which vdpbf16ps reads as
 * zero. gf2p8affineqb takes output bit i from matrix byte 7 - i. */
#define FP8_BF16_HI 0x1020400000000080LL /* out 7, 2, 1, 0 <- in 7, 6, 5, 4 */
#define FP8_BF16_LO 0x0000000001020408LL /* out 7, 6, 5, 4 <- in 3, 2, 1, 0 */

/* Activation rows for quad_fp8_bf16: each row scaled by a power of two 2^k so its largest
 * magnitude lies in [2^125, 2^126) (the weights carry 2^-120; products of normal weights with
 * any input above 2^-126 of the row's largest stay normal fp32), then split into two bf16 rows
 * (round to nearest even): hi = bf16(x) and lo = bf16(x - hi), the difference being exact in
 * fp32. hi + lo is within 2^-18 |x| of x (one bf16 alone: 2^-9, which moved the tiny models'
 * logprobs by 0.3); each row is stored [hi K | lo K]. sc[r] = 2^(120 - k) / 256 undoes both
 * scalings and the 256 the caller's weight scales carry (quad_fp8). K % 16 == 0. */
static inline void bf16_rows(const float *src, int K, int rows, int16_t *q, float *sc) {
    for (int r = 0; r < rows; r++) {
        const float *x = src + (size_t)r * K;
        int16_t *hi = q + (size_t)r * 2 * K, *lo = hi + K;
        int ex = 0;
        const float m = hs_absmax(x, K);
        if (m > 0.0f) frexpf(m, &ex); /* m < 2^ex */
        if (ex < -100) ex = -100;     /* (a row that small reads as 2^-100 of 1) */
        const __m512 k = _mm512_set1_ps((float)(126 - ex));
        for (int i = 0; i < K; i += 16) {
            const __m512 v = _mm512_scalef_ps(_mm512_loadu_ps(x + i), k);
            const __m256bh h = _mm512_cvtneps_pbh(v);
            const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32((__m256i)h), 16));
            const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
            _mm256_storeu_si256((__m256i *)(hi + i), (__m256i)h);
            _mm256_storeu_si256((__m256i *)(lo + i), (__m256i)l);
        }
        sc[r] = ldexpf(1.0f, ex - 14); /* 2^(120 - (126 - ex)) / 2^8 */
    }
}

/* FP8 quad against MB <= 2 split bf16 activation rows (bf16_rows): per 16 inputs the quad's 64
 * bytes (rows in 128-bit lanes) become two vectors of 32 bf16 (low and high bytes from the two
 * affine ops, interleaved), each multiplied by vdpbf16ps with every row's 8 inputs (hi, then
 * lo) broadcast to the four lanes: 4 MB products per weight vector pair, each into its own
 * accumulator so vdpbf16ps's latency is covered. Per group of G inputs the row sums (4 lanes
 * per row) are scaled by the rows' scales. The caller multiplies by each activation row's sc. */
static inline __attribute__((always_inline)) void quad_fp8_bf16(const uint8_t *q, const float *sc,
                                                                int K, int G,
                                                                const int16_t *const x[2], int MB,
                                                                float out[4][MBMAX]) {
    const __m512i ahi = _mm512_set1_epi64(FP8_BF16_HI), alo = _mm512_set1_epi64(FP8_BF16_LO);
    __m512 tot[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int g = 0; g < K / G; g++) {
        __m512 acc[2][4];
        for (int m = 0; m < MB; m++)
            for (int i = 0; i < 4; i++) acc[m][i] = _mm512_setzero_ps();
        for (int k = g * G; k < (g + 1) * G; k += 16) {
            hs_prefetch_mb(q + 4 * k, MB);
            const __m512i v = _mm512_loadu_si512(q + 4 * k);
            const __m512i hi = _mm512_gf2p8affine_epi64_epi8(v, ahi, 0);
            const __m512i lo = _mm512_gf2p8affine_epi64_epi8(v, alo, 0);
            const __m512bh w0 = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
            const __m512bh w1 = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
            for (int m = 0; m < MB; m++)
                for (int part = 0; part < 2; part++) { /* hi, then lo */
                    const int16_t *xp = x[m] + part * K + k;
                    const __m512i x0 =
                        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)xp));
                    const __m512i x1 =
                        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xp + 8)));
                    acc[m][2 * part] = _mm512_dpbf16_ps(acc[m][2 * part], w0, (__m512bh)x0);
                    acc[m][2 * part + 1] =
                        _mm512_dpbf16_ps(acc[m][2 * part + 1], w1, (__m512bh)x1);
                }
        }
        const __m512 s = quad_spread5(_mm_loadu_ps(sc + 4 * g));
        for (int m = 0; m < MB; m++) {
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                             _mm512_add_ps(acc[m][2], acc[m][3]));
            tot[m] = _mm512_fmadd_ps(sum, s, tot[m]);
        }
    }
    for (int m = 0; m < MB; m++) quad_out5(tot[m], out, m);
}
#endif

#endif
