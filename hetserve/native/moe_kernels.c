/* Routed-experts kernels for AVX2 + FMA CPUs: weight-only int8 / int4, plain fp32, and the
 * formats checkpoints publish (grouped int8, MXFP4, FP8: moe_formats.h; GGUF q4_K: moe_q4k.h).
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
/* No implicit fused multiply-adds: the decode and GEMM paths round the same float steps the same
 * way (a contraction GCC chose in one and not the other changed last bits). */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moe_gemm.h"
#include "moe_job.h"
#include "moe_kgemm.h"
#include "moe_kq.h"
#include "moe_q4k.h"
#include "moe_quads.h"
#include "pool.h"
#include "simd.h"

#define TB 32 /* pairs per cache block: 32 x 2048 fp32 = 256 KiB, half of Zen 3's L2 */
#define RC 8  /* row quads per work chunk */

/* The int16 activation rows of MB pairs from pair p, their scales and (int4) group sums (MB <=
 * 4 for int8 with row scales on AVX-512, else <= 2: gs and p hold 2). */
typedef struct {
    const int16_t *x[4];
    const uint8_t *u[4]; /* the same rows + 128 as bytes (job_t's xu8 / au8), or NULL */
    const float *gs[2];
    float s[4];
    q4k_act_t p[2];
} act16_t;

/* int16s per input in the rounded activation rows: FP8's are a bf16 hi row and a lo row. */
static inline int act_width(int fmt) {
    return fmt == F_FP8 ? 2 : 1;
}

/* Rows r[0 .. 3] (the last of MB repeated past it) of the pairs' activations. */
static inline act16_t act16(const job_t *j, int fmt, int which, int K, const int r[4]) {
    const int16_t *base = which == 1 ? j->x16 : j->a16;
    const float *xs = which == 1 ? j->xsc : j->asc;
    const float *gsb = which == 1 ? j->xgs : j->ags;
    const int G = jg(j, which), ng = G > 0 ? K / G : 0;
    const size_t stride = (size_t)act_width(fmt) * K;
    const int r0 = r[0], r1 = r[1];
    const uint8_t *u = which == 1 ? j->xu8 : j->au8;
    act16_t a = {{base + r0 * stride, base + r1 * stride, base + r[2] * stride,
                  base + r[3] * stride},
                 {NULL, NULL, NULL, NULL},
                 {gsb + (size_t)r0 * ng, gsb + (size_t)r1 * ng},
                 {xs[r0], xs[r1], xs[r[2]], xs[r[3]]},
                 {{NULL, NULL, NULL}, {NULL, NULL, NULL}}};
    if (u != NULL) /* set only for a phase of int8 rows with row scales (moe_forward) */
        for (int i = 0; i < 4; i++) a.u[i] = u + (size_t)r[i] * K;
    if (kq_fmt(fmt)) {
        const int8_t *pl = which == 1 ? j->xpl : j->apl;
        const int16_t *ps = which == 1 ? j->xps : j->aps;
        const float *pd = which == 1 ? j->xpd : j->apd;
        a.p[0] = q4k_row(pl, pd, ps, K, r0);
        a.p[1] = q4k_row(pl, pd, ps, K, r1);
    }
    return a;
}

/* Rows per unit of work: a quad, two for q4_K (quad_q4k: both quads share the activations'
 * loads), or the nibble formats' tile of 16 (MXFP4, int4). */
static inline int unit_rows(int fmt) {
    return fmt == F_MXFP4 || fmt == F_I4 ? TILE_ROWS : fmt == F_Q4K ? 8 : 4; /* q6_K, q5_K: 4 */
}

/* The integer formats (int8, grouped int8, int4, MXFP4) for one unit and MB <= 2 pairs (int8
 * with row scales: MB <= pair_step's). */
static inline __attribute__((always_inline)) void quad_int(const job_t *j, int fmt, int which,
                                                          size_t row, int K, const act16_t *ap,
                                                          int MB, float out[][MBMAX]) {
    const act16_t a = *ap;
    const void *w = which == 1 ? j->w13 : j->w2;
    const void *sv = which == 1 ? j->s13 : j->s2;
    const int G = jg(j, which), ng = G > 0 ? K / G : 1;
    if (fmt == F_I8 && G == 0) {
        const int8_t *q = (const int8_t *)w + row * K;
        const float *s = (const float *)sv + row;
#if HS_U8ROWS
        if (a.u[0] != NULL) {
            switch (MB) {
            case 4: quad_u8(q, K, a.u, 4, out); break;
            case 3: quad_u8(q, K, a.u, 3, out); break;
            case 2: quad_u8(q, K, a.u, 2, out); break;
            default: quad_u8(q, K, a.u, 1, out); break;
            }
        } else
#endif
        switch (MB) {
#if I8_MB == 4
        case 4: quad_i8(q, K, a.x, 4, out); break;
        case 3: quad_i8(q, K, a.x, 3, out); break;
#endif
        case 2: quad_i8(q, K, a.x, 2, out); break;
        default: quad_i8(q, K, a.x, 1, out); break;
        }
        for (int r = 0; r < 4; r++)
            for (int m = 0; m < MB; m++) out[r][m] *= s[r];
    } else if (fmt == F_I8) { /* grouped: fp16 scales */
        const int8_t *q = (const int8_t *)w + row * K;
        const uint16_t *s = (const uint16_t *)sv + row * ng;
        if (MB == 2) quad_i8g(q, s, K, G, a.x, 2, out); else quad_i8g(q, s, K, G, a.x, 1, out);
    } else if (fmt == F_I4) {
        const uint8_t *q = (const uint8_t *)w + row / TILE_ROWS * I4_TILE_BYTES(K, G);
        if (MB == 2) tile_i4(q, K, G, a.x, a.gs, 2, out); else tile_i4(q, K, G, a.x, a.gs, 1, out);
    } else if (fmt == F_Q4K) {
        const uint8_t *q = (const uint8_t *)w + row * (K / Q4K_SB) * (Q4K_QUAD_BYTES / 4);
        if (MB == 2) quad_q4k(q, 2, K, a.p, 2, out); else quad_q4k(q, 2, K, a.p, 1, out);
        return; /* its scales are per super-block, applied inside (a.s is not used) */
    } else if (kq_fmt(fmt)) { /* the other K-quants, IQ4_XS, IQ4_NL: the file's rows as they are */
        const uint8_t *q = (const uint8_t *)w + row * (K / Q4K_SB) * kq_bytes(fmt);
        if (MB == 2) quad_kq(q, fmt, K, a.p, 2, out);
        else quad_kq(q, fmt, K, a.p, 1, out);
        return;
    } else { /* F_MXFP4 */
        const uint8_t *q = (const uint8_t *)w + row * (K / 2);
        const uint8_t *s = (const uint8_t *)sv + row * (K / 32);
        if (MB == 2) tile_mxfp4(q, s, K, a.x, 2, out); else tile_mxfp4(q, s, K, a.x, 1, out);
    }
    for (int r = 0; r < unit_rows(fmt); r++)
        for (int m = 0; m < MB; m++) out[r][m] *= a.s[m];
}

