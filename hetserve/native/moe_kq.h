/* q6_K, q5_K, q3_K and q2_K (llama.cpp's GGUF K-quants) and IQ4_XS / IQ4_NL microkernels, rows in
 * quads. Each super-block keeps the file's bytes and bit layout, but its 256 columns are
 * permuted at load (quant/lane_order.py) and the activations the same way (kq_act_perm), so
 * that lane i (4 bytes) of every 32 values the kernel unpacks belongs to one scale group: the
 * products add up in int32 lanes (vpdpbusd, or vpmaddubsw + vpmaddwd by ones on AVX2) and meet
 * their scales once per super-block (vpmulld) instead of once per 32 columns. Below, "column"
 * is a position in that order.
 *
 * q6_K, 210 bytes per 256 columns: ql[128] (low 4 bits), qh[64] (high 2 bits), 16 int8 scales,
 * fp16 d; w = d * sc * (q - 32), q in [0, 63]. Column 128 n + 32 i + l (n < 2, i < 4, l < 32)
 * has its low bits in ql[64 n + l + 32 (i & 1)] (nibble i / 2), its high bits at bits 2 i of
 * qh[32 n + l], its scale sc[8 n + l / 4] (lane l / 4 of half n).
 * q5_K, 176 bytes per 256 columns: fp16 d, dmin, q4_K's 12 bytes of 6-bit sc and m per
 * sub-block, qh[32], qs[128]; w = d * sc * q - dmin * m, q in [0, 31]. Column 64 c + 32 h + l
 * (c < 4, h < 2) has its low bits in nibble h of qs[32 c + l], bit 4 at bit 2 c + h of qh[l],
 * its scale that of sub-block l / 4.
 *
 * Activations meet them as llama.cpp's q6_K / q5_K x q8_K products do: int8 per super-block of
 * 256 columns, scale amax / 127 (|x - x_hat| <= amax / 254), with their sums per 16 natural
 * columns (the offset and minimum terms). Every integer step is exact (the largest, a q6_K
 * lane: two halves' 16 products of 63 * 127 times a scale of up to 128, less its share of 32
 * times the offset term, |lane| < 5e7 < 2^31), so the rounding past the activations' is fp32's:
 * per super-block each of the integer sum's 8 lanes is converted (exact below 2^24; a q6_K lane
 * may reach ~2^25.6, off then by at most 2^-24 of itself) and scaled by d * xd into 8 running
 * lanes, which are summed once per row (q5_K's minimum term -M * (dmin * xd) runs in a scalar
 * beside). */
#ifndef HETSERVE_MOE_KQ_H
#define HETSERVE_MOE_KQ_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "moe_formats.h"
#include "moe_iqg.h"
#include "moe_job.h"
#include "moe_q4k.h"

#define Q6K_BLOCK 210
#define Q5K_BLOCK 176

/* The activations' order within a super-block for each format's row kernel
 * (quant/lane_order.py has the weights' side): natural for the grid i-quants, or plane order
 * where the build looks their points up by planes (moe_iqg.h); KQ_PERM32 (one
 * scale per 32 columns: IQ4_XS, IQ4_NL, q5_K: iq4_perm) or KQ_PERM16 (one per 16: q6_K, q3_K,
 * q2_K: kq_perm16), so that lane i of every 32 activation bytes meets one scale group. */
enum { KQ_NATURAL = 0, KQ_PERM32 = 1, KQ_PERM16 = 2, KQ_PLANES4 = 4, KQ_PLANES8 = 8 };
static inline int kq_act_perm(int fmt) {
    if (fmt == F_IQ4XS || fmt == F_IQ4NL || fmt == F_Q5K) return KQ_PERM32;
    if (iqg_planes(fmt)) return iqg_planes(fmt); /* KQ_PLANES4 / 8: moe_iqg.h's plane order */
    return fmt == F_Q6K || fmt == F_Q3K || fmt == F_Q2K ? KQ_PERM16 : KQ_NATURAL;
}

/* KQ_PERM16 in place on one super-block: in each half (128 columns) position 32 k + 4 i + p
 * holds column 16 i + 4 k + p (k < 4, i < 8, p < 4): a 4 x 8 transpose of 4-byte words, so that
 * lane i of the half's vectors is its 16-column group i. */
static inline void kq_perm16(int8_t *x) {
    uint32_t w[64], t[64];
    memcpy(w, x, sizeof(w));
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 8; i++)
            for (int k = 0; k < 4; k++) t[32 * h + 8 * k + i] = w[32 * h + 4 * i + k];
    memcpy(x, t, sizeof(t));
}

/* KQ_PERM32 (the IQ4 kernels', iq4_sums; q5_K's): within each super-block, position 32 k + 4 i + p
 * holds column 32 i + 4 k + p (i, k < 8, p < 4), an 8 x 8 transpose of 4-byte words, so that
 * lane i of every 32 bytes belongs to sub-block i. Its own inverse. */
static inline void iq4_perm(int8_t *x) {
    __m256i r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(x + 32 * i));
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);     /* words 0, 1 | 4, 5 of rows i, i+1 */
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]); /* words 2, 3 | 6, 7 */
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);         /* word 0 | 4 of rows i .. i + 3 */
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);     /* 1 | 5 */
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]); /* 2 | 6 */
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]); /* 3 | 7 */
    }
    for (int k = 0; k < 4; k++) {
        _mm256_storeu_si256((__m256i *)(x + 32 * k),
                            _mm256_permute2x128_si256(u[k], u[k + 4], 0x20));
        _mm256_storeu_si256((__m256i *)(x + 32 * (k + 4)),
                            _mm256_permute2x128_si256(u[k], u[k + 4], 0x31));
    }
}

