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
 * Weight formats (fmt), in the plain row-major layout [E, rows, cols] but 9:
 *   32: fp32 (the model's own tensors);
 *    8: int8 with one fp32 scale per row: w_hat = q * s[row];
 *    9: the same numbers in the cpu-int8 forward backend's own layout (moe/cpu_native.py,
 *       shared, not copied): rows in quads, each quad's 4 rows 16 columns at a time back to
 *       back ([E, rows/4, cols/16, 4, 16]); W13's gate and up rows paired in units of 4
 *       (gate 0-3, up 0-3, gate 4-7, ...), its scales in that paired order; cols % 16 == 0;
 *    4: int4 (two per byte, low nibble first) with fp32 scale and minimum per group of G
 *       columns: w_hat = q * s + m.
 * A quantized row is dequantized once into fp32 and then meets every pair of a block of up
 * to PB pairs of the same expert, so the unpacking is amortised. fp32 weights take blocks of
 * up to PB32 pairs through register-tiled products instead: gate/up by the forward's 4-row x
 * 3-pair microkernel (quad_f32), and the two transposed products (W2^T g, W13^T dgu) as packed
 * column strips of 16 against 6 pairs held in registers over a tile of rows (no store per
 * product, as an axpy has). Work items are (expert, block) pairs, independent of each
 * other: each writes its own pairs' rows of dxp.
 * Built by hetserve/native/__init__.py with the other kernels (no torch headers).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe_quads.h"
#include "pool.h"
#include "simd.h"

#define PB 8    /* pairs per block: 8 accumulators + 1 row + 1 input fit the 16 ymm registers */
#define PB32 24 /* pairs per block for fp32 weights: weights streamed once per 24 pairs */
#define TROWS 256 /* rows per tile of the transposed products (16 columns x 256 rows: 16 KiB) */

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

/* Row r of expert e's quantized matrix [rows, cols] (fmt 8, 9 or 4), dequantized into `buf`
 * (fp32 weights take block_f32 instead). */
static const float *load_row(const bjob_t *j, const void *w, const float *s, const float *m,
                             int e, int r, int rows, int cols, float *buf) {
    size_t row = (size_t)e * rows + r;
    if (j->fmt == 9) {
        int p = r; /* the row's place in the layout: W13's gate/up pairing */
        if (w == j->w13) {
            const int up = r >= j->I, k = up ? r - j->I : r;
            p = 8 * (k / 4) + 4 * up + k % 4;
        }
        const int8_t *quad = (const int8_t *)w + ((size_t)e * rows + (p & ~3)) * cols;
        const __m256 sc = _mm256_set1_ps(s[(size_t)e * rows + p]);
        for (int c = 0; c < cols; c += 16) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(quad + 4 * c + 16 * (p & 3)));
            const __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
            const __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
            _mm256_storeu_ps(buf + c, _mm256_mul_ps(v0, sc));
            _mm256_storeu_ps(buf + c + 8, _mm256_mul_ps(v1, sc));
        }
        return buf;
    }
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

/* One strip against NB <= 6 pairs: out_m[c, c + 16) (+)= sum_r S[r] * coef_m[r0 + r], S the
 * strip packed [nrows][16] (two vectors) or [nrows][8]. NB is a constant at each call (the
 * accumulators must stay in registers). */
static inline __attribute__((always_inline)) void tstrip(const float *S, int nrows, int two,
                                                         const float *const coef[], int r0,
                                                         int NB, float *const out[], int c) {
    __m256 acc[6][2];
    for (int m = 0; m < NB; m++) {
        acc[m][0] = r0 ? _mm256_loadu_ps(out[m] + c) : _mm256_setzero_ps();
        acc[m][1] = r0 && two ? _mm256_loadu_ps(out[m] + c + 8) : _mm256_setzero_ps();
    }
    if (two) {
        for (int r = 0; r < nrows; r++) {
            const __m256 w0 = _mm256_load_ps(S + 16 * r), w1 = _mm256_load_ps(S + 16 * r + 8);
            for (int m = 0; m < NB; m++) {
                const __m256 g = _mm256_broadcast_ss(coef[m] + r0 + r);
                acc[m][0] = _mm256_fmadd_ps(w0, g, acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(w1, g, acc[m][1]);
            }
        }
    } else {
        for (int r = 0; r < nrows; r++) {
            const __m256 w0 = _mm256_load_ps(S + 8 * r);
            for (int m = 0; m < NB; m++)
                acc[m][0] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(coef[m] + r0 + r), acc[m][0]);
        }
    }
    for (int m = 0; m < NB; m++) {
        _mm256_storeu_ps(out[m] + c, acc[m][0]);
        if (two) _mm256_storeu_ps(out[m] + c + 8, acc[m][1]);
    }
}