/* Rows [n0, n0 + unit_rows) of expert e's matrix [N, K] against MB pairs starting at pair p
 * (<= 3 for fp32, 1 for FP8 on fp32, <= 2 for the integer formats and FP8 on bf16, whose rounded
 * rows ap holds) (which = 1: the pairs' tokens x against W13; which = 2: a against W2). */
static inline __attribute__((always_inline)) void quad(const job_t *j, int fmt, int which, int e,
                                                      int N, int K, int n0, int p, int MB,
                                                      const act16_t *ap, float out[][MBMAX]) {
    size_t row = (size_t)e * N + n0;
    int r0 = which == 1 ? j->tok[p] : p;
    const float *xbase = which == 1 ? j->x : j->a;
    if (fmt == F_F32) {
        int r1 = which == 1 ? j->tok[p + MB - 1] : p + MB - 1;
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
    } else if (fmt == F_FP8) {
        const uint8_t *q = (const uint8_t *)(which == 1 ? j->w13 : j->w2) + row * K;
        const int G = jg(j, which);
        const float *s = (const float *)(which == 1 ? j->s13 : j->s2) + row * (K / G);
#if HS_FP8_BF16
        if (MB == 2) quad_fp8_bf16(q, s, K, G, ap->x, 2, out);
        else quad_fp8_bf16(q, s, K, G, ap->x, 1, out);
        for (int r = 0; r < 4; r++)
            for (int m = 0; m < MB; m++) out[r][m] *= ap->s[m];
#else
        quad_fp8(q, s, K, G, xbase + (size_t)r0 * K, out);
#endif
    } else {
        quad_int(j, fmt, which, row, K, ap, MB, out);
    }
}

/* Pairs per microkernel call: 3 fp32 tokens fill the FMA pipes, FP8 on fp32 keeps its per-group
 * sums of one token in registers, the integer formats and FP8 on bf16 take two, int8 with row
 * scales four on AVX-512 (16 accumulators in its 32 registers: a batched decode's few pairs per
 * expert widen each weight once, not once per two pairs). G: the format's group size. */
static inline int pair_step(int fmt, int G) {
    if (fmt == F_I8 && G == 0) return I8_MB;
    return fmt == F_F32 ? F32_MB : fmt == F_FP8 && !HS_FP8_BF16 ? 1 : 2;
}

/* Formats whose kernels read activations rounded to 16 bits (int16, or bf16 for FP8 where
 * HS_FP8_BF16) or, for q4_K, to int8: all but fp32. */
static inline int rounded_acts(int fmt) {
    return fmt != F_F32 && (fmt != F_FP8 || HS_FP8_BF16);
}

/* The rounded activation rows of the pair steps in [t0, t1) of one expert's pairs (from pair
 * off), computed once per block instead of once per row quad (rounded_acts formats). */
static inline __attribute__((always_inline)) void block_acts(const job_t *j, int fmt, int which,
                                                            int K, int off, int t0, int t1,
                                                            act16_t *acts) {
    const int step = pair_step(fmt, jg(j, which));
    if (!rounded_acts(fmt)) return;
    for (int m = t0; m < t1; m += step) {
        int MB = t1 - m >= step ? step : t1 - m, p = off + m, r[4];
        for (int i = 0; i < 4; i++) {
            const int q = p + (i < MB ? i : MB - 1);
            r[i] = which == 1 ? j->tok[q] : q;
        }
        acts[(m - t0) / step] = act16(j, fmt, which, K, r);
    }
}

/* Phase 1, units [u0, u1) of one expert (I/R units each): gate rows i0.. and up rows i0..
 * Inlined once per format (fmt a constant): the per-unit dispatch folds away. */