/* One fp32 row x [K] (rows back to back: K their columns together) -> int8 x8 [K] in the order
 * perm (kq_act_perm), scales d [K / 256], sums per 16 columns (natural order) gs [K / 16] (read
 * with q4k_row: the same sizes as the q4_K kernel's activations, another order). */
static void kq_quantize(const float *x, int K, int8_t *x8, float *d, int16_t *gs, int perm) {
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
        if (perm == KQ_PERM32) iq4_perm(x8 + (size_t)s * Q4K_SB);
        else if (perm == KQ_PERM16) kq_perm16(x8 + (size_t)s * Q4K_SB);
        else if (perm) iqg_plane_perm(x8 + (size_t)s * Q4K_SB, perm);
    }
}

/* In-lane shuffle controls broadcasting int16 element k of each 128-bit lane (k < 8). */
#define HS_W16(k) _mm256_set1_epi16((short)((2 * (k) + 1) << 8 | 2 * (k)))

/* q6_K's 16 scales widened once per super-block for its 32-column groups: the even ones on the
 * low lane, the odd ones on the high lane (as int16), so that HS_W16(k) puts sc[2 k] on the
 * 8 low lanes and sc[2 k + 1] on the 8 high ones, as maddubs' pair sums of columns 32 k ..
 * 32 k + 15 and 32 k + 16 .. 32 k + 31 need them: one in-lane shuffle a group. */
static inline __m256i k16_scale_pairs(__m128i sc) {
    const __m128i eo = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7,
                                                          9, 11, 13, 15));
    return _mm256_cvtepi8_epi16(eo);
}

/* Half n of a q6_K super-block b: its 6-bit values q[i] (columns 128 n + 32 i + l, l < 32),
 * the low nibbles masked or shifted down, the 2 high bits moved to bits 4-5 by one 16-bit shift
 * and a mask (the bits a shift carries across the byte boundary fall outside the mask). */
static inline __attribute__((always_inline)) void q6k_values(const uint8_t *b, int n,
                                                            __m256i q[4]) {
    const __m256i low = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * n));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
    const __m256i h4 = _mm256_slli_epi16(h, 4), h2 = _mm256_slli_epi16(h, 2);
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(h4, hi2));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(h2, hi2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                           _mm256_and_si256(h, hi2));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                           _mm256_and_si256(_mm256_srli_epi16(h, 2), hi2));
}

/* 8 int16 scales sc8 (one per lane of a vector in the row kernels' order) as the prefill tiles
 * want them for a vector's 32 positions: *s0 lanes 0-3's, each on 4 int16 (positions 0-15),
 * *s1 lanes 4-7's (16-31). */
static inline void kq_lane_scales16(__m128i sc8, __m256i *s0, __m256i *s1) {
    const __m256i both = _mm256_broadcastsi128_si256(sc8);
    const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 5, 4,
                                          5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7);
    *s0 = _mm256_shuffle_epi8(both, pick);
    *s1 = _mm256_shuffle_epi8(both, _mm256_add_epi8(pick, _mm256_set1_epi8(8)));
}

/* One half's four vectors of unsigned codes q[i] against the signed activations at xn + 32 i,
 * added into int32 lanes (lane i keeps lane i's products): one vpdpbusd a vector on VNNI; on
 * AVX2, vpmaddubsw's int16 pair sums of `fold` vectors at a time added before one widening
 * (vpmaddwd by ones): the caller keeps fold times the pair bound within 32767. */
static inline __attribute__((always_inline)) __m256i kq_half(const __m256i q[4], const int8_t *xn,
                                                             int fold) {
    __m256i acc = _mm256_setzero_si256();
#ifdef HS_AVX512
    (void)fold;
    for (int i = 0; i < 4; i++)
        acc = _mm256_dpbusd_epi32(acc, q[i], _mm256_loadu_si256((const __m256i *)(xn + 32 * i)));
#else
    for (int i = 0; i < 4; i += fold) {
        __m256i p = _mm256_maddubs_epi16(q[i], _mm256_loadu_si256((const __m256i *)(xn + 32 * i)));
        for (int k = 1; k < fold; k++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xn + 32 * (i + k)));
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(q[i + k], xv));
        }
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
    }
#endif
    return acc;
}

/* The integer sums of one q6_K super-block b (its codes in the row kernels' order: lane
 * i of half n's vectors is scale group 8 n + i, quant/lane_order.py) against MB <= 2 tokens'
 * int8 activations (x[m] [256] in the same order, sums per 16 natural columns gs[m]): sum over
 * columns of sc * (q - 32) * x as 8 int32 lanes each (their sum is the block's). The 6-bit
 * values are put together once for every token (q6k_values); each half's products add up in
 * lanes of one scale each (vpdpbusd: q unsigned, x signed), scaled once per half (vpmulld). */
static inline __attribute__((always_inline)) void q6k_blocks(const uint8_t *b,
                                                            const int8_t *const x[2],
                                                            const int16_t *const gs[2], int MB,
                                                            __m256i acc[2]) {
    const int8_t *sc = (const int8_t *)(b + 192);
    __m256i h[2][2];
    for (int n = 0; n < 2; n++) {
        __m256i q[4];
        q6k_values(b, n, q);
        /* AVX2: two vectors' pair sums in int16, <= 2 * 2 * 63 * 127 */
        for (int m = 0; m < MB; m++) h[m][n] = kq_half(q, x[m] + 128 * n, 2);
    }
    const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc));
    const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8)));
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    for (int m = 0; m < MB; m++) {
        acc[m] = _mm256_add_epi32(_mm256_mullo_epi32(h[m][0], sc0),
                                  _mm256_mullo_epi32(h[m][1], sc1));
        const __m256i g = _mm256_loadu_si256((const __m256i *)gs[m]);
        acc[m] = _mm256_sub_epi32(acc[m], _mm256_slli_epi32(_mm256_madd_epi16(s16, g), 5)); /* 32x */
    }
}

