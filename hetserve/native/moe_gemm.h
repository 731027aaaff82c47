/* GEMM tiles for many tokens against int8 weights (one fp32 scale per row, the quad layout of
 * moe_quads.h): what prefill runs, where each expert (or linear) sees many tokens and the limit
 * is arithmetic, not bandwidth.
 *
 * The decode microkernel (quad_i8) sums each row's products across the 8 lanes of a vector and
 * takes 2 tokens at a time, so every 16 inputs it widens 4 rows' weights again and ends every
 * call with 8 horizontal sums. Here 16 rows of weights are first packed into a panel (per row
 * strip, once for all of the expert's tokens): their int8 values widened to int16 and stored
 * "rows in lanes", [K / 2][16 rows][2 inputs], so one 32-bit lane holds a row's pair of inputs.
 * The microkernel then broadcasts a token's pair of int16 activations to every lane and
 * multiply-adds it against the panel (vpmaddwd; AVX-512: vpdpwssd, 16 rows per vector): every
 * lane is one row's running sum, no horizontal sum is needed, and a panel vector loaded once
 * serves GEMM_NT tokens (6 on AVX2: 12 accumulators in the 16 registers; 12 on AVX-512 with
 * 32). On AVX2 at 2048 x 512 experts, 2048 tokens: 4 or 5 tokens ran 1.2-1.4x slower than 6;
 * pinning the accumulators (HS_PIN) made GCC 12 add register copies, ~1.1x slower. The
 * tokens' activations are packed too (gemm_pack_x, once per work item for all its strips):
 * a tile call then reads one sequential stream instead of NT rows K apart; on AVX-512 (Zen 4,
 * 2048 x 512 experts, 2,048 tokens) the expert layer ran 1.21-1.28x faster so, the microkernel
 * at ~0.94 of vpdpwssd's rate; on AVX2 it changed nothing. The callers pack into scratch;
 * where there is no memory for it they run the row kernels instead. The arithmetic is the
 * decode kernel's own: the same int16 x int8 products summed in int32 and turned into fp32 at
 * the same KBLOCK boundaries. quad_i8's lanes never overflow (moe_quads.h) and its horizontal
 * sum adds them modulo 2^32; a row's lane here adds the same
 * products modulo 2^32: the same residue, so both paths give the same bits, always. The choice
 * between them is only speed (gemm_worth).
 */
#ifndef HETSERVE_MOE_GEMM_H
#define HETSERVE_MOE_GEMM_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "moe_quads.h"
#include "simd.h"

#define GEMM_ROWS 16 /* rows per panel (a strip): 4 quads */
#define GEMM_KC 512  /* inputs per microkernel call (the panel chunk: 16 KiB, L1) */
#define GEMM_KC8 1024 /* the same for W8A8's byte panel (16 KiB too) */
#ifdef HS_AVX512
#define GEMM_NT 12 /* tokens per microkernel call */
#else
#define GEMM_NT 6
#endif
/* Tokens an expert (or a linear call) needs before the tiles beat the decode kernel: the panel
 * is packed once per strip and the microkernel's tail groups waste lanes below this. */
#define GEMM_MIN_TOKENS 8

static inline int gemm_worth(int tokens) {
    return tokens >= GEMM_MIN_TOKENS;
}

/* The same for int8 with row scales, whose row kernel takes I8_MB tokens a call: from 16 where
 * that is 4 (AVX-512; bench moe-kernel, 64 experts of 2048 x 512, top-6, Zen 4, 2 threads: 64 /
 * 128 tokens 11.5 / 21.1 -> 9.9 / 17.6 ms against 8, 24 and 32 within the noise of 16; a 2048 x
 * 3072 linear: 8-15 tokens as fast or faster on the rows), else GEMM_MIN_TOKENS (AVX2: 16
 * changed nothing). */
static inline int gemm_worth_i8(int tokens) {
    return tokens >= (I8_MB == 4 ? 16 : GEMM_MIN_TOKENS);
}

