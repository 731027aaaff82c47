/* Plain quantized linears (hetserve_qlinear) on the routed experts' microkernels: what
 * `cpu-int8` placement puts on the non-expert linears of CPU-only serving
 * (hetserve/layers/int8_linear.py). Built with the other kernels by hetserve/native/__init__.py.
 *
 * y[t, n] = sum_k W[n, k] * x[t, k] for one matrix [N, K] in the quad layout of moe_quads.h,
 * stored zero-padded to whole quads of rows and to hetserve_moe_padded's K (x is padded here,
 * padded outputs dropped), in one of the formats:
 *   fmt 1 (int8), G == 0: one fp32 scale per row, s [N]; fmt 1 | F_A8 (moe_job.h): the same
 *                         with W8A8 activations (rounded to |x| <= 127 per row);
 *   fmt 1 (int8), G > 0:  one fp16 scale per row and group of G columns (GGUF q8_0: 32,
 *                         its own fp16 numbers), stored [N / 4][K / G][4] (G % 16 == 0);
 *   fmt 5 (q4_K):         super-blocks of 256 columns with their own scales (moe_q4k.h);
 *   fmt 6 (q6_K), 7 (q5_K), 8 (IQ4_XS), 9 (IQ4_NL), 10 (q3_K), 11 (q2_K), 12-18 (the grid
 *                         i-quants IQ2_XXS .. IQ1_M, moe_iqg.h): each row's blocks
 *                         as a GGUF file stores
 *                         them (the i-quants' bytes regrouped as for the experts), rows in file
 *                         order (moe_kq.h), padded with zero rows to whole quads.
 * Activations are rounded to int16 per row, as for the experts; for the K-quants to int8 per
 * super-block (llama.cpp's q8_K: moe_q4k.h for q4_K's column order, moe_kq.h for the others). */
/* No implicit fused multiply-adds: the quad and GEMM paths round the same steps alike. */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe_amx.h"
#include "moe_gemm.h"
#include "moe_kgemm.h"
#include "moe_kq.h"
#include "moe_q4k.h"
#include "moe_quads.h"
#include "pool.h"

int hetserve_moe_padded(int fmt, int G, int n); /* moe_kernels.c */

#define TB 32 /* tokens per cache block */
#define RC 8  /* row quads per work chunk, at least */
/* ... and about this many bytes of weights (hs_item_units): RC quads of a q4_K row of 2048 are
 * only 36 KiB; items of ~128 KiB read a 2048 x 3072 q4_K matrix at one token ~1.25x faster. */
#define ITEM_BYTES (128 << 10)
enum { L_I8 = 1, L_Q4K = 5, L_Q6K = 6, L_Q5K = 7, L_IQ4XS = 8, L_IQ4NL = 9, L_Q3K = 10,
       L_Q2K = 11 }; /* moe_job.h's F_* */

typedef struct {
    int fmt, G, T, N, K, rc; /* rc: row quads per work item */
    const void *w;
    const float *s, *xsc; /* s: per-row fp32 scales, or (G > 0) fp16 ones per group; xsc:
                           * the activations' per-row scales (NULL for q4_K: per super-block) */
    const int16_t *x16;
    const int8_t *pl;  /* K-quants: int8 activations [T, K] */
    const int16_t *ps; /* K-quants: their sums per 16 (q4_K: per sub-block) [T, K / 256, 16] */
    const float *pd;   /* K-quants: their scales per super-block [T, K / 256] */
    float *out;
    /* the K-quant tiles' activations (kg_widen) [T, K] and sums [T, K / 256, KG_MS], or NULL */
    const int16_t *kg16, *kgms;
    const int32_t *kgxp; /* kg16's rows packed for the tiles (gemm_pack_x) */
    const amx_rows_t *amx; /* int8 with row scales at the tiles' token counts: the rows split for
                            * the AMX tiles or packed for the AVX ones, once; else NULL */
    const uint8_t *xu8; /* W8A8 with row scales on AVX-512: x16 + 128 as bytes (quad_u8) */
} lin_t;