/* q3_K, 110 bytes per 256 columns: hmask[32], qs[64], 12 bytes of 6-bit scales, fp16 d;
 * w = d * (sc - 32) * (q - 4), q in [0, 7], a scale per 16 columns. Column 128 n + 32 i + l
 * (n < 2, i < 4, l < 32) has its low 2 bits at bits 2 i of qs[32 n + l], bit 2 at bit 4 n + i
 * of hmask[l] (llama.cpp stores it as "subtract 4 where the bit is clear"), its scale
 * sc[8 n + l / 4] (as q6_K's). q2_K, 84 bytes: 16 scale bytes (sc in the low nibble, m in the
 * high one, per 16 columns), qs[64] at 16, fp16 d and dmin; w = d * sc * q - dmin * m, q in
 * [0, 3] at q3_K's low-bit places (qs[32 n + l] of its own). Both meet q8_K activations as q6_K
 * does (|lane| <= 2 * 16 * 7 * 127 * 32 plus the offset term: far inside int32). */
#define Q3K_BLOCK 110
#define Q2K_BLOCK 84

/* q3_K's 16 scales sc - 32 (int8) from its 12 bytes p: byte j < 8 of the first 8 bytes gives
 * the low nibble of scale j (low nibbles) and of scale j + 8 (high nibbles); the top 2 bits of
 * scale j (j < 4: 4 k + j) are bits 2 k of p[8 + j % 4]. */
static inline __m128i q3k_scales(const uint8_t *p) {
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadl_epi64((const __m128i *)p); /* bytes 0-7: the low nibbles */
    const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(v, nib),
                                           _mm_and_si128(_mm_srli_epi16(v, 4), nib));
    int32_t t;
    memcpy(&t, p + 8, 4); /* bytes 8-11: 2 bits of scale j at bits 2 (j / 4) of byte j % 4 */
    /* lane k (scales 4 k .. 4 k + 3) shifted right by 2 k: bits a shift carries down from the
     * next byte land at bit 2 or above, outside the mask */
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(t), _mm_setr_epi32(0, 2, 4, 6)),
                                     _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
}

/* Bits 2i, 2i + 1 of every byte of l at bits 0-1, the rest cleared: a shift and a mask, or
 * (GFNI) one affine byte op (output bit k from matrix byte 7 - k; as q4k_high). The row kernels'
 * arithmetic is mostly this unpack (q3_K 8.7 -> 8.1 ns a super-block on one core with GFNI,
 * q2_K 6.9 -> 6.3). */
static inline __attribute__((always_inline)) __m256i k2_field(__m256i l, int i) {
#if defined(HS_AVX512) && defined(__GFNI__)
    const unsigned long long a = (1ULL << (2 * i)) << 56 | (1ULL << (2 * i + 1)) << 48;
    return _mm256_gf2p8affine_epi64_epi8(l, _mm256_set1_epi64x((long long)a), 0);
#else
    return _mm256_and_si256(_mm256_srli_epi16(l, 2 * i), _mm256_set1_epi8(3));
#endif
}

/* The 2-bit values of half n of a q3_K / q2_K super-block's qs (32 bytes at qs + 32 n), column
 * 128 n + 32 i + l in q[i]; for q3_K (h: its hmask, else NULL) with bit 2 from bit 4 n + i of
 * h[l] (a 16-bit shift's carries across the byte boundary fall outside the mask; with AVX-512
 * the mask and the or are one vpternlogd). */
static inline __attribute__((always_inline)) void k2_values(const uint8_t *qs, const uint8_t *h,
                                                           int n, __m256i q[4]) {
    const __m256i bit2 = _mm256_set1_epi8(4);
    const __m256i l = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
    const __m256i hv = h ? _mm256_loadu_si256((const __m256i *)h) : _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256i low = k2_field(l, i);
        if (h == NULL) {
            q[i] = low;
            continue;
        }
        const int j = 4 * n + i;
        const __m256i hb = j >= 2 ? _mm256_srli_epi16(hv, j - 2) : _mm256_slli_epi16(hv, 2 - j);
        q[i] = _mm256_or_si256(low, _mm256_and_si256(hb, bit2));
    }
}

/* One q3_K (h: its hmask) or q2_K (h NULL) super-block, its codes in the row kernels' order
 * (as q6_K's), against MB <= 2 tokens: S[m] = sum over columns of sc * q * x (q3_K: sc - 32, q
 * its 3-bit value, the -4 offset subtracted from the sums per 16 like q6_K's -32) as 8 int32
 * lanes; q2_K: M[m] = sum of m * (x's sums per 16) as 8 lanes. The values are unpacked once for
 * every token, each half's products added in lanes of one scale (as q6k_blocks). */
