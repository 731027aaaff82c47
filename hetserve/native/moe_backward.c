/* Backward of one routed-experts layer with frozen weights (fine-tuning, hetserve/finetune/).
 *
 * Forward (moe_kernels.c or any backend): out[t] = sum_j w[t,j] * W2_e (silu(g) * u),
 * g = W1_e x_t, u = W3_e x_t, e = ids[t,j]. Given grad_out, this computes the input gradient
 * dx[t] and the router-weight gradient dw[t,j]; the weights get none (they are frozen):
 *   d    = W2_e^T grad_out[t]                       (per pair, length I)
 *   dw   = d . (silu(g) * u)
 *   dh   = w * d;  dg = dh * u * silu'(g);  du = dh * silu(g)
 *   dx_p = W1_e^T dg + W3_e^T du;  dx[t] = sum_j dx_p(t, j)
 * g and u are recomputed (one extra gate+up pass) rather than saved by the forward: the
 * forward kernel keeps no activations, and [P, 2I] per layer would dominate training memory.
 *
 * Weight formats (fmt), all in the plain row-major layout [E, rows, cols]:
 *   32: fp32 (the model's own tensors);
 *    8: int8 with one fp32 scale per row: w_hat = q * s[row];
 *    4: int4 (two per byte, low nibble first) with fp32 scale and minimum per group of G
 *       columns: w_hat = q * s + m.
 * A quantized row is dequantized once into fp32 and then meets every pair of a block of up
 * to PB pairs of the same expert, so the unpacking is amortised. Work items are (expert,
 * block) pairs, independent of each other: each writes its own pairs' rows of dxp.
 * Built by hetserve/native/__init__.py with the other kernels (no torch headers).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "simd.h"

#define PB 8 /* pairs per block: 8 accumulators + 1 row + 1 input fit the 16 ymm registers */

typedef struct {
    int fmt, H, I, G, K;
    const float *x, *gout, *tw;
    const void *w13, *w2;
    const float *s13, *m13, *s2, *m2;
    const int *pairs; /* pair indices p = t * K + j, sorted by expert */
    const int *item_e, *item_start, *item_n;
    float *dxp, *dw;
    int *failed; /* set when a block cannot allocate its scratch */
} bjob_t;

/* Row r of expert e's matrix [rows, cols] as fp32: a pointer into fp32 weights, or `buf`
 * filled by dequantizing. */
static const float *load_row(const bjob_t *j, const void *w, const float *s, const float *m,
                             int e, int r, int rows, int cols, float *buf) {
    size_t row = (size_t)e * rows + r;
    if (j->fmt == 32) return (const float *)w + row * cols;
    if (j->fmt == 8) {
        const int8_t *q = (const int8_t *)w + row * cols;
        __m256 sc = _mm256_set1_ps(s[row]);
        for (int c = 0; c < cols; c += 8) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(q + c));
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
            _mm256_storeu_ps(buf + c, _mm256_mul_ps(v, sc));
        }
        return buf;
    }
    const uint8_t *q = (const uint8_t *)w + row * (cols / 2);
    int ng = cols / j->G;
    for (int g = 0; g < ng; g++) {
        float sc = s[row * ng + g], mn = m[row * ng + g];
        for (int c = g * j->G; c < (g + 1) * j->G; c += 2) {
            uint8_t b = q[c / 2];
            buf[c] = (float)(b & 15) * sc + mn;
            buf[c + 1] = (float)(b >> 4) * sc + mn;
        }
    }
    return buf;
}

/* out[i] = row . xs[i] for i < n (n <= PB), len % 8 == 0. */
static void dot_block(const float *row, const float *const xs[PB], int n, int len, float *out,
                      int stride) {
    __m256 acc[PB];
    for (int i = 0; i < n; i++) acc[i] = _mm256_setzero_ps();
    for (int c = 0; c < len; c += 8) {
        __m256 wv = _mm256_loadu_ps(row + c);
        for (int i = 0; i < n; i++) acc[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs[i] + c), acc[i]);
    }
    for (int i = 0; i < n; i++) out[(size_t)i * stride] = hs_hsum(acc[i]);
}

/* ys[i] += coef[i * stride] * row for i < n, len % 8 == 0. */
static void axpy_block(const float *row, float *const ys[PB], int n, int len, const float *coef,
                       int stride) {
    for (int c = 0; c < len; c += 8) {
        __m256 wv = _mm256_loadu_ps(row + c);
        for (int i = 0; i < n; i++) {
            __m256 y = _mm256_loadu_ps(ys[i] + c);
            _mm256_storeu_ps(ys[i] + c, _mm256_fmadd_ps(_mm256_set1_ps(coef[(size_t)i * stride]), wv, y));
        }
    }
}

static inline float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