/* Tokens per row-kernel call: quad_i8's I8_MB for int8 with row scales, else 2. */
static inline int lin_step(const lin_t *l) {
    return l->fmt == L_I8 && l->G == 0 ? I8_MB : 2;
}

/* Rows [n0, n0 + 4 nq) against tokens m .. m + MB - 1 (MB <= lin_step); nq = 2 for q4_K only. */
static inline void lin_quad(const lin_t *l, int n0, int nq, int m, int MB, float o[8][MBMAX]) {
    const int K = l->K, m1 = m + MB - 1;
    if (l->fmt != L_I8) { /* the K-quants: int8 activations per super-block */
        const uint8_t *q = (const uint8_t *)l->w + (size_t)n0 * (K / Q4K_SB) * kq_bytes(l->fmt);
        const q4k_act_t a[2] = {q4k_row(l->pl, l->pd, l->ps, K, m),
                                q4k_row(l->pl, l->pd, l->ps, K, m1)};
        /* one copy of the row kernel per format and token count (constants where inlined) */
#define HS_KQ(F) if (MB == 2) quad_kq(q, F, K, a, 2, o); else quad_kq(q, F, K, a, 1, o); break;
        switch (l->fmt) {
        case L_Q6K: HS_KQ(L_Q6K)
        case L_Q5K: HS_KQ(L_Q5K)
        case L_IQ4XS: HS_KQ(L_IQ4XS)
        case L_IQ4NL: HS_KQ(L_IQ4NL)
        case L_Q3K: HS_KQ(L_Q3K)
        case L_Q2K: HS_KQ(L_Q2K)
        case F_IQ2XXS: HS_KQ(F_IQ2XXS)
        case F_IQ2XS: HS_KQ(F_IQ2XS)
        case F_IQ2S: HS_KQ(F_IQ2S)
        case F_IQ3XXS: HS_KQ(F_IQ3XXS)
        case F_IQ3S: HS_KQ(F_IQ3S)
        case F_IQ1S: HS_KQ(F_IQ1S)
        case F_IQ1M: HS_KQ(F_IQ1M)
        default: /* q4_K */
            if (nq == 2) {
                if (MB == 2) quad_q4k(q, 2, K, a, 2, o); else quad_q4k(q, 2, K, a, 1, o);
            } else {
                if (MB == 2) quad_q4k(q, 1, K, a, 2, o); else quad_q4k(q, 1, K, a, 1, o);
            }
        }
#undef HS_KQ
        return;
    }
    const int8_t *q = (const int8_t *)l->w + (size_t)n0 * K;
    const int16_t *const xr[2] = {l->x16 + (size_t)m * K, l->x16 + (size_t)m1 * K};
    if (l->G > 0) {
        const uint16_t *s = (const uint16_t *)l->s + (size_t)n0 * (K / l->G); /* fp16 */
        if (MB == 2) quad_i8g(q, s, K, l->G, xr, 2, o); else quad_i8g(q, s, K, l->G, xr, 1, o);
        return;
    }
    const int16_t *x4[4]; /* tokens m .. m + 3, the last of MB repeated */
    for (int i = 0; i < 4; i++) x4[i] = l->x16 + (size_t)(m + (i < MB ? i : MB - 1)) * K;
#if HS_U8ROWS
    if (l->xu8 != NULL) {
        const uint8_t *u4[4];
        for (int i = 0; i < 4; i++) u4[i] = l->xu8 + (size_t)(m + (i < MB ? i : MB - 1)) * K;
        switch (MB) {
        case 4: quad_u8(q, K, u4, 4, o); break;
        case 3: quad_u8(q, K, u4, 3, o); break;
        case 2: quad_u8(q, K, u4, 2, o); break;
        default: quad_u8(q, K, u4, 1, o); break;
        }
    } else
#endif
    switch (MB) {
#if I8_MB == 4
    case 4: quad_i8(q, K, x4, 4, o); break;
    case 3: quad_i8(q, K, x4, 3, o); break;
#endif
    case 2: quad_i8(q, K, x4, 2, o); break;
    default: quad_i8(q, K, x4, 1, o); break;
    }
    for (int r = 0; r < 4; r++)
        for (int mm = 0; mm < MB; mm++) o[r][mm] *= l->s[n0 + r];
}