static inline __attribute__((always_inline)) void k2_blocks(const uint8_t *qs, const uint8_t *h,
                                                           __m128i sc, __m128i mn,
                                                           const int8_t *const x[2],
                                                           const int16_t *const gs[2], int MB,
                                                           __m256i S[2], __m256i M[2]) {
    __m256i g2[2][2];
    for (int n = 0; n < 2; n++) {
        __m256i q[4];
        k2_values(qs, h, n, q);
        /* AVX2: the half's four vectors' pair sums in int16, <= 4 * 2 * 7 * 127 */
        for (int m = 0; m < MB; m++) g2[m][n] = kq_half(q, x[m] + 128 * n, 4);
    }
    /* Each lane of a half's sums is at most 16 * 7 * 127 < 2^15: the two halves packed to
     * int16 (vpackssdw: lanes 0-3 of half 0, then of half 1, per 128 bits) meet their scales
     * in the same order by one vpmaddwd (a pair of lanes per int32: the total is the same) */
    const __m256i scp = _mm256_cvtepi8_epi16(
        _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)));
    /* q3_K: the offset, 4 sc times the sums per 16; q2_K: m times them */
    const __m256i w16 = h ? _mm256_cvtepi8_epi16(sc) : _mm256_cvtepu8_epi16(mn);
    for (int m = 0; m < MB; m++) {
        S[m] = _mm256_madd_epi16(_mm256_packs_epi32(g2[m][0], g2[m][1]), scp);
        const __m256i g = _mm256_madd_epi16(w16, _mm256_loadu_si256((const __m256i *)gs[m]));
        if (h) S[m] = _mm256_sub_epi32(S[m], _mm256_slli_epi32(g, 2));
        else M[m] = g;
    }
}

/* All 8 sc (bytes 0..7) and m (bytes 8..15) of a q4_K / q5_K super-block's 12 scale bytes, on
 * 32-bit words (llama.cpp's get_scale_min_k4 for every sub-block j: j < 4, sc = q[j] & 63 and
 * m = q[j + 4] & 63; else the low / high nibble of q[j + 4] and the top 2 bits of q[j - 4] / q[j]
 * above them), in a register: written to memory and read back as a vector, the four words
 * missed store-to-load forwarding on every super-block. */
static inline __m128i k4_unpack(const uint8_t *q) {
    const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
    uint32_t u[3];
    memcpy(u, q, 12);
    return _mm_setr_epi32((int)(u[0] & m6),                                     /* sc 0-3 */
                          (int)((u[2] & m4) | (((u[0] >> 6) & m2) << 4)),      /* sc 4-7 */
                          (int)(u[1] & m6),                                     /* m 0-3 */
                          (int)(((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4))); /* m 4-7 */
}

/* Bit j of every byte of h moved to bit 4 (the 16-bit shift's carries across the byte boundary
 * fall outside the mask); j a constant where inlined. */
static inline __attribute__((always_inline)) __m256i q5k_high(__m256i h, int j) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    const __m256i v = j < 4 ? _mm256_slli_epi16(h, 4 - j) : j > 4 ? _mm256_srli_epi16(h, j - 4) : h;
    return _mm256_and_si256(v, bit4);
}

/* Sub-block j = 2 c + hh of a q5_K super-block b (h: its qh bytes, b + 16): the 5-bit values of
 * columns 32 j .. 32 j + 31, nibble hh of qs[32 c + l] with bit 4 from bit j of qh[l]. */
static inline __attribute__((always_inline)) __m256i q5k_values(const uint8_t *b, __m256i h, int c,
                                                               int hh) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * c));
    const __m256i nib =
        hh ? _mm256_and_si256(_mm256_srli_epi16(l, 4), low) : _mm256_and_si256(l, low);
    return _mm256_or_si256(nib, q5k_high(h, 2 * c + hh));
}

/* One q5_K super-block b, its codes in the row kernels' order (lane i of every vector is
 * sub-block i, quant/lane_order.py), against MB <= 2 tokens' x[m] [256] (the same order; sums per
 * 16 natural columns gs[m]): S[m] = sum sc * q * x (all columns) as 8 int32 lanes, M[m] = sum
 * over sub-blocks of m * (sum of x). The 5-bit values are unpacked once for every token; the
 * products add up in lanes of one scale (two chains, the low and the high nibbles'), scaled once
 * (vpmulld). */
static inline __attribute__((always_inline)) void q5k_blocks(const uint8_t *b,
                                                            const int8_t *const x[2],
                                                            const int16_t *const gs[2], int MB,
                                                            __m256i S[2], int M[2]) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
    const __m128i sm = k4_unpack(b + 4); /* sc[8], then m[8] */
    __m256i a2[2][2];
    for (int m = 0; m < MB; m++) a2[m][0] = a2[m][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        for (int hh = 0; hh < 2; hh++) {
            const int j = 2 * c + hh;
            const __m256i q = q5k_values(b, h, c, hh);
            for (int m = 0; m < MB; m++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x[m] + 32 * j));
#ifdef HS_AVX512
                a2[m][hh] = _mm256_dpbusd_epi32(a2[m][hh], q, xv);
#else /* int16 pair sums of a chain's four vectors, widened once below: <= 4 * 2 * 31 * 127 */
                a2[m][hh] = _mm256_add_epi16(a2[m][hh], _mm256_maddubs_epi16(q, xv));
#endif
            }
        }
    }
#ifndef HS_AVX512
    for (int m = 0; m < MB; m++)
        for (int hh = 0; hh < 2; hh++)
            a2[m][hh] = _mm256_madd_epi16(a2[m][hh], _mm256_set1_epi16(1));
#endif
    const __m256i sc = _mm256_cvtepu8_epi32(sm);
    /* m[j] times the sum of x over sub-block j (its two sums of 16: |.| <= 2 * 16 * 127) */
    const __m128i m16 = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
    for (int m = 0; m < MB; m++) {
        S[m] = _mm256_mullo_epi32(_mm256_add_epi32(a2[m][0], a2[m][1]), sc);
        const __m128i gp = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)gs[m]),
                                          _mm_loadu_si128((const __m128i *)(gs[m] + 8)));
        __m128i mm = _mm_madd_epi16(m16, gp);
        mm = _mm_add_epi32(mm, _mm_shuffle_epi32(mm, 0x4E));
        mm = _mm_add_epi32(mm, _mm_shuffle_epi32(mm, 0xB1));
        M[m] = _mm_cvtsi128_si32(mm);
    }
}

