/* q4_K (llama.cpp's GGUF type) microkernel: the super-block's own numbers, in the quad layout.
 *
 * A q4_K row is split into super-blocks of 256 columns, each with an fp16 scale d and minimum
 * dmin and, per sub-block of 32 columns, 6-bit integers sc and m: w = d * sc * q - dmin * m,
 * q in [0, 15]. 144 bytes per 256 weights (4.5 bits each), as in the file. The kernel stores
 * exactly that many bytes per row, rearranged for a row quad (4 rows), per super-block (576
 * bytes; sub-block j = 4g + i of row r has place p = 16g + 4r + i):
 *
 *   [0, 8)     d of rows 0-3 (fp16)          [8, 16)   dmin of rows 0-3 (fp16)
 *   [16, 48)   byte p: low 4 bits of sc | low 4 bits of m << 4
 *   [48, 56)   byte p % 8: the high 2 bits of sc at bits 2 (p / 8), 2 (p / 8) + 1
 *   [56, 64)   the same for m
 *   [64, 576)  8 vectors of 64 bytes, vector k: byte 16r + 4i + t = column 4 (k / 2) + t of
 *              sub-block 4 (k % 2) + i of row r (low nibble) | column 16 + 4 (k / 2) + t
 *              (high nibble), t < 4
 *
 * So each 32-bit lane of a vector holds one row's sub-block (16 lanes: 4 rows x 4 sub-blocks,
 * even vectors sub-blocks 0-3, odd ones 4-7), vpdpbusd sums 4 products per lane with nothing
 * per sub-block inside the loop, and the sub-block scales join once per super-block. The kernel
 * takes quads in pairs, which share every activation load (quad_q4k). The layout is for the
 * instruction count, which is what bounds this kernel: ~11 cycles per quad and super-block from
 * L1 on a Zen 5 core, where spreading each sub-block's scales inside the loop took ~25.
 *
 * Activations meet the nibbles as llama.cpp's q4_K x q8_K product does: int8 per super-block
 * of 256 columns, scale amax / 127 (|x - x_hat| <= amax / 254 of that super-block), stored in the
 * weights' column order (byte 32k + 16h + 4i + t: column 32j + 16h + 4 (k / 2) + t of
 * sub-block j = 4 (k % 2) + i), so the 16 bytes for vector k's low (h = 0) or high (h = 1)
 * nibbles, the same for every row, are one broadcast load. The minimum term needs only the
 * activations' sums per sub-block (vpmaddwd with m). Every integer step is exact: with AVX-512
 * (HS_AVX512) a sum per token, quad, vector parity and nibble holds 16 products of at most
 * 15 * 127 (30480 < 2^15), so vpdpwssd by sc (zero-extended to 32 bits) multiplies it exactly;
 * the AVX2 path sums 4 products per int16 lane (vpmaddubsw), widens them (vpmaddwd by ones)
 * and multiplies by vpmulld. The int32 sums are equal and the fp32 steps per super-block and lane
 * the same, so the two paths' results are bit-identical.
 */
#ifndef HETSERVE_MOE_Q4K_H
#define HETSERVE_MOE_Q4K_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "moe_formats.h"

#define Q4K_SB 256          /* columns per super-block */
#define Q4K_QUAD_BYTES 576  /* 4 rows x 144 bytes */

/* One activation row for the q4_K kernel: int8 values x [K] in the weights' column order, their
 * scale per super-block d [K / 256], and their sums per sub-block, per super-block 8 int16 in
 * the order the minimum term pairs them (sub-blocks 0, 4, 1, 5, 2, 6, 3, 7), then the same 8. */
typedef struct {
    const int8_t *x;
    const float *d;    /* [K / 256] */
    const int16_t *gs; /* [K / 256][16] */
} q4k_act_t;

/* Row r of int8 activation rows of K columns: values x8 [rows, K], scales d [rows, K / 256],
 * sums gs [rows, K / 256, 16] (q4k_quantize writes them). */
static inline q4k_act_t q4k_row(const int8_t *x8, const float *d, const int16_t *gs, int K,
                                int r) {
    const size_t nsb = (size_t)(K / Q4K_SB);
    const q4k_act_t a = {x8 + (size_t)r * K, d + r * nsb, gs + r * nsb * 16};
    return a;
}