/* Quads [u0, u1) on the GEMM tiles (int8 rows with fp32 scales; u0 a multiple of 4): per strip
 * of 4 quads one panel, met by all T tokens, TBG at a time. Quads past the matrix's last one
 * pack as zeros. The float steps are lin_quad's and lin_item's own: the same bits. Returns -1
 * when out of memory, having written nothing. */
#define TBG 96
static int lin_item_gemm(const lin_t *l, int u0, int u1) {
    const int K = l->K, quads = (l->N + 3) / 4;
    const size_t panel_bytes = (size_t)K * GEMM_ROWS * sizeof(int16_t);
    char *buf = aligned_alloc(64, panel_bytes + 2 * (size_t)TBG * GEMM_ROWS * sizeof(float));
    if (buf == NULL) return -1;
    int16_t *panel = (int16_t *)buf;
    int32_t *isum = (int32_t *)(buf + panel_bytes);
    float *out = (float *)(isum + TBG * GEMM_ROWS);
    const amx_rows_t *ax = l->amx; /* the rows split (AMX) or packed (AVX) by hetserve_qlinear */
    amx_rows_begin(ax);
    for (int u = u0; u < u1; u += 4) {
        const int8_t *q[4];
        for (int k = 0; k < 4; k++)
            q[k] = u + k < quads ? (const int8_t *)l->w + (size_t)(u + k) * 4 * K : NULL;
        strip_pack(ax, q, K, panel); /* quads past the last pack as zeros */
        const int rows = 4 * (u + 4) <= l->N ? GEMM_ROWS : l->N - 4 * u;
        for (int t0 = 0; t0 < l->T; t0 += TBG) {
            const int n = l->T - t0 < TBG ? l->T - t0 : TBG;
            /* the next strip of the item (quads u + 4 .. u + 7: 16 K bytes on from these) */
            const char *next = t0 == 0 && u + 4 < u1 && u + 8 <= quads
                                   ? (const char *)l->w + (size_t)(u + 4) * 4 * K
                                   : NULL;
            strip_sums(ax, panel, K, t0, n, isum, out, next);
            for (int m = 0; m < n; m++) {
                float *y = l->out + (size_t)(t0 + m) * l->N + 4 * u;
                const float sx = l->xsc[t0 + m];
                for (int r = 0; r < rows; r++) y[r] = out[m * GEMM_ROWS + r] * l->s[4 * u + r] * sx;
            }
        }
    }
    amx_rows_end(ax);
    free(buf);
    return 0;
}

/* Quads [u0, u1) on the tiles of moe_kgemm.h (the K-quants, the 4-bit i-quants, grouped int8;
 * u0 a multiple of 4): per strip of 4 quads one dequantized panel, met by all T tokens (kg16 /
 * kgms: their rows widened once by hetserve_qlinear; grouped int8's own int16 rows), TBG at a
 * time. q4_K's quads pair up (2a, 2a + 1), the last one alone where the count is odd; quads
 * past the last pack as zeros. -1 when out of memory, nothing written. */