/* IQ4_XS, 136 bytes per 256 columns: fp16 d, 16 bits scales_h, scales_l[4], qs[128];
 * w = d * (ls - 32) * kv[q] with llama.cpp's 16 non-uniform int8 levels kv (kvalues_iq4nl)
 * and a 6-bit ls per 32 columns (low 4 bits in nibble j % 2 of scales_l[j / 2], high 2 at bits
 * 2 j of scales_h). Column 32 j + l (l < 16) is the low nibble of qs[16 j + l], 32 j + 16 + l
 * its high nibble. IQ4_NL: blocks of 32 columns, fp16 d and the same 16 bytes of nibbles;
 * w = d * kv[q] (18 bytes per 32, so 144 per 256, regrouped at load: quad_iq4nl). Levels
 * times activations (both int8) are products of |kv| (unsigned) with x signed by kv: pairs
 * <= 2 * 127 * 127, no saturation. */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

/* One 32-byte chunk of the IQ4 kernels' nibbles (quant/gguf_iq.py, iq4_lane_nibbles): the
 * levels of its low nibbles (wl: positions 0-31 of its 64 in the activations' order) and of its
 * high ones (wh: 32-63), looked up in lv (IQ4_LEVELS on both lanes). */
static inline __attribute__((always_inline)) void iq4_chunk(const uint8_t *p, __m256i lv,
                                                            __m256i *wl, __m256i *wh) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *wl = _mm256_shuffle_epi8(lv, _mm256_and_si256(v, low));
    *wh = _mm256_shuffle_epi8(lv, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
}

/* An IQ4_XS super-block's 8 scales ls - 32 as int16, on both lanes (the prefill tiles'): the
 * low 4 bits are nibble j % 2 of scales_l[j / 2] (bytes 4-7), the high 2 bits 2 j of the 16-bit
 * scales_h (bytes 2-3), moved to the top of a 16-bit lane by a multiply and down by a shift. */
static inline __attribute__((always_inline)) __m256i iq4xs_scales(const uint8_t *b) {
    int32_t l4;
    uint16_t sh;
    memcpy(&l4, b + 4, 4);
    memcpy(&sh, b + 2, 2);
    const __m128i l = _mm_cvtsi32_si128(l4), nib = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_unpacklo_epi8(_mm_and_si128(l, nib),
                                         _mm_and_si128(_mm_srli_epi16(l, 4), nib));
    const __m128i up = _mm_mullo_epi16(_mm_set1_epi16((short)sh),
                                       _mm_setr_epi16(1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6,
                                                      1 << 4, 1 << 2, 1));
    const __m128i ls = _mm_or_si128(_mm_cvtepu8_epi16(lo),
                                    _mm_slli_epi16(_mm_srli_epi16(up, 14), 4));
    return _mm256_broadcastsi128_si256(_mm_sub_epi16(ls, _mm_set1_epi16(32)));
}

/* IQ4_XS's levels + 128 (bytes 1 .. 241) for vpdpbusd, which multiplies unsigned bytes by signed
 * ones: sum (kv + 128) x = sum kv x + 128 sum x, the second term taken off per sub-block. */
static const uint8_t IQ4_ULEVELS[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                        129, 141, 153, 166, 181, 197, 217, 241};

/* The same 8 scales ls - 32 as int32 (the row kernel's): scale j's low 4 bits are bits 4 j of
 * the 32-bit scales_l, its high 2 bits 2 j of scales_h, each lane shifted by its own count
 * (vpsrlvd) from a broadcast of the bytes: 9 steps where the int16 form takes 15. */
static inline __attribute__((always_inline)) __m256i iq4xs_scales32(const uint8_t *b) {
    const __m256i l = _mm256_set1_epi32((int)iqg_u32(b + 4)); /* scales_l */
    const __m256i h = _mm256_set1_epi32((int)iqg_u32(b + 2)); /* scales_h in the low 16 bits */
    const __m256i n4 = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(l, n4), _mm256_set1_epi32(15));
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_srli_epi32(n4, 1)),
                                        _mm256_set1_epi32(3));
    return _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
}

/* The integer sums of one IQ4_XS / IQ4_NL super-block's 128 bytes of nibbles p against MB <= 2
 * tokens' activations at super-block s, lane i of S[m] sub-block i's (32 columns') sum of level
 * times activation. The loader regroups the nibbles (quant/gguf_iq.py, iq4_lane_nibbles) and
 * the activations come permuted to match (iq4_perm): every 32-byte vector unpacked from a chunk
 * (its low or its high nibbles) meets 32 activation bytes, and its lane i (4 bytes) holds 4
 * columns of sub-block i, so a super-block's dot products add up in one vector (two chains: the
 * low and the high nibbles', 1.1x one): 7 vector steps per 64 columns where a scale per 32
 * columns took 19. With VNNI each level is looked up + 128 and multiplied unsigned by the
 * signed activations (vpdpbusd), and 128 times the activations' sums per sub-block (from the
 * sums per 16, natural order) are taken off; AVX2 multiplies |level| by the activations signed
 * as the level (vpmaddubsw: pairs <= 2 * 127 * 127, no saturation). The same integers either
 * way: |lane| <= 32 * 127 * 127 < 2^19. */
static inline __attribute__((always_inline)) void iq4_sums(const uint8_t *p, const q4k_act_t a[2],
                                                           int s, int MB, __m256i S[2]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
#ifdef HS_AVX512
    const __m256i lv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_ULEVELS));
#else
    const __m256i lv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_LEVELS));
