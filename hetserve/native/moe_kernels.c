/* Routed-experts kernels for AVX2 + FMA CPUs: weight-only int8 / int4, plain fp32, and the
 * formats checkpoints publish (grouped int8, MXFP4, FP8: moe_formats.h).
 *
 * One call computes one MoE layer: out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]) with
 *   a[p, i] = silu(x_t . W1[e, i]) * (x_t . W3[e, i]) * w_p      (phase 1, gate+up fused)
 *   y[p, n] = a_p . W2[e, n]                                      (phase 2)
 * where p runs over the (token, slot) pairs counting-sorted by expert e. Routing, gathers and
 * the final sum happen here too, so Python makes one call per layer and no host sync.
 * Weight-only quantization: int8 and int4 weights meet activations rounded to int16 per row
 * (|x - x_hat| <= max|x| / 32766, about a hundredth of int8's weight rounding), so one
 * vpmaddwd does 16 exact integer multiply-adds. fp32 reads the model's own weights with fp32
 * activations (CPU-only serving of an unquantized model), FP8 converts its weights to fp32 in
 * registers. Projections may carry biases, and the gate may be gpt-oss's clamped SwiGLU
 * (act = 1) instead of silu (act = 0). Each phase's row
 * quads are shared out by the parallel loop (pool.c, OpenMP), with a join between the phases
 * (phase 2 reads all of phase 1). Built and cached by hetserve/native/__init__.py
 * (no torch headers).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe_formats.h"
#include "pool.h"
#include "simd.h"

#define MBMAX 3 /* tokens per microkernel call (fp32; the int8/int4 ones take up to 2) */
#define TB 32 /* pairs per cache block: 32 x 2048 fp32 = 256 KiB, half of Zen 3's L2 */
#define RC 8  /* row quads per work chunk */
/* Software prefetch distance in bytes. One cache line per loop iteration is consumed; the
 * out-of-order window alone keeps only ~15 lines in flight (~10 GB/s per core at DRAM latency),
 * so the stream is prefetched this far ahead (it runs into the next quad, which is adjacent). */
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T0
#endif
#ifndef PF_DIST
#define PF_DIST 2048
#endif

/* Weight formats (hetserve/moe/cpu_native.py passes the same numbers). */
enum { F_F32 = 0, F_I8 = 1, F_I4 = 2, F_MXFP4 = 3, F_FP8 = 4 };

typedef struct {
    int fmt, H, I, G;      /* G: columns per scale group, 0 = one scale per row (int8) */
    int act;               /* 0 silu, 1 clamped SwiGLU (gpt-oss) */
    float alpha, limit;
    const float *b13, *b2; /* biases [E, 2I] (gate then up) and [E, H], or NULL */
    const float *x;        /* [T, H] fp32 tokens */
    const void *w13, *w2;  /* quad-interleaved weights, see quad_i8 / quad_i4 */
    const void *s13, *s2;  /* scales: fp32, or e8m0 bytes (MXFP4) */
    const float *m13, *m2;
    const int *tok;        /* [P] token of pair p (pairs sorted by expert) */
    const float *pw;       /* [P] router weight of pair p */
    float *a, *y;          /* [P, I], [P, H] */
    int16_t *x16, *a16;    /* [T, H], [P, I] activations as int16 */
    float *xsc, *asc;      /* their per-row scales [T], [P] */
    float *xgs, *ags;      /* int4 only: per-group sums of x16 / a16 [T, H/G], [P, I/G] */
    int n_active;
    const int *act_e, *act_off, *act_cnt;
    int nthreads;
} job_t;

static inline int hsum_i32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

/* int16 activations keep |x16| <= ACT_Q, so a vpmaddwd lane gains at most 2 * 127 * ACT_Q per
 * 16 inputs and KBLOCK inputs fit int32 exactly (KBLOCK/16 * 2 * 127 * 16383 < 2^31). */
#define ACT_Q 16383
#define KBLOCK 4096