static int lin_item_kgemm(const lin_t *l, int u0, int u1) {
    const int K = l->K, quads = (l->N + 3) / 4, nsb = K / Q4K_SB, i8 = l->fmt == L_I8;
    const int gk = kg_group(l->fmt, l->G), span = i8 ? K : Q4K_SB;
    const size_t sb = kg_strip_bytes(K), rb = i8 ? (size_t)K : (size_t)nsb * kq_bytes(l->fmt);
    char *buf = aligned_alloc(64, sb + 2 * (size_t)TBG * GEMM_ROWS * sizeof(float));
    if (buf == NULL) return -1;
    kg_strip_t st;
    kg_strip_init(&st, buf, K);
    int32_t *isum = (int32_t *)(buf + sb);
    float *out = (float *)(isum + TBG * GEMM_ROWS);
    const int16_t *ms[TBG];
    const float *xd[TBG];
    for (int u = u0; u < u1; u += 4) {
        kg_quad_t q[4];
        for (int k = 0; k < 4; k++) {
            const int qu = u + k, pair = l->fmt == L_Q4K ? qu - qu % 2 : qu;
            const uint8_t *base = (const uint8_t *)l->w + (size_t)4 * pair * rb;
            const uint16_t *sc = i8 ? (const uint16_t *)l->s + (size_t)4 * qu * (K / l->G) : NULL;
            const kg_quad_t one = {qu < quads ? base : NULL,
                                   l->fmt == L_Q4K && pair + 1 < quads ? 2 : 1,
                                   l->fmt == L_Q4K ? qu % 2 : 0, sc};
            q[k] = one;
        }
        kg_pack(l->fmt, l->G, q, K, &st);
        const int rows = 4 * (u + 4) <= l->N ? GEMM_ROWS : l->N - 4 * u;
        for (int t0 = 0; t0 < l->T; t0 += TBG) {
            const int n = l->T - t0 < TBG ? l->T - t0 : TBG;
            for (int m = 0; m < n; m++) {
                ms[m] = i8 ? NULL : l->kgms + (size_t)(t0 + m) * nsb * KG_MS;
                xd[m] = i8 ? l->xsc + t0 + m : l->pd + (size_t)(t0 + m) * nsb;
            }
            /* the next strip of the item (quads u + 4 ..: rows 4 (u + 4) on, in file order) */
            const char *next = t0 == 0 && u + 4 < u1 && u + 8 <= quads
                                   ? (const char *)l->w + (size_t)4 * (u + 4) * rb
                                   : NULL;
            kg_strip_gemm(&st, l->fmt, K, gk, span, l->kgxp + (size_t)t0 * (K / 2), xd, ms, NULL,
                          n, isum, out, next);
            for (int m = 0; m < n; m++) {
                float *y = l->out + (size_t)(t0 + m) * l->N + 4 * u;
                for (int r = 0; r < rows; r++) y[r] = out[m * GEMM_ROWS + r];
            }
        }
    }
    free(buf);
    return 0;
}

static void lin_item(void *ctx, int c) {
    const lin_t *l = (const lin_t *)ctx;
    const int quads = (l->N + 3) / 4; /* the last one's padded rows are dropped */
    const int u0 = c * l->rc, u1 = u0 + l->rc < quads ? u0 + l->rc : quads;
    if (l->amx != NULL && lin_item_gemm(l, u0, u1) == 0) return; /* int8 rows: the tiles */
    if (l->kg16 != NULL && u0 % 4 == 0 && lin_item_kgemm(l, u0, u1) == 0) return;
    for (int t0 = 0; t0 < l->T; t0 += TB) {
        int t1 = t0 + TB < l->T ? t0 + TB : l->T;
        for (int u = u0, nq; u < u1; u += nq) {
            nq = l->fmt == L_Q4K && u + 1 < u1 ? 2 : 1; /* q4_K: two quads share activations */
            const int step = lin_step(l);
            for (int m = t0; m < t1; m += step) {
                int MB = t1 - m >= step ? step : t1 - m;
                float o[8][MBMAX];
                lin_quad(l, 4 * u, nq, m, MB, o);
                const int rows = 4 * (u + nq) <= l->N ? 4 * nq : l->N - 4 * u;
                for (int mm = 0; mm < MB; mm++) {
                    float *y = l->out + (size_t)(m + mm) * l->N + 4 * u;
                    const float sx = l->xsc ? l->xsc[m + mm] : 1.0f;
                    for (int r = 0; r < rows; r++) y[r] = o[r][mm] * sx;
                }
            }
        }
    }
}

