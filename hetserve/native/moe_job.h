/* What a routed-experts call shares between moe_kernels.c (the decode path, the call itself)
 * and moe_prefill.c (the GEMM tiles a phase takes where an expert has many tokens): the weight
 * formats, the call's job and the gate's activation. */
#ifndef HETSERVE_MOE_JOB_H
#define HETSERVE_MOE_JOB_H

#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

/* Weight formats (hetserve/moe/cpu_native.py passes the same numbers). */
enum { F_F32 = 0, F_I8 = 1, F_I4 = 2, F_MXFP4 = 3, F_FP8 = 4, F_Q4K = 5, F_Q6K = 6, F_Q5K = 7,
       F_IQ4XS = 8, F_IQ4NL = 9, F_Q3K = 10, F_Q2K = 11, F_IQ2XXS = 12, F_IQ2XS = 13,
       F_IQ2S = 14, F_IQ3XXS = 15, F_IQ3S = 16, F_IQ1S = 17, F_IQ1M = 18 };
#define F_LAST F_IQ1M
/* Or'd into fmt: the int16 activation rows are rounded to the int8 range (|x| <= 127, W8A8), so
 * the int8 tiles multiply bytes by bytes (vpdpbusd, AMX's one TDPBSSD); every other kernel
 * reads the same rows as ever, and the integer sums are exact either way (moe_gemm.h). */
#define F_A8 (1 << 10)

/* A layer whose W2 is in another format than W13 (GGUF mixes: q4_K gate/up beside q6_K down)
 * passes fmt = f13 | (f2 + 1) << 5 and G = G13 | G2 << 16 (G2 = 0: the same as G13), so every
 * entry point keeps its arguments; a plain format is its own phase-2 format. */
static inline int fmt_phase(int fmt, int which) {
    fmt &= F_A8 - 1;
    return which == 1 || (fmt >> 5) == 0 ? fmt & 31 : (fmt >> 5) - 1;
}
static inline int g_phase(int G, int which) {
    return which == 1 || (G >> 16) == 0 ? G & 0xFFFF : G >> 16;
}
/* The K-quants' activations: int8 per 256 columns with scales and sums (q4_K's or natural order);
 * the 4-bit i-quants read the same ones (every format from q4_K on). */
static inline int kq_fmt(int fmt) {
    return fmt >= F_Q4K && fmt <= F_LAST;
}

typedef struct {
    int fmt, H, I, G;      /* G: columns per scale group, 0 = one scale per row (int8); both
                              per phase (fmt_phase, g_phase): use jfmt / jg */
    int act;               /* 0 silu, 1 clamped SwiGLU (gpt-oss) */
    float alpha, limit;
    const float *b13, *b2; /* biases [E, 2I] (gate then up) and [E, H], or NULL */
    const float *x;        /* [T, H] fp32 tokens */
    const void *w13, *w2;  /* quad- or tile-interleaved weights, see quad_i8 / tile_i4 */
    const void *s13, *s2;  /* scales: fp32, fp16 (grouped int8), e8m0 bytes (MXFP4), or NULL
                              where the weights carry them (int4, q4_K) */
    const int *tok;        /* [P] token of pair p (pairs sorted by expert) */
    const float *pw;       /* [P] router weight of pair p */
    float *a, *y;          /* [P, I], [P, H] */
    int16_t *x16, *a16;    /* [T, H], [P, I] activations as int16 (FP8: [T, 2H], [P, 2I]) */
    float *xsc, *asc;      /* their per-row scales [T], [P] */
    float *xgs, *ags;      /* int4 only: per-group sums of x16 / a16 [T, H/G], [P, I/G] */
    int8_t *xpl, *apl;     /* q4_K only: x / a as int8 per super-block [rows, K] */
    int16_t *xps, *aps;    /* q4_K only: their sums per sub-block, [rows, K / 256, 16] */
    float *xpd, *apd;      /* q4_K only: their scales per super-block, [rows, K / 256] */
    int n_active;
    const int *act_e, *act_off, *act_cnt;
    int nthreads;
    int a8; /* F_A8: activation rows rounded to |x| <= 127 (act_limit) */
    uint8_t *xu8, *au8; /* W8A8 with int8 row-scaled weights on AVX-512: x16 / a16 + 128 as
                           bytes [T, H], [P, I] (quad_u8), else NULL */
} job_t;

static inline int jfmt(const job_t *j, int which) {
    return fmt_phase(j->fmt, which);
}
static inline int jg(const job_t *j, int which) {
    return g_phase(j->G, which);
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

/* moe_prefill.c: phase 1 / phase 2 of the row units [u0, u1) of active expert ai on the GEMM
 * tiles (int8 weights with one scale per row; whole strips of 4 units). 0, or -1 when out of
 * memory with nothing written. */
int hs_phase1_gemm(const job_t *j, int ai, int u0, int u1);
int hs_phase2_gemm(const job_t *j, int ai, int u0, int u1);
/* The same for the K-quants and IQ4_XS (moe_kgemm.h): whole strips of 16 rows, else -1. */
int hs_phase1_kgemm(const job_t *j, int ai, int u0, int u1);
int hs_phase2_kgemm(const job_t *j, int ai, int u0, int u1);
/* FP8 on bf16 tiles (HS_FP8_BF16 builds; else -1): whole strips of 4 quads, groups of G % 16
 * == 0 columns, else -1. */
int hs_phase1_fp8(const job_t *j, int ai, int u0, int u1);
int hs_phase2_fp8(const job_t *j, int ai, int u0, int u1);

#endif