/* out_i[c] = sum_r W[r, c] * coef_i[r] for i < n (any n), W [rows, cols] row-major, cols % 8
 * == 0: strips of 16 (or 8) columns over tiles of TROWS rows, each packed into a contiguous
 * buffer first (read in place, a strip's rows sit a power-of-two stride apart and fall into
 * the same few L1 sets), then met by the pairs 6 at a time in registers; partial sums of the
 * tiles go through out. */
static void tmatvec(const float *W, int rows, int cols, const float *const coef[], int n,
                    float *const out[]) {
    float S[TROWS * 16] __attribute__((aligned(32)));
    for (int c = 0; c < cols; c += 16) {
        const int two = cols - c >= 16, width = two ? 16 : 8;
        for (int r0 = 0; r0 < rows; r0 += TROWS) {
            const int nrows = (r0 + TROWS < rows ? r0 + TROWS : rows) - r0;
            for (int r = 0; r < nrows; r++) {
                const float *src = W + (size_t)(r0 + r) * cols + c;
                _mm256_store_ps(S + width * r, _mm256_loadu_ps(src));
                if (two) _mm256_store_ps(S + width * r + 8, _mm256_loadu_ps(src + 8));
            }
            int i0 = 0;
            for (; i0 + 6 <= n; i0 += 6) tstrip(S, nrows, two, coef + i0, r0, 6, out + i0, c);
            switch (n - i0) {
            case 5: tstrip(S, nrows, two, coef + i0, r0, 5, out + i0, c); break;
            case 4: tstrip(S, nrows, two, coef + i0, r0, 4, out + i0, c); break;
            case 3: tstrip(S, nrows, two, coef + i0, r0, 3, out + i0, c); break;
            case 2: tstrip(S, nrows, two, coef + i0, r0, 2, out + i0, c); break;
            case 1: tstrip(S, nrows, two, coef + i0, r0, 1, out + i0, c); break;
            default: break;
            }
        }
    }
}

/* Through silu(g) * u for pair i: g, u [I] become dg, du in place; returns dw = d . (silu(g)
 * u). 8 lanes with hs_exp (about 2 ulp); scalar expf was a third of the backward. */