/* out[r][m] = sum_k W[r, k] * x16[m, k] for one quad of int8 rows and MB <= 2 tokens: 16
 * weights per vpmovsxbw + vpmaddwd, a third of the uops of converting to fp32. Quad layout:
 * for each 16 inputs, the 4 rows' 16 bytes back to back, so a quad is one sequential stream of
 * whole cache lines (four strided row streams ran at half the speed: prefetch-bound). */
static inline __attribute__((always_inline)) void quad_i8(const int8_t *q, int K,
                                                          const int16_t *const x[2], int MB,
                                                          float out[4][MBMAX]) {
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < MB; m++) out[r][m] = 0.0f;
    for (int kb = 0; kb < K; kb += KBLOCK) {
        int ke = kb + KBLOCK < K ? kb + KBLOCK : K;
        __m256i acc[4][2];
        for (int r = 0; r < 4; r++)
            for (int m = 0; m < MB; m++) acc[r][m] = _mm256_setzero_si256();
        for (int k = kb; k < ke; k += 16) {
            _mm_prefetch((const char *)(q + 4 * k + PF_DIST), PF_HINT);
            __m256i w[4];
            for (int r = 0; r < 4; r++)
                w[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 4 * k + 16 * r)));
            for (int m = 0; m < MB; m++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(x[m] + k));
                for (int r = 0; r < 4; r++)
                    acc[r][m] = _mm256_add_epi32(acc[r][m], _mm256_madd_epi16(w[r], xv));
            }
        }
        for (int r = 0; r < 4; r++)
            for (int m = 0; m < MB; m++) out[r][m] += (float)hsum_i32(acc[r][m]);
    }
}

/* fp32 weights in their plain row-major layout (the model's own tensors, no copy): rows
 * w[r * K ...] for r < 4 against MB <= 3 fp32 tokens; K % 8 == 0. Three tokens give 12
 * independent FMA chains (two FMA ports x 4 cycles of latency need at least 8, and 8 left the
 * loop stalling on every hiccup) in the 16 ymm registers with the 3 tokens and one weight. */
static inline __attribute__((always_inline)) void quad_f32(const float *w, int K,
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
    __m256 v[8];
    float sums[16];
    for (int half = 0; half < 2; half++) { /* (r, m) pairs 0-7, then 8-11 padded with zeros */
        for (int i = 0; i < 8; i++) {
            int pr = 8 * half + i, r = pr / MBMAX, m = pr % MBMAX;
            v[i] = pr < 4 * MBMAX && m < MB ? acc[r][m] : _mm256_setzero_ps();
        }
        _mm256_storeu_ps(sums + 8 * half, hs_hsum8(v));
    }
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < MB; m++) out[r][m] = sums[MBMAX * r + m];
}

/* x16[p] = round(x[p] / scale[p]), scale[p] = max|x[p]| / ACT_Q, for rows [p0, p1); with
 * G > 0 also gsum[p, g] = sum of x16[p] over group g (exact: |sum| <= 128 * ACT_Q < 2^24).
 * perm = 1 stores each 32 in the order the nibble kernels split them (int4, MXFP4):
 * [0 4 .. 28 | 1 5 .. 29 | 2 6 .. 30 | 3 7 .. 31]. */