/* One fp32 row x [K] -> its int8 values x8 [K] (round to nearest even, as llama.cpp's q8_K) in
 * the kernel's column order (see the top of this file), scales d [K / 256] and sums
 * gs [K / 256][16] (see q4k_act_t). Each super-block stands alone, so rows back to back are one
 * call (K: their columns together), read back with q4k_row. */
static void q4k_quantize(const float *x, int K, int8_t *x8, float *d, int16_t *gs) {
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int s = 0; s < K / Q4K_SB; s++) {
        const float *row = x + (size_t)s * Q4K_SB;
        const float amax = hs_absmax(row, Q4K_SB);
        d[s] = amax / 127.0f;
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i c[8]; /* sub-block j's 32 values in column order */
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
            c[j] = _mm256_permutevar8x32_epi32(b, order);
            const __m256i t = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]),
                                               _mm256_add_epi32(v[2], v[3]));
            gs[16 * s + 2 * (j & 3) + (j >> 2)] = (int16_t)hs_hsum_i32(t);
        }
        memcpy(gs + 16 * s + 8, gs + 16 * s, 8 * sizeof(int16_t));
        /* per 128-bit half h, a 4 x 4 transpose of 4-column groups: group 4h + k / 2 of
         * sub-block 4g + i -> group 4h + i of vector k = 2 (k / 2) + g */
        __m256i *o = (__m256i *)(x8 + (size_t)s * Q4K_SB);
        for (int g = 0; g < 2; g++) {
            const __m256i *cg = c + 4 * g;
            const __m256i p0 = _mm256_unpacklo_epi32(cg[0], cg[1]);
            const __m256i p1 = _mm256_unpackhi_epi32(cg[0], cg[1]);
            const __m256i p2 = _mm256_unpacklo_epi32(cg[2], cg[3]);
            const __m256i p3 = _mm256_unpackhi_epi32(cg[2], cg[3]);
            _mm256_storeu_si256(o + g, _mm256_unpacklo_epi64(p0, p2));
            _mm256_storeu_si256(o + 2 + g, _mm256_unpackhi_epi64(p0, p2));
            _mm256_storeu_si256(o + 4 + g, _mm256_unpacklo_epi64(p1, p3));
            _mm256_storeu_si256(o + 6 + g, _mm256_unpackhi_epi64(p1, p3));
        }
    }
}

/* The 6-bit sc (which = 0) or m (which = 1) of the quad's super-block as bytes 16g + 4r + i
 * (sub-block 4g + i of row r). */
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

/* One super-block's fp32 step for one token and two rows (lane 4r + i): tot += acc * d[r] * xd -
 * mins * dmin[r] * xd. */
static inline __m256 q4k_step(__m256 tot, __m256i acc, __m256i mins, __m256 d, __m256 dm,
                              __m256 xd) {
    tot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(d, xd), tot);
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dm, xd), tot);
}

/* Line l (0: the header, 1 + k: vector k) of quad i < NQ in the super-block at q: the NQ quads
 * interleave by 64-byte line (quad_q4k). */
static inline const uint8_t *q4k_line(const uint8_t *q, int NQ, int l, int i) {
    return q + 64 * (NQ * l + i);
}

/* The high nibbles of every byte: a shift and a mask, or (GFNI) one affine byte op whose matrix
 * moves bits 4-7 to 0-3 and clears the rest. */
#ifdef HS_AVX512
static inline __m512i q4k_high(__m512i w) {
#ifdef __GFNI__
    return _mm512_gf2p8affine_epi64_epi8(w, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
    return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F));
#endif
}
#endif

/* Per token and quad i < NQ (see quad_q4k), the super-block's integer sums as int32 lanes
 * 4r + i', rows 0-1 then rows 2-3: sc[r][i'] * dot[r][i'] + sc[r][4 + i'] * dot[r][4 + i']
 * (dot: a sub-block's nibbles x activations). Two quads share each activation load. */