static void block_task(void *ctx, int item) {
    const bjob_t *j = (const bjob_t *)ctx;
    const int H = j->H, I = j->I, K = j->K;
    const int e = j->item_e[item], n = j->item_n[item];
    const int *pairs = j->pairs + j->item_start[item];
    float *gu = malloc(sizeof(float) * ((size_t)PB * 2 * I + (size_t)PB * I + (H > 2 * I ? H : 2 * I)));
    if (gu == NULL) {
        __atomic_store_n(j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    float *d = gu + (size_t)PB * 2 * I, *buf = d + (size_t)PB * I;
    const float *xs[PB], *go[PB];
    float *ds[PB], *dxs[PB];
    for (int i = 0; i < n; i++) {
        int t = pairs[i] / K;
        xs[i] = j->x + (size_t)t * H;
        go[i] = j->gout + (size_t)t * H;
        ds[i] = d + (size_t)i * I;
        dxs[i] = j->dxp + (size_t)pairs[i] * H;
        memset(ds[i], 0, sizeof(float) * I);
        memset(dxs[i], 0, sizeof(float) * H);
    }
    /* recompute gate and up: gu[i, r] */
    for (int r = 0; r < 2 * I; r++) {
        const float *row = load_row(j, j->w13, j->s13, j->m13, e, r, 2 * I, H, buf);
        dot_block(row, xs, n, H, gu + r, 2 * I);
    }
    /* d_i = W2^T grad_out_i: one axpy per row of W2 */
    float coef[PB];
    for (int h = 0; h < H; h++) {
        const float *row = load_row(j, j->w2, j->s2, j->m2, e, h, H, I, buf);
        for (int i = 0; i < n; i++) coef[i] = go[i][h];
        axpy_block(row, ds, n, I, coef, 1);
    }
    /* through silu * up: dw, then gu becomes (dg, du) in place */
    for (int i = 0; i < n; i++) {
        float *g = gu + (size_t)i * 2 * I, *u = g + I, w = j->tw[pairs[i]];
        double dwsum = 0.0;
        for (int c = 0; c < I; c++) {
            float sg = sigmoidf(g[c]), s = g[c] * sg, dc = ds[i][c];
            dwsum += (double)dc * s * u[c];
            float dh = w * dc;
            float dg = dh * u[c] * sg * (1.0f + g[c] * (1.0f - sg));
            u[c] = dh * s;
            g[c] = dg;
        }
        j->dw[pairs[i]] = (float)dwsum;
    }
    /* dx_p = W13^T (dg, du): one axpy per row of W13 */
    for (int r = 0; r < 2 * I; r++) {
        const float *row = load_row(j, j->w13, j->s13, j->m13, e, r, 2 * I, H, buf);
        axpy_block(row, dxs, n, H, gu + r, 2 * I);
    }
    free(gu);
}

typedef struct {
    int H, K;
    const float *dxp;
    float *dx;
} rjob_t;

static void reduce_task(void *ctx, int t) {
    const rjob_t *r = (const rjob_t *)ctx;
    float *out = r->dx + (size_t)t * r->H;
    const float *src = r->dxp + (size_t)t * r->K * r->H;
    memcpy(out, src, sizeof(float) * r->H);
    for (int k = 1; k < r->K; k++)
        for (int c = 0; c < r->H; c++) out[c] += src[(size_t)k * r->H + c];
}

/* ids [T, K] int64, tw [T, K], x and gout [T, H] fp32. Writes dx [T, H] and dw [T, K].
 * Returns 0, -1 when out of memory, -2 when an id is outside [0, E). H and I must be
 * multiples of 8 (and of G for fmt 4). */
int hetserve_moe_backward(int fmt, int nthreads, int E, int H, int I, int G, int T, int K,
                          const int64_t *ids, const float *tw, const float *x, const float *gout,
                          const void *w13, const float *s13, const float *m13, const void *w2,
                          const float *s2, const float *m2, float *dx, float *dw) {
    const int P = T * K;
    int *cnt = calloc((size_t)E + 1, sizeof(int));
    int *pairs = malloc(sizeof(int) * (P > 0 ? P : 1));
    int max_items = P / PB + E + 1;
    int *items = malloc(sizeof(int) * 3 * max_items);
    float *dxp = malloc(sizeof(float) * ((size_t)P * H + 1));
    int rc = 0;
    if (!cnt || !pairs || !items || !dxp) { rc = -1; goto done; }
    for (int p = 0; p < P; p++) {
        if (ids[p] < 0 || ids[p] >= E) { rc = -2; goto done; }
        cnt[ids[p] + 1]++;
    }
    for (int e = 0; e < E; e++) cnt[e + 1] += cnt[e];
    int *fill = malloc(sizeof(int) * (E > 0 ? E : 1));
    if (!fill) { rc = -1; goto done; }
    memcpy(fill, cnt, sizeof(int) * E);
    for (int p = 0; p < P; p++) pairs[fill[ids[p]]++] = p;
    free(fill);
    int n_items = 0;
    for (int e = 0; e < E; e++)
        for (int s = cnt[e]; s < cnt[e + 1]; s += PB) {
            items[n_items] = e;
            items[max_items + n_items] = s;
            items[2 * max_items + n_items] = cnt[e + 1] - s < PB ? cnt[e + 1] - s : PB;
            n_items++;
        }
    int failed = 0;
    bjob_t job = {fmt, H, I, G, K, x, gout, tw, w13, w2, s13, m13, s2, m2, pairs,
                  items, items + max_items, items + 2 * max_items, dxp, dw, &failed};
    hs_parallel_for(nthreads, n_items, block_task, &job);
    if (failed) { rc = -1; goto done; }
    rjob_t red = {H, K, dxp, dx};
    hs_parallel_for(nthreads, T, reduce_task, &red);
done:
    free(cnt);
    free(pairs);
    free(items);
    free(dxp);
    return rc;
}