#endif
    __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    __m256i acch[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * c));
        const __m256i wl = _mm256_shuffle_epi8(lv, _mm256_and_si256(v, low));
        const __m256i wh = _mm256_shuffle_epi8(lv, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
#ifndef HS_AVX512
        const __m256i al = _mm256_abs_epi8(wl), ah = _mm256_abs_epi8(wh);
#endif
        for (int m = 0; m < MB; m++) {
            const int8_t *x = a[m].x + (size_t)s * Q4K_SB + 64 * c;
            const __m256i xl = _mm256_loadu_si256((const __m256i *)x);
            const __m256i xh = _mm256_loadu_si256((const __m256i *)(x + 32));
#ifdef HS_AVX512
            acc[m] = _mm256_dpbusd_epi32(acc[m], wl, xl);
            acch[m] = _mm256_dpbusd_epi32(acch[m], wh, xh);
#else
            acc[m] = hs_dpbusd(acc[m], al, _mm256_sign_epi8(xl, wl));
            acch[m] = hs_dpbusd(acch[m], ah, _mm256_sign_epi8(xh, wh));
#endif
        }
    }
    for (int m = 0; m < MB; m++) {
        S[m] = _mm256_add_epi32(acc[m], acch[m]);
#ifdef HS_AVX512
        const __m256i g = _mm256_loadu_si256((const __m256i *)(a[m].gs + 16 * s));
        const __m256i sums = _mm256_madd_epi16(g, _mm256_set1_epi16(1)); /* per sub-block */
        S[m] = _mm256_sub_epi32(S[m], _mm256_slli_epi32(sums, 7));
#endif
    }
}

/* A quad of IQ4_XS rows against MB <= 2 tokens: per super-block its sums per sub-block
 * (iq4_sums) times the 8 scales ls - 32 (vpmulld; |lane| <= 32 * 2^19 < 2^31), converted to
 * fp32 (exact below 2^24, else off by at most 2^-24 of itself) and scaled by d * xd into
 * running lanes, summed once per row. 1.6x the earlier kernel's rate from L2 on one Zen 4 core
 * (1.3-1.4x from memory). */
static inline __attribute__((always_inline)) void quad_iq4xs(const uint8_t *q, int K,
                                                             const q4k_act_t a[2], int MB,
                                                             float out[][MBMAX]) {
    const int nsb = K / Q4K_SB;
    for (int r = 0; r < 4; r++) {
        const uint8_t *row = q + (size_t)r * nsb * 136;
        __m256 accf[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int s = 0; s < nsb; s++) {
            const uint8_t *b = row + (size_t)s * 136;
            /* its 136 bytes' lines */
            hs_prefetch_mb(b, MB), hs_prefetch_mb(b + 64, MB), hs_prefetch_mb(b + 128, MB);
            const __m256i ls = iq4xs_scales32(b);
            __m256i S[2];
            iq4_sums(b + 8, a, s, MB, S);
            const float d = kq_f16(b);
            for (int m = 0; m < MB; m++)
                accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(S[m], ls)),
                                          _mm256_set1_ps(d * a[m].d[s]), accf[m]);
        }
        for (int m = 0; m < MB; m++) out[r][m] = hs_hsum(accf[m]);
    }
}

/* A quad of IQ4_NL rows against MB <= 2 tokens. The loader regroups each 8 blocks (256
 * columns, 144 bytes) for the kernel (quant/gguf_iq.py, iq4_nl_kernel_order): their 8 fp16 d
 * first, widened by one conversion, then the 128 bytes of nibbles as IQ4_XS's. Block i's sum
 * (iq4_sums' lane i, exact in fp32) is scaled by its own d_i * xd into running fp32 lanes,
 * summed once per row. */
static inline __attribute__((always_inline)) void quad_iq4nl(const uint8_t *q, int K,
                                                            const q4k_act_t a[2], int MB,
                                                            float out[][MBMAX]) {
    const int nsb = K / Q4K_SB;
    for (int r = 0; r < 4; r++) {
        const uint8_t *row = q + (size_t)r * nsb * 144;
        __m256 accf[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int s = 0; s < nsb; s++) {
            const uint8_t *b = row + (size_t)s * 144;
            /* its 144 bytes' lines */
            hs_prefetch_mb(b, MB), hs_prefetch_mb(b + 64, MB), hs_prefetch_mb(b + 128, MB);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
            __m256i S[2];
            iq4_sums(b + 16, a, s, MB, S);
            for (int m = 0; m < MB; m++)
                accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[m]),
                                          _mm256_mul_ps(d, _mm256_set1_ps(a[m].d[s])), accf[m]);
        }
        for (int m = 0; m < MB; m++) out[r][m] = hs_hsum(accf[m]);
    }
}

/* Bytes per 256 columns of a row (the K-quants and i-quants that read q8_K activations). */
static inline int kq_bytes(int fmt) {
    switch (fmt) {
    case F_Q6K: return Q6K_BLOCK;
    case F_Q5K: return Q5K_BLOCK;
    case F_IQ4XS: return 136;
    case F_Q3K: return Q3K_BLOCK;
    case F_Q2K: return Q2K_BLOCK;
    default: return iqg_fmt(fmt) ? iqg_bytes(fmt) : 144; /* IQ4_NL (and q4_K's 144 per 256) */
    }
}

/* A quad of grid i-quant rows (moe_iqg.h) against MB <= 2 tokens: per super-block its scales
 * widened once, per 32 columns the points and signs decoded once for both tokens (the signs
 * applied to the activations), exact integer sums per super-block. The formats that other
 * builds look up by planes add each super-block's sum as a number (iqg_add), as those do, for
 * the same bits; the rest (IQ2_XS, IQ2_S, IQ1) scale its 8 lanes into fp32 lanes summed once
 * per row (IQ2_S's super-block 1.2x slower the other way), as quad_iqgl does on AVX-512. */