/* Puts quad j's 4 rows of 16 inputs (r[x]: row x's 16 16-bit values, input k in element k)
 * into dst, the panel's 8 input pairs of those inputs ([8][16 rows][2]): a 4 x 8 transpose of
 * the pairs' 32-bit lanes. */
static inline void gemm_panel_put(const __m256i r[4], int j, int16_t *dst) {
    /* lanes: r[x] = pairs 0..7 of row x; u_i = pairs (i, i + 4) of rows 0..3 */
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    const __m256i u[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                          _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    for (int i = 0; i < 4; i++) {
        int16_t *lo = dst + (size_t)i * 2 * GEMM_ROWS + 8 * j;
        int16_t *hi = dst + (size_t)(i + 4) * 2 * GEMM_ROWS + 8 * j;
        _mm_storeu_si128((__m128i *)lo, _mm256_castsi256_si128(u[i]));
        _mm_storeu_si128((__m128i *)hi, _mm256_extracti128_si256(u[i], 1));
    }
}

/* Packs the 4 quads q[0..3] (rows 4j..4j+3 of the strip from quad j, each [K / 16][4][16]
 * int8) into panel [K / 2][16][2] int16. Per quad and 16 inputs: its 4 rows widened to int16
 * (8 input pairs each, one pair per 32-bit lane), then gemm_panel_put's transpose. A NULL quad
 * packs as zeros (read from zero: 64 zero bytes). */
static inline void gemm_pack_n(const int8_t *const q[4], int K, int16_t *panel,
                               const int8_t *zero) {
    for (int c = 0; c < K / 16; c++) {
        int16_t *dst = panel + (size_t)c * 8 * 2 * GEMM_ROWS;
        for (int j = 0; j < 4; j++) {
            const int8_t *s = q[j] ? q[j] + 64 * (size_t)c : zero;
            __m256i r[4];
            for (int x = 0; x < 4; x++)
                r[x] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(s + 16 * x)));
            gemm_panel_put(r, j, dst);
        }
    }
}

/* c[m][0..15] += sum over input pairs kp in [kp0, kp1) of panel[kp][row] . (token m's pair
 * kp), for NT <= GEMM_NT tokens (a compile-time constant where inlined), modulo 2^32; the
 * tokens' activations packed by gemm_pack_x: token m's pair kp at xg[kp * GEMM_NT + m], one
 * sequential stream (12 rows K apart, read in place, ran the expert layer 1.21-1.28x slower on
 * AVX-512). */
static inline __attribute__((always_inline)) void gemm_tile(const int16_t *panel, int kp0,
                                                            int kp1, const int32_t *xg,
                                                            int32_t *const *c, const int NT,
                                                            const char *pf) {
#ifdef HS_AVX512
    __m512i acc[GEMM_NT];
#pragma GCC unroll 12
    for (int m = 0; m < NT; m++) acc[m] = _mm512_loadu_si512(c[m]);
    for (int kp = kp0; kp < kp1; kp++) {
        if (pf != NULL) _mm_prefetch(pf + 32 * (size_t)kp, _MM_HINT_T1); /* gemm_strip's next */
        const __m512i w = _mm512_loadu_si512(panel + (size_t)kp * 2 * GEMM_ROWS);
        const int32_t *xk = xg + (size_t)kp * GEMM_NT;
#pragma GCC unroll 12
        for (int m = 0; m < NT; m++)
            acc[m] = _mm512_dpwssd_epi32(acc[m], w, _mm512_set1_epi32(xk[m]));
    }
#pragma GCC unroll 12
    for (int m = 0; m < NT; m++) _mm512_storeu_si512(c[m], acc[m]);
#else
    __m256i lo[GEMM_NT], hi[GEMM_NT];
#pragma GCC unroll 6
    for (int m = 0; m < NT; m++) {
        lo[m] = _mm256_loadu_si256((const __m256i *)c[m]);
        hi[m] = _mm256_loadu_si256((const __m256i *)(c[m] + 8));
    }
    for (int kp = kp0; kp < kp1; kp++) {
        if (pf != NULL) _mm_prefetch(pf + 32 * (size_t)kp, _MM_HINT_T1);
        const int16_t *p = panel + (size_t)kp * 2 * GEMM_ROWS;
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)p);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + 16));
        const int32_t *xk = xg + (size_t)kp * GEMM_NT;
