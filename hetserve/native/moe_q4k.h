/* q4_K (llama.cpp's GGUF type) microkernel: the super-block's own numbers, in the quad layout.
 *
 * A q4_K row is split into super-blocks of 256 columns, each with an fp16 scale d and minimum
 * dmin and, per sub-block of 32 columns, 6-bit integers sc and m: w = d * sc * q - dmin * m,
 * q in [0, 15]. 144 bytes per 256 weights (4.5 bits each), as in the file. The kernel stores
 * exactly that many bytes per row, rearranged for a row quad (4 rows), per super-block:
 *
 *   [0, 8)     d of rows 0-3 (fp16)          [8, 16)   dmin of rows 0-3 (fp16)
 *   [16, 48)   byte 8r + j: low 4 bits of sc[r][j] | low 4 bits of m[r][j] << 4
 *   [48, 56)   byte j: the high 2 bits of sc[r][j] at bits 2r, 2r + 1      [56, 64) same for m
 *   [64, 576)  sub-block j at 64 + 64j: two vectors of 32 bytes (columns 0-15, then 16-31 of
 *              the sub-block); in each, row r's 8 bytes at 8r: byte i = column i (low nibble) |
 *              column 8 + i (high nibble)
 *
 * Activations meet the nibbles as llama.cpp's q4_K x q8_K product does: int8 per super-block
 * of 256 columns, scale amax / 127 (|x - x_hat| <= amax / 254 of that super-block), so one
 * vpmaddubsw multiplies 32 nibbles by 32 activations. The sub-block's scale joins in the integer
 * domain (vpmaddwd by sc), the super-block's d times the activations' scale once per 256
 * columns; the minimum term needs only the activations' sums per sub-block. Every integer step is
 * exact: an int16 lane sums 8 products of at most 15 * 127 (15240 < 2^15), an int32 lane at
 * most 8 sub-blocks x 2 lanes x 63 x 15240 < 2^31.
 *
 * With AVX-512 (HS_AVX512) one 64-byte load holds a whole sub-block of the quad, and the int8
 * activations are stored already spread the way its 8-byte row groups meet them (Q4K_XB = 4
 * bytes per column, see q4k_quantize): two vpmaddubsw and one vpdpwssd per sub-block and token.
 * The integer sums are the AVX2 ones, added in another order: the results are bit-identical.
 */
#ifndef HETSERVE_MOE_Q4K_H
#define HETSERVE_MOE_Q4K_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "moe_formats.h"

#define Q4K_SB 256          /* columns per super-block */
#define Q4K_QUAD_BYTES 576  /* 4 rows x 144 bytes */
#ifdef HS_AVX512
#define Q4K_XB 4 /* bytes of int8 activations per column (the spread layout) */
#else
#define Q4K_XB 1
#endif

/* One activation row for the q4_K kernel: int8 values x [Q4K_XB * K], their scale per
 * super-block d [K / 256], and their sums per sub-block as [8 x int16 | the same 8] per
 * super-block. */
typedef struct {
    const int8_t *x;
    const float *d;    /* [K / 256] */
    const int16_t *gs; /* [K / 256][16] */
} q4k_act_t;

/* One fp32 row x [K] -> its int8 values x8 [Q4K_XB * K] (round to nearest even, as
 * llama.cpp's q8_K), scales d [K / 256] and sums gs [K / 256][16] (see q4k_act_t). With
 * HS_AVX512 each sub-block's 32 values c0..c31, as 8-byte groups q0..q3, are stored spread
 * over 128 bytes as [q0 x4 | q2 x4] then [q1 x4 | q3 x4]: the low then the high nibbles' operand
 * for its 64 weight bytes (rows' 8-byte groups of columns 0-7 | 16-23, and 8-15 | 24-31). */