static inline __attribute__((always_inline)) void q4k_sums(const uint8_t *q, int NQ,
                                                           const int8_t *x[2], int MB,
                                                           const __m256i sc[2],
                                                           __m256i acc[2][2][2]) {
#ifdef HS_AVX512
    /* per token and quad: sums by group g (vectors k = g mod 2) and nibble h, 4 products per
     * vpdpbusd lane; each at most 16 x 15 x 127 < 2^15, so vpdpwssd by sc (zero-extended to 32
     * bits) multiplies it exactly */
    const __m512i nib = _mm512_set1_epi8(0x0F);
    __m512i dot[2][2][2][2]; /* [token][quad][g][h] */
    for (int m = 0; m < MB; m++)
        for (int i = 0; i < NQ; i++)
            for (int g = 0; g < 2; g++) dot[m][i][g][0] = dot[m][i][g][1] = _mm512_setzero_si512();
    for (int k = 0; k < 8; k++) {
        __m512i xl[2], xh[2];
        for (int m = 0; m < MB; m++) {
            const __m128i *xk = (const __m128i *)(x[m] + 32 * k);
            xl[m] = _mm512_broadcast_i32x4(_mm_loadu_si128(xk));
            xh[m] = _mm512_broadcast_i32x4(_mm_loadu_si128(xk + 1));
        }
        for (int i = 0; i < NQ; i++) {
            const uint8_t *v = q4k_line(q, NQ, 1 + k, i);
            hs_prefetch_mb(v, MB);
            __m512i w = _mm512_loadu_si512(v);
            HS_PIN(w); /* one load: GCC would fold it into both uses */
            const __m512i lo = _mm512_and_si512(w, nib), hi = q4k_high(w);
            for (int m = 0; m < MB; m++) {
                __m512i *dk = dot[m][i][k & 1];
                dk[0] = _mm512_dpbusd_epi32(dk[0], lo, xl[m]);
                dk[1] = _mm512_dpbusd_epi32(dk[1], hi, xh[m]);
            }
        }
    }
    for (int i = 0; i < NQ; i++) {
        const __m512i s0 = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(sc[i]));
        const __m512i s1 = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(sc[i], 1));
        for (int m = 0; m < MB; m++) {
            __m512i t = _mm512_dpwssd_epi32(_mm512_setzero_si512(), dot[m][i][0][0], s0);
            t = _mm512_dpwssd_epi32(t, dot[m][i][0][1], s0);
            t = _mm512_dpwssd_epi32(t, dot[m][i][1][0], s1);
            t = _mm512_dpwssd_epi32(t, dot[m][i][1][1], s1);
            acc[m][i][0] = _mm512_castsi512_si256(t);
            acc[m][i][1] = _mm512_extracti64x4_epi64(t, 1);
        }
    }
#else
    /* per token, quad, group g and rows 0-1 | 2-3: sums of 8 products per lane (vpmaddubsw,
     * vpmaddwd by ones), times sc by vpmulld */
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < NQ; i++) {
        __m256i dot[2][2][2];
        for (int m = 0; m < MB; m++)
            for (int g = 0; g < 2; g++) dot[m][g][0] = dot[m][g][1] = _mm256_setzero_si256();
        for (int k = 0; k < 8; k++) {
            const uint8_t *v = q4k_line(q, NQ, 1 + k, i);
            hs_prefetch_mb(v, MB);
            for (int half = 0; half < 2; half++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(v + 32 * half));
                const __m256i lo = _mm256_and_si256(w, nib);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
                for (int m = 0; m < MB; m++) {
                    const __m128i *xk = (const __m128i *)(x[m] + 32 * k);
                    const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128(xk));
                    const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128(xk + 1));
                    const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl),
                                                       _mm256_maddubs_epi16(hi, xh));
                    __m256i *dk = &dot[m][k & 1][half];
                    *dk = _mm256_add_epi32(*dk, _mm256_madd_epi16(t, ones));
                }
            }
        }
        const __m128i sl = _mm256_castsi256_si128(sc[i]), sh = _mm256_extracti128_si256(sc[i], 1);
        for (int half = 0; half < 2; half++) {
            const __m256i s0 = _mm256_cvtepu8_epi32(half ? _mm_srli_si128(sl, 8) : sl);
            const __m256i s1 = _mm256_cvtepu8_epi32(half ? _mm_srli_si128(sh, 8) : sh);
            for (int m = 0; m < MB; m++)
                acc[m][i][half] = _mm256_add_epi32(_mm256_mullo_epi32(dot[m][0][half], s0),
                                                   _mm256_mullo_epi32(dot[m][1][half], s1));
        }
    }