#pragma GCC unroll 6
        for (int m = 0; m < NT; m++) {
            const __m256i xb = _mm256_set1_epi32(xk[m]);
            lo[m] = _mm256_add_epi32(lo[m], _mm256_madd_epi16(w0, xb));
            hi[m] = _mm256_add_epi32(hi[m], _mm256_madd_epi16(w1, xb));
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < NT; m++) {
        _mm256_storeu_si256((__m256i *)c[m], lo[m]);
        _mm256_storeu_si256((__m256i *)(c[m] + 8), hi[m]);
    }
#endif
}

/* gemm_tile for n <= GEMM_NT tokens, n a run-time value (each count its own copy); pf: see
 * gemm_strip (NULL: no prefetch). */
static inline void gemm_tile_n(const int16_t *panel, int kp0, int kp1, const int32_t *xg,
                               int32_t *const *c, int n, const char *pf) {
    switch (n) {
#define HS_N(v) case v: gemm_tile(panel, kp0, kp1, xg, c, v, pf); break;
    HS_N(1) HS_N(2) HS_N(3) HS_N(4) HS_N(5) HS_N(6)
#ifdef HS_AVX512
    HS_N(7) HS_N(8) HS_N(9) HS_N(10) HS_N(11) HS_N(12)
#endif
#undef HS_N
    default: break;
    }
}

/* Bytes of n tokens' K inputs packed by gemm_pack_x (whole groups of GEMM_NT). */
static inline size_t gemm_xp_bytes(int n, int K) {
    return (size_t)(n + GEMM_NT - 1) / GEMM_NT * GEMM_NT * (size_t)K * sizeof(int16_t);
}

/* Packs n tokens' int16 rows of K inputs (from base: row tok[m] where tok, else row m; rows
 * `stride` int16 apart) for gemm_tile: per group of GEMM_NT tokens, [K / 2][GEMM_NT] int32 (a
 * token's pair of inputs), group g at xp + g * GEMM_NT * K / 2. The last group's missing tokens
 * are zeros. */
static inline void gemm_pack_xs(const int16_t *base, const int *tok, int n, int K, int stride,
                                int32_t *xp) {
    const int KP = K / 2;
    for (int g0 = 0; g0 < n; g0 += GEMM_NT) {
        const int nt = n - g0 < GEMM_NT ? n - g0 : GEMM_NT;
        int32_t *dst = xp + (size_t)g0 * KP;
        const int32_t *src[GEMM_NT];
        for (int m = 0; m < nt; m++)
            src[m] = (const int32_t *)(base + (size_t)(tok ? tok[g0 + m] : g0 + m) * stride);
        for (int kp = 0; kp < KP; kp++) {
            int32_t *d = dst + (size_t)kp * GEMM_NT;
            for (int m = 0; m < nt; m++) d[m] = src[m][kp];
            for (int m = nt; m < GEMM_NT; m++) d[m] = 0;
        }
    }
}

static inline void gemm_pack_x(const int16_t *base, const int *tok, int n, int K, int32_t *xp) {
    gemm_pack_xs(base, tok, n, K, K, xp);
}

#ifdef HS_AVX512
/* ---- W8A8 (moe_job.h's F_A8): int8 activations, bytes times bytes ----
 *
 * Where the activation rows were rounded to the int8 range (|x| <= 127), the tiles multiply
 * bytes: vpdpbusd adds 4 products of an unsigned byte and a signed byte into each int32 lane,
 * 64 products an instruction against vpdpwssd's 32 (a standalone microbenchmark of the tile
 * loop on Zen 4: 457 against 230 GOPS a core). The activations go in as u = x + 128 (unsigned)
 * and the weights as they are, so a lane gains sum u w = sum x w + 128 sum w; 128 times each
 * row's weight sum per KBLOCK (computed once per strip when its panel is packed) is taken off
 * before the float add. Everything wraps modulo 2^32 and the exact sum fits int32 (|sum x w|
 * <= 127 * 127 * KBLOCK), so what is left is exactly the int16 path's sum of the same rows:
 * the same bits as the quads and the vpdpwssd tiles on the same rows, whichever runs.
 *
 * Layouts: the panel is AMX's B tile layout, [K / 4][16 rows][4 inputs] int8 (amx_pack in
 * moe_amx.h), followed by the corrections [K / KBLOCK rounded up][16] int32; the activations
 * per group of GEMM_NT tokens [K / 4][GEMM_NT] int32 (a token's 4 bytes). */