static void q4k_quantize(const float *x, int K, int8_t *x8, float *d, int16_t *gs) {
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int s = 0; s < K / Q4K_SB; s++) {
        const float *row = x + (size_t)s * Q4K_SB;
        const float amax = hs_absmax(row, Q4K_SB);
        d[s] = amax / 127.0f;
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        for (int j = 0; j < 8; j++) {
            __m256i v[4];
            for (int i = 0; i < 4; i++) {
                const __m256 v8 = _mm256_loadu_ps(row + 32 * j + 8 * i);
                const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v8, inv));
                v[i] = _mm256_max_epi32(_mm256_min_epi32(q, lim), nlim);
            }
            /* packs works within 128-bit lanes: the permute restores column order */
            const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                                 _mm256_packs_epi32(v[2], v[3]));
            const __m256i c = _mm256_permutevar8x32_epi32(b, order);
#ifdef HS_AVX512
            int8_t *e = x8 + (size_t)Q4K_XB * (s * Q4K_SB + 32 * j);
            const __m512i c5 = _mm512_castsi256_si512(c);
            _mm512_storeu_si512(e, _mm512_permutexvar_epi64(
                                       _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2), c5));
            _mm512_storeu_si512(e + 64, _mm512_permutexvar_epi64(
                                            _mm512_setr_epi64(1, 1, 1, 1, 3, 3, 3, 3), c5));
#else
            _mm256_storeu_si256((__m256i *)(x8 + (size_t)s * Q4K_SB + 32 * j), c);
#endif
            const __m256i t = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]),
                                               _mm256_add_epi32(v[2], v[3]));
            gs[16 * s + j] = gs[16 * s + 8 + j] = (int16_t)hsum_i32(t);
        }
    }
}

/* The 6-bit sc (which = 0) or m (which = 1) of the quad's super-block as bytes 8r + j. */
static inline __m256i q4k_six(const uint8_t *hdr, int which) {
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
    __m256i l = _mm256_loadu_si256((const __m256i *)(hdr + 16));
    if (which) l = _mm256_srli_epi16(l, 4);
    int64_t hi;
    memcpy(&hi, hdr + 48 + 8 * which, 8);
    __m256i h = _mm256_srlv_epi64(_mm256_set1_epi64x(hi), _mm256_setr_epi64x(0, 2, 4, 6));
    return _mm256_or_si256(_mm256_and_si256(l, low),
                           _mm256_slli_epi16(_mm256_and_si256(h, two), 4));
}

/* vpshufb controls spreading the sc bytes of sub-block j (bytes 8r + j) to int16 lanes [row 0
 * x4, row 1 x4 | row 2 x4, row 3 x4]; one table, so the control is a memory operand. */
#define Z_ (char)0x80
#define Q4K_IDX(j) {j, Z_, j, Z_, j, Z_, j, Z_, 8 + j, Z_, 8 + j, Z_, 8 + j, Z_, 8 + j, Z_, \
                    j, Z_, j, Z_, j, Z_, j, Z_, 8 + j, Z_, 8 + j, Z_, 8 + j, Z_, 8 + j, Z_}
static const char q4k_idx[8][32] __attribute__((aligned(32))) = {
    Q4K_IDX(0), Q4K_IDX(1), Q4K_IDX(2), Q4K_IDX(3), Q4K_IDX(4), Q4K_IDX(5), Q4K_IDX(6), Q4K_IDX(7)};
#undef Q4K_IDX
#undef Z_

static inline __m256i q4k_spread(__m256i sc, int j) {
    return _mm256_shuffle_epi8(sc, _mm256_load_si256((const __m256i *)q4k_idx[j]));
}

/* The 32 x 4 weights of one 32-byte vector (low / high nibbles) against 8 + 8 activations,
 * int16 pair sums [row 0: 4 lanes, row 1 | row 2, row 3]. */
static inline __m256i q4k_dot(__m256i lo, __m256i hi, const int8_t *x) {
    const __m256i a = _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)x));
    const __m256i b = _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(x + 8)));
    return _mm256_add_epi16(_mm256_maddubs_epi16(lo, a), _mm256_maddubs_epi16(hi, b));
}

/* out[r][m] = sum_k W[r, k] * x[m, k] for one quad of q4_K rows and MB <= 2 tokens. */
static inline __attribute__((always_inline)) void quad_q4k(const uint8_t *q, int K,
                                                           const q4k_act_t a[2], int MB,
                                                           float out[4][MBMAX]) {
    __m256 tot[2], zt[2][2];
    for (int m = 0; m < MB; m++) tot[m] = zt[m][0] = zt[m][1] = _mm256_setzero_ps();
    for (int s = 0; s < K / Q4K_SB; s++, q += Q4K_QUAD_BYTES) {
        hs_prefetch(q);
        const __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)q));
        const __m256i sc = q4k_six(q, 0);
        __m256i acc[2];