static inline __attribute__((always_inline)) void phase1(const job_t *j, int u0, int u1,
                                                        const int fmt) {
    const int H = j->H, I = j->I, R = unit_rows(fmt), per = I / R;
    int ai = u0 / per, e = j->act_e[ai], off = j->act_off[ai], cnt = j->act_cnt[ai];
    const int step = pair_step(fmt, jg(j, 1));
    act16_t acts[TB];
    const float *b13 = j->b13 ? j->b13 + (size_t)e * 2 * I : NULL;
    for (int t0 = 0; t0 < cnt; t0 += TB) {
        int t1 = t0 + TB < cnt ? t0 + TB : cnt;
        block_acts(j, fmt, 1, H, off, t0, t1, acts);
        for (int u = u0; u < u1; u++) {
            int i0 = (u - ai * per) * R;
            for (int m = t0; m < t1; m += step) {
                int MB = t1 - m >= step ? step : t1 - m;
                float g[TILE_ROWS][MBMAX], v[TILE_ROWS][MBMAX];
                /* Quantized W13 rows are stored gate unit, up unit, gate unit, ...: one
                 * stream. fp32 keeps the model's layout: all gate rows, then all up rows. */
                int f32 = fmt == F_F32;
                int gr = f32 ? i0 : 2 * i0, ur = f32 ? I + i0 : 2 * i0 + R;
                const act16_t *ap = acts + (m - t0) / step;
                quad(j, fmt, 1, e, 2 * I, H, gr, off + m, MB, ap, g);
                quad(j, fmt, 1, e, 2 * I, H, ur, off + m, MB, ap, v);
                /* act(gate, up) * router weight, 4 rows x MB pairs at a time, 8 lanes at once */
                for (int r0 = 0; r0 < R; r0 += 4) {
                    float gl[16], ul[16], wl[16], al[16];
                    for (int mm = 0; mm < 4; mm++)
                        for (int r = 0; r < 4; r++) {
                            int i = i0 + r0 + r;
                            float bg = b13 ? b13[i] : 0.0f, bu = b13 ? b13[I + i] : 0.0f;
                            gl[4 * mm + r] = mm < MB ? g[r0 + r][mm] + bg : 0.0f;
                            ul[4 * mm + r] = mm < MB ? v[r0 + r][mm] + bu : 0.0f;
                            wl[4 * mm + r] = j->pw[off + m + (mm < MB ? mm : 0)];
                        }
                    gate_lanes(j, gl, ul, wl, al, 4 * MB);
                    for (int mm = 0; mm < MB; mm++) {
                        float *a = j->a + (size_t)(off + m + mm) * I + i0 + r0;
                        for (int r = 0; r < 4; r++) a[r] = al[4 * mm + r];
                    }
                }
            }
        }
    }
}

/* Phase 2, units [u0, u1) of one expert (H/R units each): rows R u.. of W2 -> y. The router
 * weight is already inside a, so a bias joins as weight * bias. */
static inline __attribute__((always_inline)) void phase2(const job_t *j, int u0, int u1,
                                                        const int fmt) {
    const int H = j->H, I = j->I, R = unit_rows(fmt), per = H / R;
    int ai = u0 / per, e = j->act_e[ai], off = j->act_off[ai], cnt = j->act_cnt[ai];
    const int step = pair_step(fmt, jg(j, 2));
    act16_t acts[TB];
    const float *b2 = j->b2 ? j->b2 + (size_t)e * H : NULL;
    for (int t0 = 0; t0 < cnt; t0 += TB) {
        int t1 = t0 + TB < cnt ? t0 + TB : cnt;
        block_acts(j, fmt, 2, I, off, t0, t1, acts);
        for (int u = u0; u < u1; u++) {
            int n0 = (u - ai * per) * R;
            for (int m = t0; m < t1; m += step) {
                int MB = t1 - m >= step ? step : t1 - m;
                float o[TILE_ROWS][MBMAX];
                quad(j, fmt, 2, e, H, I, n0, off + m, MB, acts + (m - t0) / step, o);
                for (int mm = 0; mm < MB; mm++) {
                    float *y = j->y + (size_t)(off + m + mm) * H + n0;
                    float w = j->pw[off + m + mm];
                    for (int r = 0; r < R; r++) y[r] = o[r][mm] + (b2 ? w * b2[n0 + r] : 0.0f);
                }
            }
        }
    }
}

typedef struct {
    job_t *job;
    int phase;
    int rc; /* units (row quads, int4 / MXFP4 tiles) per work item */
    long long *touched; /* hetserve_moe_touch: bytes read */
} arg_t;

/* Work item c of a phase: units [*u0, *u1) of one active expert (never crossing an expert),
 * numbered over all active experts (active expert ai's are ai * per ..). */
static void item_units(const arg_t *arg, int c, int *u0, int *u1) {
    const job_t *j = arg->job;
    int per = (arg->phase == 1 ? j->I : j->H) / unit_rows(jfmt(j, arg->phase));
    int cpe = (per + arg->rc - 1) / arg->rc;
    int ai = c / cpe;
    *u0 = ai * per + (c % cpe) * arg->rc;
    *u1 = *u0 + arg->rc < (ai + 1) * per ? *u0 + arg->rc : (ai + 1) * per;
}

/* One work item (item_units). Items are numbered along each expert's weights, so a thread
 * working through its own run of them (pool.c) streams one run of memory; the pool's stealing
 * keeps a descheduled thread from holding the rest of its run back. */
static void phase_item(void *ctx, int c) {
    const arg_t *arg = (const arg_t *)ctx;
    const job_t *j = arg->job;
    int u0, u1;
    item_units(arg, c, &u0, &u1);
    /* prefill, an expert with many pairs: the GEMM tiles of its format (moe_prefill.c), if any:
     * int8 with row scales, FP8 where the build has AVX512-BF16, and the K-quants, IQ4_XS /
     * IQ4_NL and grouped int8 (moe_kgemm.h); a tile path out of memory leaves the rows */
    {
        const int fmt = jfmt(j, arg->phase), G = jg(j, arg->phase), p1 = arg->phase == 1;
        const int ai = u0 / ((p1 ? j->I : j->H) / unit_rows(fmt)), cnt = j->act_cnt[ai];
        int (*tiles)(const job_t *, int, int, int) = NULL;
        int worth = gemm_worth(cnt);
        if (fmt == F_I8 && G == 0)
            tiles = p1 ? hs_phase1_gemm : hs_phase2_gemm, worth = gemm_worth_i8(cnt);
        else if (HS_FP8_BF16 && fmt == F_FP8)
            tiles = p1 ? hs_phase1_fp8 : hs_phase2_fp8;
        else if (kg_group(fmt, G) > 0)
            tiles = p1 ? hs_phase1_kgemm : hs_phase2_kgemm;
        if (tiles != NULL && worth && tiles(j, ai, u0, u1) == 0) return;
    }
    /* one specialised copy of each phase per format */
#define HS_PHASES(F) (arg->phase == 1 ? phase1(j, u0, u1, F) : phase2(j, u0, u1, F))
    switch (jfmt(j, arg->phase)) {
    case F_F32: HS_PHASES(F_F32); break;
    case F_Q6K: HS_PHASES(F_Q6K); break;
    case F_Q5K: HS_PHASES(F_Q5K); break;
    case F_IQ4XS: HS_PHASES(F_IQ4XS); break;
    case F_IQ4NL: HS_PHASES(F_IQ4NL); break;
    case F_Q3K: HS_PHASES(F_Q3K); break;
    case F_Q2K: HS_PHASES(F_Q2K); break;
    case F_IQ2XXS: HS_PHASES(F_IQ2XXS); break;
    case F_IQ2XS: HS_PHASES(F_IQ2XS); break;
    case F_IQ2S: HS_PHASES(F_IQ2S); break;
    case F_IQ3XXS: HS_PHASES(F_IQ3XXS); break;
    case F_IQ3S: HS_PHASES(F_IQ3S); break;
    case F_IQ1S: HS_PHASES(F_IQ1S); break;
    case F_IQ1M: HS_PHASES(F_IQ1M); break;
    case F_I8: HS_PHASES(F_I8); break;
    case F_I4: HS_PHASES(F_I4); break;
    case F_MXFP4: HS_PHASES(F_MXFP4); break;
    case F_FP8: HS_PHASES(F_FP8); break;
    default: HS_PHASES(F_Q4K); break;
    }
#undef HS_PHASES
}

