/* q6_K and q5_K (llama.cpp's GGUF K-quants) microkernels: each row's super-blocks exactly as the
 * file stores them (no layout of our own), rows in quads.
 *
 * q6_K, 210 bytes per 256 columns: ql[128] (low 4 bits), qh[64] (high 2 bits), 16 int8 scales
 * (one per 16 columns), fp16 d; w = d * sc * (q - 32), q in [0, 63]. Column 128 n + 32 i + l
 * (n < 2, i < 4, l < 32) has its low bits in ql[64 n + l + 32 (i & 1)] (nibble i / 2), its high
 * bits at bits 2 i of qh[32 n + l], its scale sc[8 n + 2 i + l / 16].
 * q5_K, 176 bytes per 256 columns: fp16 d, dmin, q4_K's 12 bytes of 6-bit sc and m per 32
 * columns, qh[32], qs[128]; w = d * sc * q - dmin * m, q in [0, 31]. Column 64 c + 32 h + l
 * (c < 4, h < 2) has its low bits in nibble h of qs[32 c + l] and bit 4 at bit 2 c + h of qh[l].
 *
 * Activations meet them as llama.cpp's q6_K / q5_K x q8_K products do: int8 per super-block of
 * 256 columns, scale amax / 127 (|x - x_hat| <= amax / 254), in natural column order, with
 * their sums per 16 columns (the offset and minimum terms). Every integer step is exact (the
 * largest, q6_K's per-lane sum of 8 pairs times a scale: 8 * 2 * 63 * 127 * 128 < 2^31), so
 * the only rounding past the activations' is the fp32 step per super-block:
 * tot += S * (d * xd) (q5_K: then tot -= M * (dmin * xd)), super-blocks in order. */
#ifndef HETSERVE_MOE_KQ_H
#define HETSERVE_MOE_KQ_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "moe_formats.h"
#include "moe_q4k.h"

#define Q6K_BLOCK 210
#define Q5K_BLOCK 176

/* One fp32 row x [K] (rows back to back: K their columns together) -> int8 x8 [K] in column
 * order, scales d [K / 256], sums per 16 columns gs [K / 16] (read with q4k_row: the same
 * sizes as the q4_K kernel's activations, another order). */
static void kq_quantize(const float *x, int K, int8_t *x8, float *d, int16_t *gs) {
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    for (int s = 0; s < K / Q4K_SB; s++) {
        const float *row = x + (size_t)s * Q4K_SB;
        const float amax = hs_absmax(row, Q4K_SB);
        d[s] = amax / 127.0f;
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        for (int c = 0; c < Q4K_SB; c += 8) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(row + c), inv);
            __m256i q = _mm256_cvtps_epi32(v); /* round to nearest even */
            q = _mm256_max_epi32(_mm256_min_epi32(q, lim), nlim);
            int32_t t[8];
            _mm256_storeu_si256((__m256i *)t, q);
            int sum = 0;
            for (int i = 0; i < 8; i++) x8[(size_t)s * Q4K_SB + c + i] = (int8_t)t[i], sum += t[i];
            if (c % 16 == 0) gs[16 * s + c / 16] = (int16_t)sum;
            else gs[16 * s + c / 16] = (int16_t)(gs[16 * s + c / 16] + sum);
        }
    }
}

/* The integer sum of one q6_K super-block b against int8 activations x [256] with sums per 16
 * gs: sum over columns of sc * (q - 32) * x. */
static inline __attribute__((always_inline)) int q6k_block(const uint8_t *b, const int8_t *x,
                                                           const int16_t *gs) {
    const __m256i low = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(0x03);
    const int8_t *sc = (const int8_t *)(b + 192);
    __m256i acc = _mm256_setzero_si256();
    for (int n = 0; n < 2; n++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * n));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, low),
                               _mm256_slli_epi16(_mm256_and_si256(h, three), 4));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, low),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), three), 4));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), three), 4));
        for (int i = 0; i < 4; i++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 128 * n + 32 * i));
            const __m256i p = _mm256_maddubs_epi16(q[i], xv); /* pairs: <= 2 * 63 * 127 */
            const __m256i s = _mm256_setr_m128i(_mm_set1_epi16(sc[8 * n + 2 * i]),
                                                _mm_set1_epi16(sc[8 * n + 2 * i + 1]));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
        }
    }
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    const __m256i g = _mm256_loadu_si256((const __m256i *)gs);
    return hsum_i32(acc) - 32 * hsum_i32(_mm256_madd_epi16(s16, g));
}

/* sc and m of sub-block j of a q4_K / q5_K super-block's 12 scale bytes (llama.cpp's
 * get_scale_min_k4). */
static inline void k4_scale_min(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One q5_K super-block b against x [256] (sums per 16 gs): *S = sum sc * q * x (all columns),
 * *M = sum over sub-blocks of m * (sum of x). */
static inline __attribute__((always_inline)) void q5k_block(const uint8_t *b, const int8_t *x,
                                                            const int16_t *gs, int *S, int *M) {
    const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(0x01);
    const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
    __m256i acc = _mm256_setzero_si256();
    int mins = 0;
    for (int c = 0; c < 4; c++) {
        const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * c));
        for (int hh = 0; hh < 2; hh++) {
            const __m256i nib = hh ? _mm256_and_si256(_mm256_srli_epi16(l, 4), low)
                                   : _mm256_and_si256(l, low);
            const __m128i cnt = _mm_cvtsi32_si128(2 * c + hh);
            const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(h, cnt), one);
            const __m256i q = _mm256_or_si256(nib, _mm256_slli_epi16(hb, 4));
            const int j = 2 * c + hh;
            int sc, m;
            k4_scale_min(b + 4, j, &sc, &m);
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * j));
            const __m256i p = _mm256_maddubs_epi16(q, xv); /* pairs: <= 2 * 31 * 127 */
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16((int16_t)sc)));
            mins += m * (gs[2 * j] + gs[2 * j + 1]);
        }
    }
    *S = hsum_i32(acc);
    *M = mins;
}

static inline float kq_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* out[r][m] = sum_k W[r, k] * x[m, k] for a quad of q6_K (fmt6 = 1) or q5_K rows (row r at
 * q + r * K / 256 * block bytes) and MB <= 2 tokens. */
static inline __attribute__((always_inline)) void quad_kq(const uint8_t *q, int fmt6, int K,
                                                          const q4k_act_t a[2], int MB,
                                                          float out[][MBMAX]) {
    const int nsb = K / Q4K_SB, bb = fmt6 ? Q6K_BLOCK : Q5K_BLOCK;
    for (int r = 0; r < 4; r++) {
        const uint8_t *row = q + (size_t)r * nsb * bb;
        float tot[2] = {0.0f, 0.0f};
        for (int s = 0; s < nsb; s++) {
            const uint8_t *b = row + (size_t)s * bb;
            hs_prefetch(b);
            for (int m = 0; m < MB; m++) {
                const int8_t *x = a[m].x + (size_t)s * Q4K_SB;
                const int16_t *gs = a[m].gs + 16 * s;
                const float xd = a[m].d[s];
                if (fmt6) {
                    const int S = q6k_block(b, x, gs);
                    tot[m] += (float)S * (kq_f16(b + 208) * xd);
                } else {
                    int S, M;
                    q5k_block(b, x, gs, &S, &M);
                    tot[m] += (float)S * (kq_f16(b) * xd);
                    tot[m] -= (float)M * (kq_f16(b + 2) * xd);
                }
            }
        }
        for (int m = 0; m < MB; m++) out[r][m] = tot[m];
    }
}

#endif