#ifdef HS_AVX512
        const __m512i nib5 = _mm512_set1_epi8(0x0F), sc5 = _mm512_broadcast_i64x4(sc);
        __m512i acc5[2];
        for (int m = 0; m < MB; m++) acc5[m] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            const uint8_t *v = q + 64 + 64 * j;
            hs_prefetch(v);
            const __m512i w = _mm512_loadu_si512(v);
            const __m512i lo = _mm512_and_si512(w, nib5);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib5);
            const __m512i s1 = _mm512_shuffle_epi8(
                sc5, _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)q4k_idx[j])));
            const size_t k = (size_t)Q4K_XB * (s * Q4K_SB + 32 * j);
            for (int m = 0; m < MB; m++) {
                const __m512i xl = _mm512_loadu_si512(a[m].x + k);
                const __m512i xh = _mm512_loadu_si512(a[m].x + k + 64);
                const __m512i t = _mm512_add_epi16(_mm512_maddubs_epi16(lo, xl),
                                                   _mm512_maddubs_epi16(hi, xh));
                acc5[m] = _mm512_dpwssd_epi32(acc5[m], t, s1);
            }
        }
        for (int m = 0; m < MB; m++)
            acc[m] = _mm256_add_epi32(_mm512_castsi512_si256(acc5[m]),
                                      _mm512_extracti64x4_epi64(acc5[m], 1));
#else
        const __m256i nib = _mm256_set1_epi8(0x0F);
        for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint8_t *v = q + 64 + 64 * j;
            hs_prefetch(v);
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)v);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(v + 32));
            const __m256i lo0 = _mm256_and_si256(v0, nib);
            const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nib);
            const __m256i lo1 = _mm256_and_si256(v1, nib);
            const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nib);
            const __m256i s1 = q4k_spread(sc, j);
            const int k = s * Q4K_SB + 32 * j;
            for (int m = 0; m < MB; m++) {
                __m256i t = _mm256_add_epi16(q4k_dot(lo0, hi0, a[m].x + k),
                                             q4k_dot(lo1, hi1, a[m].x + k + 16));
                acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(t, s1));
            }
        }
#endif
        /* d per lane pair [d0 d0 d1 d1 d2 d2 d3 d3]; minimums: rows 0-1 and 2-3 by 4 lanes */
        const __m256 d = _mm256_permutevar8x32_ps(dd, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
        const __m256 dm01 = _mm256_permutevar8x32_ps(dd, _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5));
        const __m256 dm23 = _mm256_permutevar8x32_ps(dd, _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7));
        const __m256i mn = q4k_six(q, 1);
        const __m256i m01 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(mn));
        const __m256i m23 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(mn, 1));
        for (int m = 0; m < MB; m++) {
            const __m256 xd = _mm256_broadcast_ss(a[m].d + s);
            tot[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_mul_ps(d, xd), tot[m]);
            const __m256i g = _mm256_loadu_si256((const __m256i *)(a[m].gs + 16 * s));
            const __m256i z01 = _mm256_madd_epi16(m01, g), z23 = _mm256_madd_epi16(m23, g);
            zt[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(z01), _mm256_mul_ps(dm01, xd), zt[m][0]);
            zt[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(z23), _mm256_mul_ps(dm23, xd), zt[m][1]);
        }
    }
    for (int m = 0; m < MB; m++) {
        float t[8], z[16];
        _mm256_storeu_ps(t, tot[m]);
        _mm256_storeu_ps(z, zt[m][0]);
        _mm256_storeu_ps(z + 8, zt[m][1]);
        for (int r = 0; r < 4; r++)
            out[r][m] = (t[2 * r] + t[2 * r + 1]) -
                        ((z[4 * r] + z[4 * r + 1]) + (z[4 * r + 2] + z[4 * r + 3]));
    }
}

#endif