/* The rounding of the activation rows (int16 per row; the K-quants: int8 per super-block),
 * rows [r0, r1); each row on its own, so any split gives the same bytes. */
typedef struct {
    int fmt, K, lim; /* lim: ACT_Q, or ACT_Q8 for W8A8 */
    const float *x;
    int8_t *pl;
    float *pd, *xsc;
    int16_t *ps, *x16;
    uint8_t *u8; /* quad_u8's rows, or NULL */
} lin_round_t;

static void lin_round_rows(void *ctx, int r0, int r1) {
    const lin_round_t *r = (const lin_round_t *)ctx;
    const int K = r->K, nsb = K / Q4K_SB;
    if (r->fmt == L_I8) {
        quantize_rows(r->x, K, r0, r1, r->x16, r->xsc, 0, 0, NULL, r->lim, r->u8);
        return;
    }
    const size_t o = (size_t)r0 * K, ob = (size_t)r0 * nsb;
    const int n = (r1 - r0) * K; /* rows back to back: super-blocks apart */
    if (r->fmt == L_Q4K) q4k_quantize(r->x + o, n, r->pl + o, r->pd + ob, r->ps + 16 * ob);
    else kq_quantize(r->x + o, n, r->pl + o, r->pd + ob, r->ps + 16 * ob, kq_act_perm(r->fmt));
}

/* x [T, K] fp32 -> out [T, N]; w and s as above (s unused for the K-quants). Returns 0, -1 (out
 * of memory) or -3 (unknown format). */