/* Items of about ITEM_BYTES of weights, RC quads at least (hs_item_units), also where rows are
 * short (phase 2 of small experts: a quad of 4 x 512 int8 weights is only 2 KiB). Long items
 * keep each thread on one sequential stream, so the size is set high and hs_item_units' balance
 * cap decides (a one-token layer of 6 experts of 2048 x 512: an eighth of a phase per item);
 * that layer runs ~1.1x faster than with 256 KiB items. */
#define ITEM_BYTES (2048 << 10)

/* Sixteen times the bytes per weight of each format (F_*), scales and minimums aside. */
/* q6_K 13.125, IQ4_XS 8.5, q3_K 6.875, q2_K 5.25, then the grid i-quants IQ2_XXS 4.125 .. IQ1_M */
static const int B16[] = {64, 16, 8, 8, 16, 9, 13, 11, 8, 9, 7, 5, 4, 5, 5, 6, 7, 3, 4};

/* Units per work item of a phase. */
static int phase_rc(const job_t *j, int phase) {
    const int fmt = jfmt(j, phase), R = unit_rows(fmt), per = (phase == 1 ? j->I : j->H) / R;
    int K = phase == 1 ? j->H : j->I;
    long unit = (long)(phase == 1 ? 2 * R : R) * K * B16[fmt] / 16; /* x2: gate and up */
    const int rc = hs_item_units(unit, ITEM_BYTES, j->n_active * per, j->nthreads, RC * 4 / R);
    /* int8 with row scales: whole strips of the GEMM tiles (4 quads; per is a multiple of 8) */
    if (fmt == F_I8 && jg(j, phase) == 0) return (rc + 3) / 4 * 4;
    /* the K-quants' strips, where an expert meets enough pairs and its rows hold whole ones
     * (decode keeps its items as they were) */
    const int su = GEMM_ROWS / R;
    const int tiles = kg_group(fmt, jg(j, phase)) > 0 || (fmt == F_FP8 && HS_FP8_BF16);
    if (!tiles || per % su != 0) return rc;
    int most = 0;
    for (int a = 0; a < j->n_active; a++) most = j->act_cnt[a] > most ? j->act_cnt[a] : most;
    return gemm_worth(most) ? (rc + su - 1) / su * su : rc;
}

static void run_phase(job_t *j, int phase, hs_task_fn item, long long *touched) {
    const int per = (phase == 1 ? j->I : j->H) / unit_rows(jfmt(j, phase));
    const int rc = phase_rc(j, phase);
    arg_t arg = {j, phase, rc, touched};
    hs_parallel_for(j->nthreads, j->n_active * ((per + rc - 1) / rc), item, &arg);
}

/* The layer's reads without its arithmetic (hetserve_moe_touch): the bytes of one work item
 * (its rows' weights and group parameters), read in order as the microkernels stream them,
 * prefetched alike. What a call of hetserve_moe_forward could not beat with the same items,
 * threads and memory: `hetserve bench moe-kernel` times both. */
static uint64_t touch_sink; /* keeps the reads from being optimized away */

static uint64_t touch_bytes(const void *p, size_t n) {
    const char *c = (const char *)p;
    __m256i s = _mm256_setzero_si256();
    for (size_t i = 0; i + 64 <= n; i += 64) {
        hs_prefetch(c + i);
        s = _mm256_xor_si256(s, _mm256_loadu_si256((const __m256i *)(c + i)));
        s = _mm256_xor_si256(s, _mm256_loadu_si256((const __m256i *)(c + i + 32)));
    }
    for (size_t i = n - n % 64; i < n; i++) s = _mm256_add_epi64(s, _mm256_set1_epi64x(c[i]));
    return (uint64_t)_mm256_extract_epi64(s, 0) ^ (uint64_t)_mm256_extract_epi64(s, 3);
}

/* Bytes per row of a [N, K] matrix in format fmt: weights (with int4 tiles' group parameters),
 * scales (see quad_int; q4_K's super-blocks carry their own). */
static void row_bytes(int fmt, int K, int G, size_t b[2]) {
    const size_t ng = G > 0 ? (size_t)(K / G) : 0;
    b[0] = (size_t)K * B16[fmt] / 16;
    b[1] = 0;
    switch (fmt) {
    case F_I8: b[1] = G > 0 ? 2 * ng : 4; break;
    case F_I4: b[0] += 8 * ng; break; /* a row's share of its tile's scales and minimums */
    case F_MXFP4: b[1] = K / 32; break;
    case F_FP8: b[1] = 4 * ng; break;
    case F_F32: case F_Q4K: case F_Q5K: case F_IQ4NL: break; /* B16 is exact */
    default: b[0] = (size_t)K / Q4K_SB * kq_bytes(fmt); break; /* the other GGUF blocks */
    }
}