static void quantize_rows(const float *x, int K, int p0, int p1, int16_t *x16, float *scale,
                          int perm, int G, float *gsum) {
    int16_t tmp[32];
    /* K % 32 == 0 (checked by the caller). Vectorized: at one token this runs on one thread
     * between the phases, so a scalar loop would be a visible slice of the layer. */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int p = p0; p < p1; p++) {
        const float *row = x + (size_t)p * K;
        int16_t *out = x16 + (size_t)p * K;
        __m256 vmax = _mm256_setzero_ps();
        for (int k = 0; k < K; k += 8)
            vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(row + k)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        float mx = _mm_cvtss_f32(m4);
        float s = mx > 0.0f ? mx / ACT_Q : 1.0f;
        const __m256 inv = _mm256_set1_ps(1.0f / s);
        const __m256i lim = _mm256_set1_epi32(ACT_Q), nlim = _mm256_set1_epi32(-ACT_Q);
        for (int k = 0; k < K; k += 32) {
            __m256i h[2];
            for (int half = 0; half < 2; half++) {
                /* round to nearest even (MXCSR default), clamp, pack 2 x 8 int32 -> 16 int16 */
                const float *src = row + k + 16 * half;
                __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src), inv));
                __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + 8), inv));
                a = _mm256_max_epi32(_mm256_min_epi32(a, lim), nlim);
                b = _mm256_max_epi32(_mm256_min_epi32(b, lim), nlim);
                h[half] = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
            }
            if (perm) { /* runs once per row between the phases: a scalar reorder is fine */
                _mm256_storeu_si256((__m256i *)tmp, h[0]);
                _mm256_storeu_si256((__m256i *)(tmp + 16), h[1]);
                for (int i = 0; i < 32; i++) out[k + i] = tmp[4 * (i % 8) + i / 8];
            } else {
                _mm256_storeu_si256((__m256i *)(out + k), h[0]);
                _mm256_storeu_si256((__m256i *)(out + k + 16), h[1]);
            }
        }
        scale[p] = s;
        if (G > 0)
            for (int g = 0; g < K / G; g++) {
                int sum = 0;
                for (int k = g * G; k < (g + 1) * G; k++) sum += out[k];
                gsum[(size_t)p * (K / G) + g] = (float)sum;
            }
    }
}

/* Nibble formats (int4, MXFP4) take rows in pairs: one 32-byte load holds rows 2p and 2p + 1 of
 * the same 32 inputs (the quad layout puts them back to back), and each 16-bit lane of it holds
 * elements 4j .. 4j + 3 of its row (two bytes, element 2i in byte i's low nibble). Masks and
 * shifts within lanes split it into four int16 vectors of elements 4j, 4j + 1, 4j + 2, 4j + 3,
 * with no shuffles; the activations are stored in that order (quantize_rows, perm = 1), so the
 * same 8 activations meet both rows: lanes 0-3 of an accumulator sum row 2p, lanes 4-7 row
 * 2p + 1. Four vpmaddwd per 64 weights and token, a third fewer instructions than unpacking. */

/* int4 quad: w = q * scale + minimum per group of G inputs, q in [0, 15]; scales and minimums
 * stored [group][4 rows]. With int16 activations, w . x16 = sum_g scale_g * (q_g . x16_g) +
 * minimum_g * sum(x16_g): the nibbles go straight into vpmaddwd (exact per group) and the
 * minimum needs only the group sums. */