int hetserve_qlinear(int fmt, int G, int nthreads, int T, int N, int K, const float *x,
                     float *out, const void *w, const void *s) {
    const int a8 = (fmt & F_A8) != 0; /* W8A8 rows */
    fmt &= ~F_A8;
    if (fmt != L_I8 && (fmt < L_Q4K || fmt > F_LAST)) return -3;
    if (T <= 0) return 0;
    const int Kx = K; /* x's columns; the weights' may be padded */
    K = hetserve_moe_padded(fmt, G, K);
    const size_t n = (size_t)T * K, n_x = K != Kx ? n : 0;
    const int kq = fmt != L_I8, nsb = K / Q4K_SB; /* a K-quant */
    /* int16 activations and their per-row scales, or q4_K's int8 ones, scales and sums; then x
     * padded with zeros where K is */
    const size_t bytes = kq ? n + (size_t)T * nsb * (sizeof(float) + 16 * sizeof(int16_t))
                             : (sizeof(int16_t) * n + sizeof(float) * (size_t)T);
    /* W8A8 on the row kernels: the rows also as quad_u8 reads them */
    const size_t n_u = HS_U8ROWS && a8 && fmt == L_I8 && G == 0 && !gemm_worth_i8(T) ? n : 0;
    char *buf = malloc(bytes + sizeof(float) * n_x + n_u);
    if (buf == NULL) return -1;
    if (n_x) {
        float *xp = (float *)(buf + bytes); /* bytes: a multiple of 4 */
        for (int t = 0; t < T; t++) {
            memcpy(xp + (size_t)t * K, x + (size_t)t * Kx, sizeof(float) * Kx);
            memset(xp + (size_t)t * K + Kx, 0, sizeof(float) * (K - Kx));
        }
        x = xp;
    }
    int16_t *x16 = NULL, *ps = NULL;
    float *xsc = NULL, *pd = NULL;
    int8_t *pl = NULL;
    if (kq) { /* the int8 rows first: malloc's alignment, whole super-blocks */
        pl = (int8_t *)buf;
        pd = (float *)(pl + n);
        ps = (int16_t *)(pd + (size_t)T * nsb);
    } else {
        xsc = (float *)buf;
        x16 = (int16_t *)(xsc + T);
    }
    nthreads = nthreads < 1 ? 1 : nthreads;
    /* many rows (prefill) rounded on every thread, a few (decode) on the caller's alone */
    uint8_t *xu8 = n_u ? (uint8_t *)buf + bytes + sizeof(float) * n_x : NULL;
    lin_round_t rnd = {fmt, K, a8 ? ACT_Q8 : ACT_Q, x, pl, pd, xsc, ps, x16, xu8};
    hs_parallel_rows(nthreads, T, 32, lin_round_rows, &rnd);
    const long quad_bytes = /* weights of 4 rows */
        fmt == L_I8 ? 4L * K : 4L * nsb * kq_bytes(fmt);
    const int quads = (N + 3) / 4;
    int rc = hs_item_units(quad_bytes, ITEM_BYTES, quads, nthreads, RC);
    rc += fmt == L_Q4K && rc % 2; /* q4_K: whole pairs (its layout interleaves quads 2u, 2u + 1) */
    if (fmt == L_I8 && G == 0) rc = (rc + 3) / 4 * 4; /* whole strips of the GEMM tiles */
    lin_t l = {fmt, G, T, N, K, rc, w, s, xsc, x16, pl, ps, pd, out, NULL, NULL, NULL, NULL,
               xu8};
    amx_rows_t ax = {0}; /* the int8 GEMM's rows prepared once for every item (AMX or AVX) */
    if (fmt == L_I8 && G == 0 && gemm_worth_i8(T) && amx_rows_split(&ax, x16, NULL, T, K, a8) == 0)
        l.amx = &ax;
    char *kbuf = NULL;
    if (fmt == L_I8 && kg_group(fmt, G) > 0 && gemm_worth(T)) { /* grouped: rows in place */
        l.kg16 = x16;
        l.rc = rc = (rc + 3) / 4 * 4; /* whole strips */
    } else if (kq && kg_group(fmt, G) > 0 && gemm_worth(T)) { /* int16 rows, sub-block sums */
        kbuf = malloc((size_t)T * (K + nsb * KG_MS) * sizeof(int16_t));
        if (kbuf != NULL) {
            int16_t *k16 = (int16_t *)kbuf, *kms = k16 + (size_t)T * K;
            for (int t = 0; t < T; t++)
                kg_widen(fmt, pl + (size_t)t * K, ps + (size_t)t * nsb * 16, K,
                         k16 + (size_t)t * K, kms + (size_t)t * nsb * KG_MS);
            l.kg16 = k16, l.kgms = kms;
            l.rc = rc = (rc + 3) / 4 * 4; /* whole strips */
        }
    }
    int32_t *kxp = NULL; /* the tiles' rows packed once for every item; without memory for them,
                          * the row kernels */
    if (l.kg16 != NULL && (kxp = aligned_alloc(64, (gemm_xp_bytes(T, K) + 63) / 64 * 64)) == NULL)
        l.kg16 = NULL;
    if (kxp != NULL) gemm_pack_x(l.kg16, NULL, T, K, kxp);
    l.kgxp = kxp;
    hs_parallel_for(nthreads, (quads + rc - 1) / rc, lin_item, &l);
    amx_rows_free(&ax);
    free(kxp);
    free(kbuf);
    free(buf);
    return 0;
}

/* The int8 linear with one scale per row (fmt 1, G 0); kept for callers of the old name. */
int hetserve_int8_linear(int nthreads, int T, int N, int K, const float *x, float *out,
                         const void *w, const float *s) {
    return hetserve_qlinear(L_I8, 0, nthreads, T, N, K, x, out, w, s);
}