static void touch_item(void *ctx, int c) {
    const arg_t *arg = (const arg_t *)ctx;
    const job_t *j = arg->job;
    const int fmt = jfmt(j, arg->phase);
    const int R = unit_rows(fmt), per = (arg->phase == 1 ? j->I : j->H) / R;
    int u0, u1;
    item_units(arg, c, &u0, &u1);
    const int ai = u0 / per, e = j->act_e[ai], v0 = u0 - ai * per, v1 = u1 - ai * per;
    const int K = arg->phase == 1 ? j->H : j->I, N = arg->phase == 1 ? 2 * j->I : j->H;
    const void *m[2] = {arg->phase == 1 ? j->w13 : j->w2, arg->phase == 1 ? j->s13 : j->s2};
    size_t b[2];
    row_bytes(fmt, K, jg(j, arg->phase), b);
    /* rows of the item: quantized W13 stores gate and up units alternately (one range), fp32
     * keeps all gate rows, then all up rows (two ranges) */
    size_t r0[2], nr[2];
    int ranges = 1;
    if (arg->phase == 2) {
        r0[0] = (size_t)e * N + (size_t)R * v0, nr[0] = (size_t)R * (v1 - v0);
    } else if (fmt != F_F32) {
        r0[0] = (size_t)e * N + 2 * (size_t)R * v0, nr[0] = 2 * (size_t)R * (v1 - v0);
    } else {
        r0[0] = (size_t)e * N + (size_t)R * v0, r0[1] = r0[0] + j->I;
        nr[0] = nr[1] = (size_t)R * (v1 - v0);
        ranges = 2;
    }
    uint64_t sum = 0;
    long long n = 0;
    for (int g = 0; g < ranges; g++)
        for (int t = 0; t < 2; t++)
            if (m[t] != NULL && b[t] > 0) {
                sum ^= touch_bytes((const char *)m[t] + r0[g] * b[t], nr[g] * b[t]);
                n += (long long)(nr[g] * b[t]);
            }
    __atomic_fetch_xor(&touch_sink, sum, __ATOMIC_RELAXED);
    __atomic_fetch_add(arg->touched, n, __ATOMIC_RELAXED);
}

/* 1 when an id of the P pairs is outside [0, E). */
static int bad_ids(int E, int P, const int64_t *ids) {
    for (int p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) return 1;
    return 0;
}

/* Counting sort of the P = T * k pairs by expert (stable: token order within an expert):
 * tok/pw per sorted pair, the active experts with their first pair and count; returns how
 * many experts are active, *kept the pairs sorted. Only ids in [base, base + E) are kept (a
 * NUMA shard's experts, numbered from base; base 0 keeps every valid id). fill [E] is scratch. */
static int sort_pairs(int E, int base, int P, int k, const int64_t *ids, const float *tw,
                      int *tok, float *pw, int *act_e, int *act_off, int *act_cnt, int *fill,
                      int *kept) {
    memset(fill, 0, sizeof(int) * E);
    for (int p = 0; p < P; p++)
        if (ids[p] >= base && ids[p] < base + E) fill[ids[p] - base]++;
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
        if (ids[p] < base || ids[p] >= base + E) continue;
        int dst = fill[ids[p] - base]++;
        tok[dst] = p / k;
        pw[dst] = tw[p];
    }
    *kept = off;
    return n;
}

/* Rounds rows [r0, r1) of phase `which` (1: x [T, H], 2: a [P, I]) to int16 per row, for the
 * K-quants to int8 per super-block, for FP8 (HS_FP8_BF16) to a hi and a lo bf16 row scaled per
 * row. Each row on its own: any split of the rows gives the same bytes. */
static void activation_rows(const job_t *j, int which, int r0, int r1) {
    const int K = which == 1 ? j->H : j->I, nsb = K / Q4K_SB;
    const float *src = which == 1 ? j->x : j->a;
    const int fmt = jfmt(j, which);
    if (kq_fmt(fmt)) {
        int8_t *pl = which == 1 ? j->xpl : j->apl;
        int16_t *ps = which == 1 ? j->xps : j->aps;
        float *pd = which == 1 ? j->xpd : j->apd;
        /* rows back to back: super-blocks apart */
        const size_t o = (size_t)r0 * K, n = (size_t)(r1 - r0) * K;
        const size_t ob = (size_t)r0 * nsb;
        if (fmt == F_Q4K) q4k_quantize(src + o, (int)n, pl + o, pd + ob, ps + 16 * ob);
        else kq_quantize(src + o, (int)n, pl + o, pd + ob, ps + 16 * ob, kq_act_perm(fmt));
        return;
    }
    int16_t *q = which == 1 ? j->x16 : j->a16;
    float *sc = which == 1 ? j->xsc : j->asc, *gs = which == 1 ? j->xgs : j->ags;
#if HS_FP8_BF16
    if (fmt == F_FP8) {
        const size_t o = (size_t)r0 * K;
        bf16_rows(src + o, K, r1 - r0, q + 2 * o, sc + r0);
        return;
    }
#endif
    const int perm = fmt == F_I4 || fmt == F_MXFP4;
    quantize_rows(src, K, r0, r1, q, sc, perm, fmt == F_I4 ? jg(j, which) : 0, gs,
                  j->a8 ? ACT_Q8 : ACT_Q, which == 1 ? j->xu8 : j->au8);
}

typedef struct {
    const job_t *j;
    int which;
} act_arg_t;

static void activation_block(void *ctx, int r0, int r1) {
    const act_arg_t *a = (const act_arg_t *)ctx;
    activation_rows(a->j, a->which, r0, r1);
}

/* activation_rows over all `rows`, 32 at a time on the job's threads where there are many (at
 * prefill a single thread rounding [2048, 2048] and [12288, 512] left the other core idle ~1-2%
 * of the prompt's time; hs_parallel_rows). */