static inline __attribute__((always_inline)) void quad_i4(const uint8_t *q, const float *sc,
                                                          const float *mn, int K, int G,
                                                          const int16_t *const x[2],
                                                          const float *const gs[2], int MB,
                                                          float out[4][MBMAX]) {
    const __m256i nib = _mm256_set1_epi8(0x0F), low = _mm256_set1_epi16(0x00FF);
    __m256 tot[2][2];
    __m128 zs[2];
    for (int m = 0; m < MB; m++) {
        zs[m] = _mm_setzero_ps();
        tot[0][m] = tot[1][m] = _mm256_setzero_ps();
    }
    for (int g = 0; g < K / G; g++) {
        __m256i acc[2][2];
        for (int m = 0; m < MB; m++) acc[0][m] = acc[1][m] = _mm256_setzero_si256();
        for (int k = g * G; k < (g + 1) * G; k += 32) {
            _mm_prefetch((const char *)(q + 2 * k + PF_DIST), PF_HINT);
            __m256i xq[2][4];
            for (int m = 0; m < MB; m++) act_quarters(x[m] + k, xq[m]);
            for (int p = 0; p < 2; p++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(q + 2 * k + 32 * p));
                __m256i lo = _mm256_and_si256(v, nib);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                const __m256i w[4] = {_mm256_and_si256(lo, low), _mm256_and_si256(hi, low),
                                      _mm256_srli_epi16(lo, 8), _mm256_srli_epi16(hi, 8)};
                for (int m = 0; m < MB; m++) acc[p][m] = _mm256_add_epi32(acc[p][m], dot4(w, xq[m]));
            }
        }
        const __m128 mnv = _mm_loadu_ps(mn + 4 * g), s4 = _mm_loadu_ps(sc + 4 * g);
        for (int p = 0; p < 2; p++) {
            const __m256 s = pair_spread(s4, p);
            for (int m = 0; m < MB; m++)
                tot[p][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[p][m]), s, tot[p][m]);
        }
        for (int m = 0; m < MB; m++) zs[m] = _mm_fmadd_ps(mnv, _mm_set1_ps(gs[m][g]), zs[m]);
    }
    for (int m = 0; m < MB; m++) {
        float z[4];
        _mm_storeu_ps(z, zs[m]);
        for (int p = 0; p < 2; p++) {
            pair_out(tot[p][m], &out[2 * p][m], &out[2 * p + 1][m]);
            out[2 * p][m] += z[2 * p];
            out[2 * p + 1][m] += z[2 * p + 1];
        }
    }
}

/* The int16 activation rows of MB pairs from pair p, their scales and (int4) group sums. */
typedef struct {
    const int16_t *x[2];
    const float *gs[2];
    float s[2];
} act16_t;

static inline act16_t act16(const job_t *j, int which, int K, int r0, int r1) {
    const int16_t *base = which == 1 ? j->x16 : j->a16;
    const float *xs = which == 1 ? j->xsc : j->asc;
    const float *gsb = which == 1 ? j->xgs : j->ags;
    const int ng = j->G > 0 ? K / j->G : 0;
    act16_t a = {{base + (size_t)r0 * K, base + (size_t)r1 * K},
                 {gsb + (size_t)r0 * ng, gsb + (size_t)r1 * ng},
                 {xs[r0], xs[r1]}};
    return a;
}

/* The integer formats (int8, grouped int8, int4, MXFP4) for one quad and MB <= 2 pairs. */
static inline void quad_int(const job_t *j, int which, size_t row, int K, act16_t a, int MB,
                            float out[4][MBMAX]) {
    const void *w = which == 1 ? j->w13 : j->w2;
    const void *sv = which == 1 ? j->s13 : j->s2;
    const int G = j->G, ng = G > 0 ? K / G : 1;
    if (j->fmt == F_I8 && G == 0) {
        const int8_t *q = (const int8_t *)w + row * K;
        const float *s = (const float *)sv + row;
        if (MB == 2) quad_i8(q, K, a.x, 2, out); else quad_i8(q, K, a.x, 1, out);
        for (int r = 0; r < 4; r++)
            for (int m = 0; m < MB; m++) out[r][m] *= s[r];
    } else if (j->fmt == F_I8) {
        const int8_t *q = (const int8_t *)w + row * K;
        const float *s = (const float *)sv + row * ng;
        if (MB == 2) quad_i8g(q, s, K, G, a.x, 2, out); else quad_i8g(q, s, K, G, a.x, 1, out);
    } else if (j->fmt == F_I4) {
        const uint8_t *q = (const uint8_t *)w + row * (K / 2);
        const float *s = (const float *)sv + row * ng;
        const float *z = (which == 1 ? j->m13 : j->m2) + row * ng;
        if (MB == 2) quad_i4(q, s, z, K, G, a.x, a.gs, 2, out);
        else quad_i4(q, s, z, K, G, a.x, a.gs, 1, out);
    } else { /* F_MXFP4 */
        const uint8_t *q = (const uint8_t *)w + row * (K / 2);
        const uint8_t *s = (const uint8_t *)sv + row * (K / 32);
        if (MB == 2) quad_mxfp4(q, s, K, a.x, 2, out); else quad_mxfp4(q, s, K, a.x, 1, out);
    }
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < MB; m++) out[r][m] *= a.s[m];
}