static inline __attribute__((always_inline)) void quad_iqg(const uint8_t *q, int fmt, int K,
                                                           const q4k_act_t a[2], int MB,
                                                           float out[][MBMAX]) {
    const int nsb = K / Q4K_SB, bb = iqg_bytes(fmt), exact = iqg_planes_fmt(fmt);
    for (int r = 0; r < 4; r++) {
        const uint8_t *row = q + (size_t)r * nsb * bb;
        float tot[2] = {0.0f, 0.0f};
        __m256 lanes[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int s = 0; s < nsb; s++) {
            const uint8_t *b = row + (size_t)s * bb;
            for (int o = 0; o < bb; o += 64) hs_prefetch_mb(b + o, MB);
            float D;
            const __m256i pairs = k16_scale_pairs(iqg_head(fmt, b, &D));
            __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) { /* unrolled: each group's offsets and scale shuffle
                                            * constants (1.1-1.4x on the hot loop) */
                __m256i mag, sgn;
                iqg_group(fmt, b, k, &mag, &sgn);
                const __m256i sc = _mm256_shuffle_epi8(pairs, HS_W16(k));
                for (int m = 0; m < MB; m++) {
                    const __m256i x =
                        _mm256_loadu_si256((const __m256i *)(a[m].x + (size_t)s * Q4K_SB + 32 * k));
                    const __m256i p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, sgn));
                    acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p, sc));
                }
            }
            for (int m = 0; m < MB; m++) {
                if (exact) {
                    iqg_add(&tot[m], hs_hsum_i32(acc[m]), D, a[m].d[s]);
                } else {
                    const __m256 dx = _mm256_set1_ps(D * a[m].d[s]);
                    lanes[m] =
                        _mm256_add_ps(lanes[m], _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m]), dx));
                }
            }
        }
        for (int m = 0; m < MB; m++) out[r][m] = exact ? tot[m] : hs_hsum(lanes[m]);
    }
}

#ifdef HS_AVX512
/* quad_iqg's IQ2_XS, IQ2_S, IQ1_S and IQ1_M rows on AVX-512, 64 columns (8 points) a vector:
 * the points by loads (iqgl_points), each byte v (IQ2: +-grid, its sign bits a mask; IQ1: 8 g
 * +- 1) meets the token's activations as vpdpbusd(|v|, x negated where v < 0),
 * and each 4-column lane's sum is scaled by its 16 columns' scale in one vpdpwssd (|sum| <=
 * 4 * 43 * 127 < 2^15). Lane j of a vector's low half and lane j of its high half add up to
 * lane j of quad_iqg's 8 (columns 4 j .. 4 j + 3 of each 32, times their scale): the same
 * integers a super-block, then the same fp32 steps, so the same bits. */
static inline __attribute__((always_inline)) void quad_iqgl(const uint8_t *q, int fmt, int K,
                                                            const q4k_act_t a[2], int MB,
                                                            float out[][MBMAX]) {
    const int nsb = K / Q4K_SB, bb = iqg_bytes(fmt), iq2 = fmt == F_IQ2S || fmt == F_IQ2XS;
    const uint64_t *G = fmt == F_IQ2S ? hs_iq_grids.iq2s
                        : fmt == F_IQ2XS ? hs_iq_grids.iq2xs : hs_iq_grids.iq1s;
    const __m512i one = _mm512_set1_epi8(1), minus = _mm512_set1_epi8(-1);
    uint16_t idx[32] __attribute__((aligned(64)));
    uint8_t sg[32] __attribute__((aligned(32)));
    for (int r = 0; r < 4; r++) {
        const uint8_t *row = q + (size_t)r * nsb * bb;
        __m256 lanes[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int s = 0; s < nsb; s++) {
            const uint8_t *b = row + (size_t)s * bb;
            for (int o = 0; o < bb; o += 64) hs_prefetch_mb(b + o, MB);
            float D;
            const __m512i sc = iqgl_head(fmt, b, &D);
            const __mmask32 dn = iqgl_index(fmt, b, idx, sg);
            __m512i acc[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) { /* columns 64 i .. 64 i + 63 */
                const __m512i g = iqgl_points(G, idx + 8 * i);
                __m512i mag;
                __mmask64 neg;
                if (iq2) { /* the sign bits as they are (IQ2_S) or completed (IQ2_XS) */
                    mag = g;
                    memcpy(&neg, fmt == F_IQ2S ? b + 34 + 8 * i : sg + 8 * i, 8);
                } else {
                    const __m512i v = _mm512_add_epi8(
                        g, _mm512_mask_blend_epi64((__mmask8)(dn >> (8 * i)), one, minus));
                    neg = _mm512_movepi8_mask(v), mag = _mm512_abs_epi8(v);
                }
                const __m512i sci = _mm512_permutexvar_epi32(
                    _mm512_add_epi32(_mm512_set1_epi32(4 * i),
                                     _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3,
                                                       3, 3)),
                    sc);
                for (int m = 0; m < MB; m++) {
                    const __m512i x = _mm512_loadu_si512(
                        (const void *)(a[m].x + (size_t)s * Q4K_SB + 64 * i));
                    const __m512i p = _mm512_dpbusd_epi32(
                        _mm512_setzero_si512(), mag,
                        _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
                    acc[m] = _mm512_dpwssd_epi32(acc[m], p, sci);
                }
            }
            for (int m = 0; m < MB; m++) {
                const __m256i a8 = _mm256_add_epi32(_mm512_castsi512_si256(acc[m]),
                                                    _mm512_extracti64x4_epi64(acc[m], 1));
                const __m256 dx = _mm256_set1_ps(D * a[m].d[s]);
                lanes[m] = _mm256_add_ps(lanes[m], _mm256_mul_ps(_mm256_cvtepi32_ps(a8), dx));
            }
        }
        for (int m = 0; m < MB; m++) out[r][m] = hs_hsum(lanes[m]);
    }
}
#endif