static void activations(job_t *j, int which, int rows) {
    act_arg_t a = {j, which};
    hs_parallel_rows(j->nthreads, rows, 32, activation_block, &a);
}

/* A call's scratch (pairs, activations, outputs): the calling thread's own buffer, kept from
 * call to call (grown to the largest call so far, up to SCRATCH_KEEP bytes) and freed when the
 * thread exits; a larger one is malloc'd (*own = 1: the caller frees it). malloc and free around
 * every call took ~1.6 us of a one-token layer (~1%); and from a thread other than the main one
 * (the experts' dedicated pool, `cpu_threads`) glibc maps a prefill's buffer (a 2,048-token
 * chunk of 64 experts top-6 at 2048 x 512: ~130 MB) afresh for every call: ~37,000 page faults
 * a call, the layer 1.25-1.7x slower than from the main thread, which glibc's main heap keeps
 * the memory for anyway. */
#define SCRATCH_KEEP ((size_t)1 << 30)
typedef struct {
    size_t cap;
    _Alignas(16) char data[]; /* malloc's alignment, as before */
} scratch_t;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_ok;

static void scratch_init(void) { scratch_ok = pthread_key_create(&scratch_key, free) == 0; }

static char *scratch(size_t n, int *own) {
    *own = 1;
    if (n > SCRATCH_KEEP || pthread_once(&scratch_once, scratch_init) != 0 || !scratch_ok)
        return malloc(n);
    scratch_t *b = pthread_getspecific(scratch_key);
    if (b == NULL || b->cap < n) {
        const size_t cap = n < ((size_t)1 << 20) ? (size_t)1 << 20 : n; /* 1 MiB at least */
        scratch_t *nb = malloc(sizeof(scratch_t) + cap);
        if (nb == NULL) return malloc(n);
        nb->cap = cap;
        if (pthread_setspecific(scratch_key, nb) != 0) {
            free(nb);
            return malloc(n);
        }
        free(b);
        b = nb;
    }
    *own = 0;
    return b->data;
}

/* The size a layer's hidden or intermediate size n is stored at: rounded up to the multiple the
 * format's kernels need (fp32: 8 columns; FP8: 16; the formats with int16 activations: 32; and
 * whole groups of G; q4_K: its 256, which its rows always are). quant/layout.py pads the weights
 * with zeros to it at load; the tokens are padded with zeros here and padded outputs dropped, so
 * a size off the multiple adds the same products (and zeros) as one on it. */
static int lcm(int a, int b) {
    int x = a, y = b;
    while (y != 0) {
        const int t = x % y;
        x = y, y = t;
    }
    return a / x * b;
}

static int pad_unit(int fmt, int G) {
    static const int unit[] = {8, 32, 32, 32, 16}; /* F_* up to FP8; the GGUF blocks: 256 */
    const int a = fmt >= F_F32 && fmt <= F_FP8 ? unit[fmt] : fmt <= F_LAST ? 256 : 1;
    return G > 0 ? lcm(a, G) : a;
}

/* A mixed layer (fmt_phase) stores both sizes at what both formats need. */
int hetserve_moe_padded(int fmt, int G, int n) {
    const int m = lcm(pad_unit(fmt_phase(fmt, 1), g_phase(G, 1)),
                      pad_unit(fmt_phase(fmt, 2), g_phase(G, 2)));
    return (n + m - 1) / m * m;
}

/* 1 when fmt (either phase's) is no format of ours. */
static int bad_fmt(int fmt) {
    const int f1 = fmt_phase(fmt, 1), f2 = fmt_phase(fmt, 2);
    return fmt < 0 || (fmt & ~F_A8) >> 10 || f1 > F_LAST || f2 > F_LAST;
}

/* A NUMA shard of a layer (moe/numa_experts.py): experts [base, base + E) of `total`, run
 * beside the other shards on their own thread teams. Their outputs meet in one `out`, summed in
 * shard order: shard `my` waits until *turn == my, adds its pairs, then passes the turn on, so
 * every token's sum runs over its experts in ascending id order as one unsplit call's does
 * (bit-exact); the two weight phases, nearly all of the time, still overlap. */
typedef struct {
    int base, total, my;
    int *turn;
    int passed; /* set once this shard has passed the turn on */
} hs_shard_t;

static void shard_wait(const hs_shard_t *sh) {
    while (__atomic_load_n(sh->turn, __ATOMIC_ACQUIRE) != sh->my) sched_yield();
}

static void shard_pass(hs_shard_t *sh) {
    __atomic_store_n(sh->turn, sh->my + 1, __ATOMIC_RELEASE);
    sh->passed = 1;
}

/* Returns 0, -1 when out of memory, -2 when an expert id is outside [0, E), -3 for an unknown
 * format. fmt: F_*; G: columns per scale group (int4, MXFP4 32, FP8, grouped int8; 0 = int8 per
 * row; unused by q4_K, whose super-blocks carry their scales: H and I multiples of 256); H, I:
 * the layer's sizes (x and out [T, H]), its weights and biases (b13/b2, or NULL) stored at
 * hetserve_moe_padded's; act 0 = silu, 1 = clamped SwiGLU(alpha, limit). */