/* Rows [n0, n0+4) of expert e's matrix [N, K] against MB pairs starting at pair p (<= 3 for
 * fp32, 1 for FP8, <= 2 for the integer formats)
 * (which = 1: the pairs' tokens x against W13; which = 2: a against W2). */
static inline void quad(const job_t *j, int which, int e, int N, int K, int n0, int p, int MB,
                        float out[4][MBMAX]) {
    size_t row = (size_t)e * N + n0;
    int r0 = which == 1 ? j->tok[p] : p, r1 = which == 1 ? j->tok[p + MB - 1] : p + MB - 1;
    const float *xbase = which == 1 ? j->x : j->a;
    if (j->fmt == F_F32) {
        const float *w = (const float *)(which == 1 ? j->w13 : j->w2) + row * K;
        const float *const xr[MBMAX] = {
            xbase + (size_t)r0 * K, xbase + (size_t)(which == 1 ? j->tok[p + (MB > 1)] : p + (MB > 1)) * K,
            xbase + (size_t)r1 * K};
        if (MB == 3)
            quad_f32(w, K, xr, 3, out);
        else if (MB == 2)
            quad_f32(w, K, xr, 2, out);
        else
            quad_f32(w, K, xr, 1, out);
    } else if (j->fmt == F_FP8) {
        const uint8_t *q = (const uint8_t *)(which == 1 ? j->w13 : j->w2) + row * K;
        const float *s = (const float *)(which == 1 ? j->s13 : j->s2) + row * (K / j->G);
        quad_fp8(q, s, K, j->G, xbase + (size_t)r0 * K, out);
    } else {
        quad_int(j, which, row, K, act16(j, which, K, r0, r1), MB, out);
    }
}

/* Pairs per microkernel call: 3 fp32 tokens fill the FMA pipes, FP8 keeps its per-group sums of
 * one token in registers, the integer formats take two. */
static inline int pair_step(const job_t *j) {
    return j->fmt == F_F32 ? 3 : j->fmt == F_FP8 ? 1 : 2;
}