/* The corrections of an a8 panel: 128 * the sum of each row's weights per KBLOCK, written
 * after the panel. */
static inline void gemm_panel8_corr(int8_t *panel, int K) {
    int32_t *corr = (int32_t *)(panel + (size_t)K * GEMM_ROWS);
    const __m512i ones = _mm512_set1_epi8(1);
    for (int kb = 0, b = 0; kb < K; kb += KBLOCK, b++) {
        const int ke = kb + KBLOCK < K ? kb + KBLOCK : K;
        __m512i sum = _mm512_setzero_si512();
        for (int kq = kb / 4; kq < ke / 4; kq++)
            sum = _mm512_dpbusd_epi32(sum, ones, _mm512_loadu_si512(panel + (size_t)kq * 64));
        _mm512_storeu_si512(corr + GEMM_ROWS * b, _mm512_slli_epi32(sum, 7));
    }
}

/* c[m][0..15] += sum over input quads kq in [kq0, kq1) of panel[kq][row] . (token m's 4
 * bytes u = x + 128), modulo 2^32, for NT <= GEMM_NT tokens packed by gemm_pack_x8. */
static inline __attribute__((always_inline)) void gemm_tile8(const int8_t *panel, int kq0,
                                                             int kq1, const int32_t *xg,
                                                             int32_t *const *c, const int NT,
                                                             const char *pf) {
    __m512i acc[GEMM_NT];
#pragma GCC unroll 12
    for (int m = 0; m < NT; m++) acc[m] = _mm512_loadu_si512(c[m]);
    for (int kq = kq0; kq < kq1; kq++) {
        if (pf != NULL) _mm_prefetch(pf + 64 * (size_t)kq, _MM_HINT_T1); /* gemm_strip's next */
        const __m512i w = _mm512_loadu_si512(panel + (size_t)kq * 64);
        const int32_t *xk = xg + (size_t)kq * GEMM_NT;
#pragma GCC unroll 12
        for (int m = 0; m < NT; m++)
            acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_set1_epi32(xk[m]), w);
    }
#pragma GCC unroll 12
    for (int m = 0; m < NT; m++) _mm512_storeu_si512(c[m], acc[m]);
}

static inline void gemm_tile8_n(const int8_t *panel, int kq0, int kq1, const int32_t *xg,
                                int32_t *const *c, int n, const char *pf) {
    switch (n) {
#define HS_N(v) case v: gemm_tile8(panel, kq0, kq1, xg, c, v, pf); break;
    HS_N(1) HS_N(2) HS_N(3) HS_N(4) HS_N(5) HS_N(6)
    HS_N(7) HS_N(8) HS_N(9) HS_N(10) HS_N(11) HS_N(12)
#undef HS_N
    default: break;
    }
}

/* Packs n tokens' rows of K int16 (|x| <= 127; from base: row tok[m] where tok, else row m;
 * K % 16 == 0) for gemm_tile8: per group of GEMM_NT tokens [K / 4][GEMM_NT] int32 holding the
 * bytes x + 128, group g at xp + g * GEMM_NT * K / 4; the last group's missing tokens zeros. */