static int moe_forward(int fmt, int nthreads, int E, int H, int I, int G, int T, int k,
                       const int64_t *ids, const float *tw, const float *x, float *out,
                       const void *w13, const void *s13, const void *w2, const void *s2,
                       const float *b13, const float *b2, int act, float alpha, float limit,
                       hs_shard_t *sh) {
    const int P = T * k, Hx = H; /* x and out are [T, Hx]; the weights' H may be padded */
    H = hetserve_moe_padded(fmt, G, H), I = hetserve_moe_padded(fmt, G, I);
    if (sh == NULL || sh->my == 0) memset(out, 0, sizeof(float) * (size_t)T * Hx);
    if (bad_fmt(fmt)) return -3;
    const int a8 = (fmt & F_A8) != 0;
    fmt &= ~F_A8;
    if (P == 0) return 0;
    if (bad_ids(sh ? sh->total : E, P, ids)) return -2;
    const int f1 = fmt_phase(fmt, 1), f2 = fmt_phase(fmt, 2);
    /* int16 (bf16) or the K-quants' int8 activations, per phase */
    const int q16 = rounded_acts(f1) || rounded_acts(f2);
    const int kq = kq_fmt(f1) || kq_fmt(f2), i16 = !kq_fmt(f1) || !kq_fmt(f2);
    /* int4's group sums (the minimum term): the smaller group of the two phases' */
    const int G4 = f1 == F_I4 && f2 == F_I4 ? (g_phase(G, 1) < g_phase(G, 2) ? g_phase(G, 1)
                                                                              : g_phase(G, 2))
                   : f1 == F_I4 ? g_phase(G, 1) : f2 == F_I4 ? g_phase(G, 2) : 0;
    size_t n_g = G4 ? (size_t)T * (H / G4) + (size_t)P * (I / G4) : 0; /* xgs, ags */
    size_t n_x = H != Hx ? (size_t)T * H : 0; /* x padded with zeros to the weights' H */
    size_t n_f = (size_t)P * (I + H) + P + T + P + n_g + n_x; /* a, y, pw, xsc, asc, xgs, ags, x */
    size_t n_i = (size_t)P + 4 * (size_t)E;               /* tok, act_e/off/cnt, fill */
    size_t n_q = q16 ? (size_t)T * H + (size_t)P * I : 0; /* rounded activations */
    const int xw = act_width(f1) > act_width(f2) ? act_width(f1) : act_width(f2);
    /* int16 ones (x16, a16), and/or the K-quants' int8 ones with their scales (1 per 256) and
     * sums (16) */
    size_t n_16 = i16 ? xw * n_q : 0;
    size_t n_p = kq ? n_q + n_q / Q4K_SB * (sizeof(float) + 16 * sizeof(int16_t)) : 0;
    int own;
    if (n_p) n_p += 64; /* room to start the int8 rows on a cache line */
    /* W8A8 rows as quad_u8 reads them, for a phase with int8 row-scaled weights */
    const int u1 = HS_U8ROWS && a8 && f1 == F_I8 && g_phase(G, 1) == 0;
    const int u2 = HS_U8ROWS && a8 && f2 == F_I8 && g_phase(G, 2) == 0;
    const size_t n_u = (u1 ? (size_t)T * H : 0) + (u2 ? (size_t)P * I : 0);
    const size_t head = sizeof(float) * n_f + sizeof(int) * n_i + sizeof(int16_t) * n_16 + n_p;
    char *buf = scratch(head + n_u, &own);
    if (buf == NULL) return -1;
    float *a = (float *)buf, *y = a + (size_t)P * I, *pw = y + (size_t)P * H;
    float *xsc = pw + P, *asc = xsc + T, *xgs = asc + P;
    float *ags = G4 ? xgs + (size_t)T * (H / G4) : xgs;
    int *tok = (int *)(a + n_f), *act_e = tok + P, *act_off = act_e + E, *act_cnt = act_off + E;
    int16_t *x16 = (int16_t *)(act_cnt + 2 * E), *a16 = x16 + (size_t)xw * T * H;
    float *xpd = (float *)(x16 + n_16), *apd = xpd + (size_t)T * H / Q4K_SB;
    int16_t *xps = (int16_t *)(xpd + n_q / Q4K_SB), *aps = xps + (size_t)T * H / Q4K_SB * 16;
    /* on a cache line: no load of the kernel's reads them across two */
    int8_t *xpl = (int8_t *)(((uintptr_t)(xps + n_q / Q4K_SB * 16) + 63) & ~(uintptr_t)63);
    int8_t *apl = xpl + (size_t)T * H;
    if (n_x) {
        float *xp = a + n_f - n_x;
        for (int t = 0; t < T; t++) {
            memcpy(xp + (size_t)t * H, x + (size_t)t * Hx, sizeof(float) * Hx);
            memset(xp + (size_t)t * H + Hx, 0, sizeof(float) * (H - Hx));
        }
        x = xp;
    }
    int kept;
    int n = sort_pairs(E, sh ? sh->base : 0, P, k, ids, tw, tok, pw, act_e, act_off, act_cnt,
                       act_cnt + E, &kept);
    job_t j = {fmt, H, I, G, act, alpha, limit, b13, b2, x, w13, w2, s13, s2, tok, pw,
               a, y, x16, a16, xsc, asc, xgs, ags, xpl, apl, xps, aps, xpd, apd, n, act_e, act_off,
               act_cnt, nthreads < 1 ? 1 : nthreads, a8,
               u1 ? (uint8_t *)buf + head : NULL,
               u2 ? (uint8_t *)buf + head + (u1 ? (size_t)T * H : 0) : NULL};
    if (rounded_acts(f1)) activations(&j, 1, T);
    run_phase(&j, 1, phase_item, NULL);
    if (rounded_acts(f2)) activations(&j, 2, kept);
    run_phase(&j, 2, phase_item, NULL);
    if (sh) shard_wait(sh);
    for (int p = 0; p < kept; p++) { /* pairs of one token never race: this loop is serial */
        float *o = out + (size_t)tok[p] * Hx;
        const float *yp = y + (size_t)p * H;
        for (int h = 0; h < Hx; h++) o[h] += yp[h];
    }
    if (sh) shard_pass(sh);
    if (own) free(buf);
    return 0;
}

int hetserve_moe_forward(int fmt, int nthreads, int E, int H, int I, int G, int T, int k,
                         const int64_t *ids, const float *tw, const float *x, float *out,
                         const void *w13, const void *s13, const void *w2, const void *s2,
                         const float *b13, const float *b2, int act, float alpha, float limit) {
    return moe_forward(fmt, nthreads, E, H, I, G, T, k, ids, tw, x, out, w13, s13, w2, s2, b13,
                       b2, act, alpha, limit, NULL);
}