static float silu_mul_backward(float *g, float *u, const float *d, float w, int I) {
    const __m256 one = _mm256_set1_ps(1.0f), wv = _mm256_set1_ps(w);
    __m256 dw = _mm256_setzero_ps();
    for (int c = 0; c < I; c += 8) {
        const __m256 gv = _mm256_loadu_ps(g + c), uv = _mm256_loadu_ps(u + c);
        const __m256 dc = _mm256_loadu_ps(d + c);
        const __m256 e = hs_exp(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 sg = _mm256_div_ps(one, _mm256_add_ps(one, e));
        const __m256 sv = _mm256_mul_ps(gv, sg);
        dw = _mm256_fmadd_ps(_mm256_mul_ps(dc, sv), uv, dw);
        const __m256 dh = _mm256_mul_ps(wv, dc);
        /* silu'(g) = sg * (1 + g * (1 - sg)) */
        const __m256 dsilu = _mm256_mul_ps(sg, _mm256_fmadd_ps(gv, _mm256_sub_ps(one, sg), one));
        _mm256_storeu_ps(g + c, _mm256_mul_ps(_mm256_mul_ps(dh, uv), dsilu));
        _mm256_storeu_ps(u + c, _mm256_mul_ps(dh, sv));
    }
    return hs_hsum(dw);
}

/* The fp32 block: n <= PB32 pairs of expert e; scratch gu [PB32, 2I], d [PB32, I]. */
static void block_f32(const bjob_t *j, int e, int n, const int *pairs, float *gu, float *d) {
    const int H = j->H, I = j->I, K = j->K;
    const float *w13 = (const float *)j->w13 + (size_t)e * 2 * I * H;
    const float *w2 = (const float *)j->w2 + (size_t)e * H * I;
    const float *xs[PB32], *go[PB32], *dgu[PB32];
    float *ds[PB32], *dxs[PB32];
    for (int i = 0; i < n; i++) {
        const int t = pairs[i] / K;
        xs[i] = j->x + (size_t)t * H;
        go[i] = j->gout + (size_t)t * H;
        ds[i] = d + (size_t)i * I;
        dgu[i] = gu + (size_t)i * 2 * I;
        dxs[i] = j->dxp + (size_t)pairs[i] * H;
    }
    /* recompute gate and up: gu[i, r] = W13[r] . x_i */
    for (int r = 0; r < 2 * I; r += 4)
        for (int i = 0; i < n; i += F32_MB) {
            const int mb = n - i < F32_MB ? n - i : F32_MB;
            float o[4][MBMAX];
            const float *w = w13 + (size_t)r * H;
            if (mb == 3) /* constant token counts keep the accumulators in registers */
                quad_f32(w, H, xs + i, 3, o);
            else if (mb == 2)
                quad_f32(w, H, xs + i, 2, o);
            else
                quad_f32(w, H, xs + i, 1, o);
            for (int rr = 0; rr < 4; rr++)
                for (int m = 0; m < mb; m++) gu[(size_t)(i + m) * 2 * I + r + rr] = o[rr][m];
        }
    tmatvec(w2, H, I, go, n, ds); /* d_i = W2^T grad_out_i */
    for (int i = 0; i < n; i++)
        j->dw[pairs[i]] = silu_mul_backward(gu + (size_t)i * 2 * I, gu + (size_t)i * 2 * I + I,
                                            ds[i], j->tw[pairs[i]], I);
    tmatvec(w13, 2 * I, H, dgu, n, dxs); /* dx_p = W13^T (dg, du) */
}


static void block_task(void *ctx, int item) {
    const bjob_t *j = (const bjob_t *)ctx;
    const int H = j->H, I = j->I, K = j->K;
    const int e = j->item_e[item], n = j->item_n[item];
    const int *pairs = j->pairs + j->item_start[item];
    /* scratch: gu [pb, 2I], d [pb, I] and (quantized formats) one dequantized row */
    const int f32 = j->fmt == 32, pb = f32 ? PB32 : PB;
    float *gu = malloc(sizeof(float) * ((size_t)pb * 3 * I + (f32 ? 0 : (H > 2 * I ? H : 2 * I))));
    if (gu == NULL) {
        __atomic_store_n(j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    if (f32) {
        block_f32(j, e, n, pairs, gu, gu + (size_t)PB32 * 2 * I);
        free(gu);
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
    for (int i = 0; i < n; i++)
        j->dw[pairs[i]] = silu_mul_backward(gu + (size_t)i * 2 * I, gu + (size_t)i * 2 * I + I,
                                            ds[i], j->tw[pairs[i]], I);
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
 * multiples of 8 (of 16 for fmt 9, and of G for fmt 4). */
int hetserve_moe_backward(int fmt, int nthreads, int E, int H, int I, int G, int T, int K,
                          const int64_t *ids, const float *tw, const float *x, const float *gout,
                          const void *w13, const float *s13, const float *m13, const void *w2,
                          const float *s2, const float *m2, float *dx, float *dw) {
    const int P = T * K;
    int *cnt = calloc((size_t)E + 1, sizeof(int));
    int *pairs = malloc(sizeof(int) * (P > 0 ? P : 1));
    const int pb = fmt == 32 ? PB32 : PB;
    int max_items = P / pb + E + 1;
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
        for (int s = cnt[e]; s < cnt[e + 1]; s += pb) {
            items[n_items] = e;
            items[max_items + n_items] = s;
            items[2 * max_items + n_items] = cnt[e + 1] - s < pb ? cnt[e + 1] - s : pb;
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