/* out[r][m] = sum_k W[r, k] * x[m, k] for a quad of q6_K, q5_K, q3_K, q2_K, IQ4_XS or IQ4_NL rows (fmt;
 * row r at q + r * K / 256 * kq_bytes) and MB <= 2 tokens; the i-quants have kernels of their
 * own (their loaders regroup the nibbles), the K-quants share the loop below. */
static inline __attribute__((always_inline)) void quad_kq(const uint8_t *q, int fmt, int K,
                                                          const q4k_act_t a[2], int MB,
                                                          float out[][MBMAX]) {
    const int nsb = K / Q4K_SB, bb = kq_bytes(fmt);
    if (fmt == F_IQ4XS) {
        quad_iq4xs(q, K, a, MB, out);
        return;
    }
    if (fmt == F_IQ4NL) {
        quad_iq4nl(q, K, a, MB, out);
        return;
    }
    if (iqg_fmt(fmt)) {
#if HS_IQG_PLANES
        if (iqg_planes(fmt) == 4) {
            quad_iqg4(q, fmt, K, a, MB, out);
            return;
        }
        if (iqg_planes(fmt) == 8) {
            quad_iqg8(q, fmt, K, a, MB, out);
            return;
        }
#endif
#ifdef HS_AVX512
        if (fmt == F_IQ2XS || fmt == F_IQ2S || fmt == F_IQ1S || fmt == F_IQ1M) {
            quad_iqgl(q, fmt, K, a, MB, out);
            return;
        }
#endif
        quad_iqg(q, fmt, K, a, MB, out);
        return;
    }
    for (int r = 0; r < 4; r++) {
        const uint8_t *row = q + (size_t)r * nsb * bb;
        /* per token: the K-quants' scaled lanes, summed across once per row (a horizontal sum
         * per super-block cost more than its arithmetic), and the scalar terms */
        __m256 lanes[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        float tot[2] = {0.0f, 0.0f};
        for (int s = 0; s < nsb; s++) {
            const uint8_t *b = row + (size_t)s * bb;
            /* every line of the stream: one prefetch per super-block (1 line in 3.3 of q6_K's)
             * left the rest to the hardware, and a one-token layer ran ~1.5x slower */
            for (int o = 0; o < bb; o += 64) hs_prefetch_mb(b + o, MB);
            const int8_t *const x[2] = {a[0].x + (size_t)s * Q4K_SB,
                                        a[MB - 1].x + (size_t)s * Q4K_SB};
            const int16_t *const gs[2] = {a[0].gs + 16 * s, a[MB - 1].gs + 16 * s};
            if (fmt == F_Q6K) {
                __m256i S[2];
                q6k_blocks(b, x, gs, MB, S);
                const float d = kq_f16(b + 208);
                for (int m = 0; m < MB; m++) {
                    const __m256 dx = _mm256_set1_ps(d * a[m].d[s]);
                    lanes[m] = _mm256_add_ps(lanes[m], _mm256_mul_ps(_mm256_cvtepi32_ps(S[m]), dx));
                }
            } else if (fmt == F_Q5K) {
                __m256i S[2];
                int M[2];
                q5k_blocks(b, x, gs, MB, S, M);
                const float d = kq_f16(b), dmin = kq_f16(b + 2);
                for (int m = 0; m < MB; m++) {
                    const float xd = a[m].d[s];
                    const __m256 dx = _mm256_set1_ps(d * xd);
                    lanes[m] = _mm256_add_ps(lanes[m], _mm256_mul_ps(_mm256_cvtepi32_ps(S[m]), dx));
                    tot[m] -= (float)M[m] * (dmin * xd);
                }
            } else if (fmt == F_Q3K) {
                __m256i S[2], M[2];
                k2_blocks(b + 32, b, q3k_scales(b + 96), _mm_setzero_si128(), x, gs, MB, S, M);
                const float d = kq_f16(b + 108);
                for (int m = 0; m < MB; m++) {
                    const __m256 dx = _mm256_set1_ps(d * a[m].d[s]);
                    lanes[m] = _mm256_add_ps(lanes[m], _mm256_mul_ps(_mm256_cvtepi32_ps(S[m]), dx));
                }
            } else if (fmt == F_Q2K) {
                __m256i S[2], M[2];
                const __m128i raw = _mm_loadu_si128((const __m128i *)b), nib = _mm_set1_epi8(0x0F);
                k2_blocks(b + 16, NULL, _mm_and_si128(raw, nib),
                          _mm_and_si128(_mm_srli_epi16(raw, 4), nib), x, gs, MB, S, M);
                int32_t dd32; /* d and dmin converted together */
                memcpy(&dd32, b + 80, 4);
                const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(dd32));
                for (int m = 0; m < MB; m++) {
                    const __m128 p = _mm_mul_ps(dd, _mm_set1_ps(a[m].d[s]));
                    const __m256 dx = _mm256_broadcastss_ps(p);
                    const __m256 mx = _mm256_broadcastss_ps(_mm_movehdup_ps(p));
                    /* one add on the chain across super-blocks */
                    const __m256 mm = _mm256_mul_ps(_mm256_cvtepi32_ps(M[m]), mx);
                    lanes[m] = _mm256_add_ps(lanes[m],
                                             _mm256_fmsub_ps(_mm256_cvtepi32_ps(S[m]), dx, mm));
                }
            }
        }
        for (int m = 0; m < MB; m++) out[r][m] = tot[m] + hs_hsum(lanes[m]);
    }
}

#endif