/* a = act(gate + bias, up + bias) * w for 16 lanes (4 rows x up to 4 pairs). */
static inline void gate_lanes(const job_t *j, const float *gl, const float *ul, const float *wl,
                              float *al, int n) {
    for (int h = 0; h < n; h += 8) {
        __m256 g = _mm256_loadu_ps(gl + h), u = _mm256_loadu_ps(ul + h);
        __m256 a;
        if (j->act == 1) { /* clamped SwiGLU: (clamp(u) + 1) * g' * sigmoid(alpha g'), g' = min(g, L) */
            const __m256 lim = _mm256_set1_ps(j->limit);
            g = _mm256_min_ps(g, lim);
            u = _mm256_max_ps(_mm256_min_ps(u, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
            __m256 e = hs_exp(_mm256_mul_ps(g, _mm256_set1_ps(-j->alpha)));
            a = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                              _mm256_add_ps(u, _mm256_set1_ps(1.0f)));
        } else {
            a = _mm256_mul_ps(hs_silu(g), u);
        }
        _mm256_storeu_ps(al + h, _mm256_mul_ps(a, _mm256_loadu_ps(wl + h)));
    }
}

/* Phase 1, units [u0, u1) of one expert (I/4 units each): gate rows i0.. and up rows i0.. */
static void phase1(const job_t *j, int u0, int u1) {
    const int H = j->H, I = j->I, per = I / 4;
    int ai = u0 / per, e = j->act_e[ai], off = j->act_off[ai], cnt = j->act_cnt[ai];
    const int step = pair_step(j);
    const float *b13 = j->b13 ? j->b13 + (size_t)e * 2 * I : NULL;
    for (int t0 = 0; t0 < cnt; t0 += TB) {
        int t1 = t0 + TB < cnt ? t0 + TB : cnt;
        for (int u = u0; u < u1; u++) {
            int i0 = (u - ai * per) * 4;
            for (int m = t0; m < t1; m += step) {
                int MB = t1 - m >= step ? step : t1 - m;
                float g[4][MBMAX], v[4][MBMAX];
                /* Quantized W13 rows are stored gate quad, up quad, gate quad, ...: one
                 * stream. fp32 keeps the model's layout: all gate rows, then all up rows. */
                int f32 = j->fmt == F_F32;
                int gr = f32 ? i0 : 2 * i0, ur = f32 ? I + i0 : 2 * i0 + 4;
                quad(j, 1, e, 2 * I, H, gr, off + m, MB, g);
                quad(j, 1, e, 2 * I, H, ur, off + m, MB, v);
                /* act(gate, up) * router weight for the 4 rows x MB pairs, 8 lanes at once */
                float gl[16], ul[16], wl[16], al[16];
                for (int mm = 0; mm < 4; mm++)
                    for (int r = 0; r < 4; r++) {
                        float bg = b13 ? b13[i0 + r] : 0.0f, bu = b13 ? b13[I + i0 + r] : 0.0f;
                        gl[4 * mm + r] = mm < MB ? g[r][mm] + bg : 0.0f;
                        ul[4 * mm + r] = mm < MB ? v[r][mm] + bu : 0.0f;
                        wl[4 * mm + r] = j->pw[off + m + (mm < MB ? mm : 0)];
                    }
                gate_lanes(j, gl, ul, wl, al, 4 * MB);
                for (int mm = 0; mm < MB; mm++) {
                    float *a = j->a + (size_t)(off + m + mm) * I + i0;
                    for (int r = 0; r < 4; r++) a[r] = al[4 * mm + r];
                }
            }
        }
    }
}

/* Phase 2, units [u0, u1) of one expert (H/4 units each): rows 4u.. of W2 -> y. The router
 * weight is already inside a, so a bias joins as weight * bias. */
static void phase2(const job_t *j, int u0, int u1) {
    const int H = j->H, I = j->I, per = H / 4;
    int ai = u0 / per, e = j->act_e[ai], off = j->act_off[ai], cnt = j->act_cnt[ai];
    const int step = pair_step(j);
    const float *b2 = j->b2 ? j->b2 + (size_t)e * H : NULL;
    for (int t0 = 0; t0 < cnt; t0 += TB) {
        int t1 = t0 + TB < cnt ? t0 + TB : cnt;
        for (int u = u0; u < u1; u++) {
            int n0 = (u - ai * per) * 4;
            for (int m = t0; m < t1; m += step) {
                int MB = t1 - m >= step ? step : t1 - m;
                float o[4][MBMAX];
                quad(j, 2, e, H, I, n0, off + m, MB, o);
                for (int mm = 0; mm < MB; mm++) {
                    float *y = j->y + (size_t)(off + m + mm) * H + n0;
                    float w = j->pw[off + m + mm];
                    for (int r = 0; r < 4; r++) y[r] = o[r][mm] + (b2 ? w * b2[n0 + r] : 0.0f);
                }
            }
        }
    }
}

typedef struct {
    job_t *job;
    int phase;
    int rc; /* row quads per work item */
} arg_t;

/* One work item: rc row quads of one active expert (never crossing an expert). Items are handed
 * out dynamically by the pool: on a shared machine a descheduled thread must not hold the whole
 * layer back (a static split would). */
static void phase_item(void *ctx, int c) {
    const arg_t *arg = (const arg_t *)ctx;
    const job_t *j = arg->job;
    int per = (arg->phase == 1 ? j->I : j->H) / 4;
    int cpe = (per + arg->rc - 1) / arg->rc;
    int ai = c / cpe, u0 = ai * per + (c % cpe) * arg->rc;
    int u1 = u0 + arg->rc < (ai + 1) * per ? u0 + arg->rc : (ai + 1) * per;
    if (arg->phase == 1)
        phase1(j, u0, u1);
    else
        phase2(j, u0, u1);
}

/* Items of at least ITEM_BYTES of weights (and RC quads): a thread's weight stream then runs
 * long enough for the prefetchers before it jumps, also where rows are short (phase 2 of small
 * experts: a quad of 4 x 512 int8 weights is only 2 KiB). */
#define ITEM_BYTES (64 << 10)

static void run_phase(job_t *j, int phase) {
    int per = (phase == 1 ? j->I : j->H) / 4;
    int K = phase == 1 ? j->H : j->I;
    /* twice the bytes per weight of each format, then bytes per row quad (x2 gate/up) */
    static const int twice_bytes[] = {8, 2, 1, 1, 2};
    long unit = (long)(phase == 1 ? 8 : 4) * K * twice_bytes[j->fmt] / 2;
    int rc = (int)(ITEM_BYTES / (unit > 0 ? unit : 1));
    rc = rc < RC ? RC : rc;
    arg_t arg = {j, phase, rc};
    hs_parallel_for(j->nthreads, j->n_active * ((per + rc - 1) / rc), phase_item, &arg);
}

/* Returns 0, -1 when out of memory, -2 when an expert id is outside [0, E), -3 for an unknown
 * format. fmt: F_*; G: columns per scale group (int4, MXFP4 32, FP8, grouped int8; 0 = int8 per
 * row); b13/b2 may be NULL; act 0 = silu, 1 = clamped SwiGLU(alpha, limit). */
int hetserve_moe_forward(int fmt, int nthreads, int E, int H, int I, int G, int T, int k,
                         const int64_t *ids, const float *tw, const float *x, float *out,
                         const void *w13, const void *s13, const float *m13, const void *w2,
                         const void *s2, const float *m2, const float *b13, const float *b2,
                         int act, float alpha, float limit) {
    const int P = T * k;
    memset(out, 0, sizeof(float) * (size_t)T * H);
    if (fmt < F_F32 || fmt > F_FP8) return -3;
    if (P == 0) return 0;
    for (int p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) return -2;
    const int q16 = fmt == F_I8 || fmt == F_I4 || fmt == F_MXFP4; /* int16 activations */
    const int G4 = fmt == F_I4 ? G : 0; /* group sums (the minimum term) */
    size_t n_g = G4 ? (size_t)T * (H / G4) + (size_t)P * (I / G4) : 0; /* xgs, ags */
    size_t n_f = (size_t)P * (I + H) + P + T + P + n_g;   /* a, y, pw, xsc, asc, xgs, ags */
    size_t n_i = (size_t)P + 4 * (size_t)E;               /* tok, act_e/off/cnt, fill */
    size_t n_q = q16 ? (size_t)T * H + (size_t)P * I : 0; /* x16, a16 */
    char *buf = malloc(sizeof(float) * n_f + sizeof(int) * n_i + sizeof(int16_t) * n_q);
    if (buf == NULL) return -1;
    float *a = (float *)buf, *y = a + (size_t)P * I, *pw = y + (size_t)P * H;
    float *xsc = pw + P, *asc = xsc + T, *xgs = asc + P;
    float *ags = G4 ? xgs + (size_t)T * (H / G4) : xgs;
    int *tok = (int *)(a + n_f), *act_e = tok + P, *act_off = act_e + E, *act_cnt = act_off + E;
    int *fill = act_cnt + E;
    int16_t *x16 = (int16_t *)(tok + n_i), *a16 = x16 + (size_t)T * H;

    /* Counting sort of the pairs by expert (stable: token order within an expert). */
    memset(fill, 0, sizeof(int) * E);
    for (int p = 0; p < P; p++) fill[ids[p]]++;
    int n = 0, off = 0;
    for (int e = 0; e < E; e++) {
        int c = fill[e];
        fill[e] = off;
        if (c > 0) {
            act_e[n] = e;
            act_off[n] = off;
            act_cnt[n] = c;
            n++;
        }
        off += c;
    }
    for (int p = 0; p < P; p++) {
        int dst = fill[ids[p]]++;
        tok[dst] = p / k;
        pw[dst] = tw[p];
    }
    job_t j = {fmt, H, I, G, act, alpha, limit, b13, b2, x, w13, w2, s13, s2, m13, m2, tok, pw,
               a, y, x16, a16, xsc, asc, xgs, ags, n, act_e, act_off, act_cnt,
               nthreads < 1 ? 1 : nthreads};
    const int perm = fmt == F_I4 || fmt == F_MXFP4;
    if (q16) quantize_rows(x, H, 0, T, x16, xsc, perm, G4, xgs);
    run_phase(&j, 1);
    if (q16) quantize_rows(a, I, 0, P, a16, asc, perm, G4, ags);
    run_phase(&j, 2);
    for (int p = 0; p < P; p++) { /* pairs of one token never race: this loop is serial */
        float *o = out + (size_t)tok[p] * H;
        const float *yp = y + (size_t)p * H;
        for (int h = 0; h < H; h++) o[h] += yp[h];
    }
    free(buf);
    return 0;
}

/* ---- plain int8 linear: y[t, n] = s[n] * sum_k q[n, k] * x[t, k] ------------------------------
 * The same weight-only format and quad layout as the experts (one [N, K] matrix, N % 4 == 0,
 * K % 32 == 0): what `cpu-int8` placement puts on the non-expert linears of CPU-only serving. */
typedef struct {
    const int8_t *w;
    const float *s, *xsc;
    const int16_t *x16;
    float *out;
    int T, N, K;
} lin_t;

static void lin_item(void *ctx, int c) {
    const lin_t *l = (const lin_t *)ctx;
    const int quads = l->N / 4, K = l->K;
    const int u0 = c * RC, u1 = u0 + RC < quads ? u0 + RC : quads;
    for (int t0 = 0; t0 < l->T; t0 += TB) {
        int t1 = t0 + TB < l->T ? t0 + TB : l->T;
        for (int u = u0; u < u1; u++) {
            const int n0 = 4 * u;
            const int8_t *q = l->w + (size_t)n0 * K;
            for (int m = t0; m < t1; m += 2) {
                int MB = t1 - m >= 2 ? 2 : 1;
                const int16_t *const xr[2] = {l->x16 + (size_t)m * K,
                                              l->x16 + (size_t)(m + MB - 1) * K};
                float o[4][MBMAX];
                if (MB == 2)
                    quad_i8(q, K, xr, 2, o);
                else
                    quad_i8(q, K, xr, 1, o);
                for (int mm = 0; mm < MB; mm++) {
                    float *y = l->out + (size_t)(m + mm) * l->N + n0;
                    for (int r = 0; r < 4; r++) y[r] = o[r][mm] * l->s[n0 + r] * l->xsc[m + mm];
                }
            }
        }
    }
}

/* x [T, K] fp32 -> out [T, N]; w quad-interleaved int8 [N, K], s [N]. Returns 0 or -1 (OOM). */
int hetserve_int8_linear(int nthreads, int T, int N, int K, const float *x, float *out,
                         const void *w, const float *s) {
    if (T <= 0) return 0;
    char *buf = malloc(sizeof(int16_t) * (size_t)T * K + sizeof(float) * (size_t)T);
    if (buf == NULL) return -1;
    int16_t *x16 = (int16_t *)buf;
    float *xsc = (float *)(x16 + (size_t)T * K);
    quantize_rows(x, K, 0, T, x16, xsc, 0, 0, NULL);
    lin_t l = {(const int8_t *)w, s, xsc, x16, out, T, N, K};
    hs_parallel_for(nthreads < 1 ? 1 : nthreads, (N / 4 + RC - 1) / RC, lin_item, &l);
    free(buf);
    return 0;
}