static inline void gemm_pack_x8(const int16_t *base, const int *tok, int n, int K, int32_t *xp) {
    const int KQ = K / 4;
    const __m128i flip = _mm_set1_epi8((char)0x80);
    for (int g0 = 0; g0 < n; g0 += GEMM_NT) {
        const int nt = n - g0 < GEMM_NT ? n - g0 : GEMM_NT;
        int32_t *dst = xp + (size_t)g0 * KQ;
        for (int m = 0; m < GEMM_NT; m++) {
            if (m >= nt) {
                for (int kq = 0; kq < KQ; kq++) dst[(size_t)kq * GEMM_NT + m] = 0;
                continue;
            }
            const int16_t *src = base + (size_t)(tok ? tok[g0 + m] : g0 + m) * K;
            for (int k = 0; k < K; k += 16) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(src + k));
                const __m128i b = _mm_xor_si128(_mm256_cvtepi16_epi8(v), flip);
                int32_t *d = dst + (size_t)(k / 4) * GEMM_NT + m;
                d[0] = _mm_extract_epi32(b, 0);
                d[GEMM_NT] = _mm_extract_epi32(b, 1);
                d[2 * GEMM_NT] = _mm_extract_epi32(b, 2);
                d[3 * GEMM_NT] = _mm_extract_epi32(b, 3);
            }
        }
    }
}

#endif /* HS_AVX512 */

/* out[m][r] = the strip's 16 rows against n tokens packed by gemm_pack_x (xp: the first
 * token's group): exactly quad_i8's sums, in fp32 (the sum of each KBLOCK inputs' int32 sum, in
 * order). The panel is read a GEMM_KC chunk at a time for all n tokens, so the chunk stays in
 * L1 while the tokens' sums wait in isum (scratch [n][16] int32). a8 (set on AVX-512 only): a
 * byte panel with its corrections (gemm_panel8_corr) and tokens packed by gemm_pack_x8,
 * GEMM_KC8 inputs a chunk, each KBLOCK's corrections taken off before its float add: the same
 * sums, the same float steps. next (or NULL): the next strip's 16 * K bytes of int8 weights,
 * fetched into L2 a line per input quad (pair: every other) while the first tokens' tiles run,
 * so a caller packing strip after strip from memory (a linear at a few dozen tokens: batched
 * decode) finds them there instead of waiting for each strip between its tiles. */
static inline __attribute__((always_inline)) void gemm_strip(const void *panel, int K,
                                                             const int32_t *xp, int n,
                                                             int32_t *isum, float *out,
                                                             const int a8, const char *next) {
    const int per = a8 ? 4 : 2; /* inputs per packed word */
    const int kc = a8 ? GEMM_KC8 : GEMM_KC;
    const int32_t *corr =
        a8 ? (const int32_t *)((const int8_t *)panel + (size_t)K * GEMM_ROWS) : NULL;
    for (int i = 0; i < n * GEMM_ROWS; i++) out[i] = 0.0f;
    for (int kb = 0, b = 0; kb < K; kb += KBLOCK, b++) {
        const int ke = kb + KBLOCK < K ? kb + KBLOCK : K;
        memset(isum, 0, sizeof(int32_t) * GEMM_ROWS * (size_t)n);
        for (int k0 = kb; k0 < ke; k0 += kc) {
            const int k1 = k0 + kc < ke ? k0 + kc : ke;
            for (int m0 = 0; m0 < n; m0 += GEMM_NT) {
                const int nt = n - m0 < GEMM_NT ? n - m0 : GEMM_NT;
                int32_t *c[GEMM_NT];
                for (int m = 0; m < nt; m++) c[m] = isum + (size_t)(m0 + m) * GEMM_ROWS;
                const int32_t *xg = xp + (size_t)m0 * (K / per);
                const char *pf = m0 == 0 ? next : NULL; /* once per strip */
#ifdef HS_AVX512
                if (a8) {
                    gemm_tile8_n((const int8_t *)panel, k0 / 4, k1 / 4, xg, c, nt, pf);
                    continue;
                }
#endif
                gemm_tile_n((const int16_t *)panel, k0 / 2, k1 / 2, xg, c, nt, pf);
            }
        }
        for (int m = 0; m < n; m++)
            for (int r = 0; r < GEMM_ROWS; r++) {
                const uint32_t v = (uint32_t)isum[m * GEMM_ROWS + r] -
                                   (corr ? (uint32_t)corr[GEMM_ROWS * b + r] : 0u);
                out[m * GEMM_ROWS + r] += (float)(int32_t)v;
            }
    }
}

#endif