/* A layer's experts as hetserve_moe_new records them: the arguments of hetserve_moe_forward
 * that stay the same from call to call; and how long the last hetserve_moe_run took inside C
 * (bench moe-kernel: the kernel's time without the Python around it). */
typedef struct {
    int fmt, E, H, I, G, act;
    float alpha, limit;
    const void *w13, *s13, *w2, *s2;
    const float *b13, *b2;
    long long last_ns;
    int base, total; /* a NUMA shard's first expert id and its layer's experts (else 0, E) */
} hs_moe_t;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* A handle on one layer's experts for hetserve_moe_run / hetserve_moe_touch (the weights stay
 * the caller's and must outlive it; hetserve_moe_free releases it). NULL for an unknown format
 * or when out of memory. Python calls a layer through it with eight arguments, not
 * hetserve_moe_forward's 21: from cold caches, as a decode step's layers meet them, each ctypes
 * argument costs, and the handle saves ~10 us per call. */
void *hetserve_moe_new(int fmt, int E, int H, int I, int G, const void *w13, const void *s13,
                       const void *w2, const void *s2, const float *b13, const float *b2, int act,
                       float alpha, float limit) {
    if (bad_fmt(fmt)) return NULL;
    hs_moe_t *m = malloc(sizeof(*m));
    if (m == NULL) return NULL;
    *m = (hs_moe_t){fmt, E, H, I, G, act, alpha, limit, w13, s13, w2, s2, b13, b2, 0, 0, E};
    return m;
}

void hetserve_moe_free(void *h) { free(h); }

/* hetserve_moe_forward on a handle's experts. */
int hetserve_moe_run(void *h, int nthreads, int T, int k, const int64_t *ids, const float *tw,
                     const float *x, float *out) {
    hs_moe_t *m = (hs_moe_t *)h;
    const long long t0 = now_ns();
    int rc = hetserve_moe_forward(m->fmt, nthreads, m->E, m->H, m->I, m->G, T, k, ids, tw, x,
                                  out, m->w13, m->s13, m->w2, m->s2, m->b13, m->b2, m->act,
                                  m->alpha, m->limit);
    __atomic_store_n(&m->last_ns, now_ns() - t0, __ATOMIC_RELAXED); /* calls may overlap */
    return rc;
}

/* Makes the handle a NUMA shard: its experts are ids [base, base + E) of a layer of `total`. */
void hetserve_moe_shard(void *h, int base, int total) {
    hs_moe_t *m = (hs_moe_t *)h;
    m->base = base, m->total = total;
}

/* hetserve_moe_run of one shard beside the others (hs_shard_t): pairs routed to other shards'
 * experts are skipped, and the sum into `out` (zeroed by shard 0) waits for this shard's turn.
 * Every return passes the turn on, so an error in one shard never leaves the others waiting. */
int hetserve_moe_run_shard(void *h, int nthreads, int T, int k, const int64_t *ids,
                           const float *tw, const float *x, float *out, int *turn, int my) {
    hs_moe_t *m = (hs_moe_t *)h;
    hs_shard_t sh = {m->base, m->total, my, turn, 0};
    const long long t0 = now_ns();
    int rc = moe_forward(m->fmt, nthreads, m->E, m->H, m->I, m->G, T, k, ids, tw, x, out, m->w13,
                         m->s13, m->w2, m->s2, m->b13, m->b2, m->act, m->alpha, m->limit, &sh);
    if (!sh.passed) {
        shard_wait(&sh);
        shard_pass(&sh);
    }
    __atomic_store_n(&m->last_ns, now_ns() - t0, __ATOMIC_RELAXED);
    return rc;
}

/* Seconds the handle's last hetserve_moe_run took, entry to return. */
double hetserve_moe_last_seconds(const void *h) {
    return (double)__atomic_load_n(&((const hs_moe_t *)h)->last_ns, __ATOMIC_RELAXED) * 1e-9;
}

/* Reads what hetserve_moe_run(h, ...) with these ids would read of the weights (the experts the
 * ids route to, both phases, the same work items on the same threads) and nothing else: the
 * limit a layer call meets from memory alone; *touched = the bytes read, *seconds the time
 * taken (timed as hetserve_moe_run is). Returns 0, -1 when out of memory, -2 for an id outside
 * [0, E). */
int hetserve_moe_touch(const void *h, int nthreads, int T, int k, const int64_t *ids,
                       long long *touched, double *seconds) {
    const long long t0 = now_ns();
    const hs_moe_t *m = (const hs_moe_t *)h;
    const int E = m->E;
    if (bad_ids(E, T * k, ids)) return -2;
    /* the active experts and their pair counts (phase_rc sizes the items by them) */
    int *act_e = calloc((size_t)3 * E + 1, sizeof(int)), *seen = act_e + E, *cnt = seen + E;
    if (act_e == NULL) return -1;
    int n = 0;
    for (int p = 0; p < T * k; p++)
        if (!seen[ids[p]]++) n++;
    for (int e = 0, i = 0; e < E; e++)
        if (seen[e]) cnt[i] = seen[e], act_e[i++] = e;
    job_t j;
    memset(&j, 0, sizeof(j));
    j.fmt = m->fmt & ~F_A8, j.G = m->G;
    j.H = hetserve_moe_padded(m->fmt, m->G, m->H), j.I = hetserve_moe_padded(m->fmt, m->G, m->I);
    j.w13 = m->w13, j.s13 = m->s13, j.w2 = m->w2, j.s2 = m->s2;
    j.n_active = n, j.act_e = act_e, j.act_cnt = cnt;
    j.nthreads = nthreads < 1 ? 1 : nthreads;
    *touched = 0;
    if (n > 0) {
        run_phase(&j, 1, touch_item, touched);
        run_phase(&j, 2, touch_item, touched);
    }
    free(act_e);
    *seconds = (double)(now_ns() - t0) * 1e-9;
    return 0;
}