#endif
}

/* out[4i + r][m] = sum_k W[4i + r, k] * x[m, k] for NQ <= 2 quads of q4_K rows and MB <= 2
 * tokens. The quads' super-blocks interleave by 64-byte line (super-block s at q + 576 NQ s: the
 * quads' first 64 bytes, then their vectors k = 0, 1, ... in turn), so the kernel reads its lines
 * in address order: two quads stored one after the other and read in turn stream ~1.15x slower
 * from DRAM. */
static inline __attribute__((always_inline)) void quad_q4k(const uint8_t *q, int NQ, int K,
                                                           const q4k_act_t a[2], int MB,
                                                           float out[][MBMAX]) {
    const __m256i i01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i i23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const __m256i four = _mm256_set1_epi32(4);
    __m256 tot[2][2][2]; /* per token and quad: rows 0-1, rows 2-3 */
    for (int m = 0; m < MB; m++)
        for (int i = 0; i < NQ; i++) tot[m][i][0] = tot[m][i][1] = _mm256_setzero_ps();
    for (int s = 0; s < K / Q4K_SB; s++, q += NQ * Q4K_QUAD_BYTES) {
        __m256i sc[2], mn[2];
        for (int i = 0; i < NQ; i++) {
            const uint8_t *h = q4k_line(q, NQ, 0, i);
            hs_prefetch_mb(h, MB);
            sc[i] = q4k_six(h, 0);
            mn[i] = q4k_six(h, 1);
        }
        const int8_t *x[2] = {a[0].x + (size_t)s * Q4K_SB, a[MB - 1].x + (size_t)s * Q4K_SB};
        __m256i acc[2][2][2];
        q4k_sums(q, NQ, x, MB, sc, acc);
        for (int i = 0; i < NQ; i++) {
            const uint8_t *h = q4k_line(q, NQ, 0, i);
            const __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
            /* the minimums' int16 pairs per lane 4r + i': m[r][i'], m[r][4 + i'] */
            const __m128i ml = _mm256_castsi256_si128(mn[i]);
            const __m128i mh = _mm256_extracti128_si256(mn[i], 1);
            const __m256i mn01 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(ml, mh));
            const __m256i mn23 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(ml, mh));
            /* d and dmin per lane: rows 0-1 | rows 2-3 */
            const __m256 d01 = _mm256_permutevar8x32_ps(dd, i01);
            const __m256 d23 = _mm256_permutevar8x32_ps(dd, i23);
            const __m256 m01 = _mm256_permutevar8x32_ps(dd, _mm256_add_epi32(i01, four));
            const __m256 m23 = _mm256_permutevar8x32_ps(dd, _mm256_add_epi32(i23, four));
            for (int m = 0; m < MB; m++) {
                const __m256 xd = _mm256_broadcast_ss(a[m].d + s);
                const __m256i g = _mm256_loadu_si256((const __m256i *)(a[m].gs + 16 * s));
                __m256 *t = tot[m][i];
                t[0] = q4k_step(t[0], acc[m][i][0], _mm256_madd_epi16(mn01, g), d01, m01, xd);
                t[1] = q4k_step(t[1], acc[m][i][1], _mm256_madd_epi16(mn23, g), d23, m23, xd);
            }
        }
    }
    for (int m = 0; m < MB; m++)
        for (int i = 0; i < NQ; i++) {
            float t[16];
            _mm256_storeu_ps(t, tot[m][i][0]);
            _mm256_storeu_ps(t + 8, tot[m][i][1]);
            for (int r = 0; r < 4; r++)
                out[4 * i + r][m] = (t[4 * r] + t[4 * r + 1]) + (t[4 * r + 2] + t[4 * r + 3]);
        }
}

#endif
