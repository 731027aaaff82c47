/* Paged decode attention over fp32, fp16 or int8 caches on AVX2 + FMA (+ F16C) CPUs
 * (hetserve.layers.attention). An fp16 cache (`--kv-cache-dtype float16`) is widened in
 * registers as it is read: half the bytes stream from memory, the arithmetic stays fp32.
 * An int8 cache (`--kv-cache-dtype int8`) is widened the same way, and its per-token, per-KV-head
 * scales are applied outside the dot products: K's to each score, V's to each weight
 * (p[h, j] * vscale[j]), so the inner loops only convert and multiply-add.
 *
 * One query token per sequence; its context is read straight from the paged cache, with no
 * gather into a padded copy:
 *   out[b, h] = sum_j p[b, h, j] * V[slot(b, j), h / G],
 *   p[b, h, :] = softmax_j(scale * q[b, h] . K[slot(b, j), h / G]),   j in [lo_b, len_b)
 * where slot(b, j) = table[b, j / bs] * bs + j % bs and, with a sliding window W,
 * lo_b = max(0, len_b - W) (else 0). With attention sinks (gpt-oss), head h's softmax has one
 * more logit, sinks[h], in its denominator only. A work item is a sequence (or, with few sequences, a
 * chunk of its KV heads); the G query heads of a group share every K and V row read, and an
 * item makes two passes over its context (scores, then the weighted sum of V). exp is a
 * vectorized polynomial (simd.h, about 2 ulp).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "simd.h"

#define V_TILE 32 /* tokens per tile of the weighted sum of V */

typedef struct {
    int H, Hkv, D, Dv, bs, W, window, num_blocks;
    int chunks; /* KV-head chunks per sequence: one work item each */
    float scale;
    const float *sinks; /* [H] or NULL */
    const float *q;
    const void *k, *v; /* float, uint16_t fp16 bits (item_f16) or int8_t (item_i8) */
    const float *ks, *vs; /* int8: scales [num_blocks * bs, Hkv] of K and V; else NULL */
    const int64_t *tables, *lens;
    float *out;
    int err;
} attn_t;

/* a . cache[off, off + n) */
static inline __attribute__((always_inline)) float dot(const float *a, const void *b, size_t off,
                                                       int n, const int half) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), hs_ld8(b, off + i, half), acc);
    float s = hs_hsum(acc);
    for (; i < n; i++) s += a[i] * hs_ld1(b, off + i, half);
    return s;
}

/* Turns s[0..n) into unnormalised probabilities in place; returns their sum (plus e^(sink - max)
 * when a sink logit is given, sink_on != 0). */
static float softmax_row(float *s, int n, int sink_on, float sink) {
    float mx = sink_on ? sink : s[0];
    for (int i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = hs_exp(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hs_hsum(acc);
    if (sink_on) {
        float t[8] = {sink - mx, -100.0f, -100.0f, -100.0f, -100.0f, -100.0f, -100.0f, -100.0f};
        _mm256_storeu_ps(t, hs_exp(_mm256_loadu_ps(t)));
        sum += t[0];
    }
    if (i < n) { /* the tail through the same polynomial, padded with -inf-like values */
        float t[8];
        for (int k = 0; k < 8; k++) t[k] = i + k < n ? s[i + k] - mx : -100.0f;
        __m256 e = hs_exp(_mm256_loadu_ps(t));
        _mm256_storeu_ps(t, e);
        for (int k = 0; i + k < n; k++) {
            s[i + k] = t[k];
            sum += t[k];
        }
    }
    return sum;
}

/* Prefetches the cache rows of tokens [j, j + count) (heads [h0, h1)). */
static inline void prefetch_rows(const void *base, size_t esz, const int64_t *table, int bs, int j,
                                 int count, int Hkv, int h0, int h1, int D) {
    for (int t = j; t < j + count; t++) {
        const char *row =
            (const char *)base + (((size_t)table[t / bs] * bs + t % bs) * Hkv + h0) * D * esz;
        for (size_t off = 0; off < esz * (size_t)(h1 - h0) * D; off += 64)
            _mm_prefetch(row + off, _MM_HINT_T0);
    }
}

/* Adds tokens [j0, j1) of the weighted sum of V to columns [d0, d0 + 8 * NV) of heads
 * [hb, hb + HN) (at most 4 and 4), accumulating in registers (the constant arguments let the
 * loops unroll); vrow[j]: offset of token j's V row (first head of the item). */
static inline __attribute__((always_inline)) void v_block(
    const attn_t *a, const size_t *vrow, const float *s, int n, int j0, int j1, int hb, int G,
    int d0, float *out, const int HN, const int NV, const int half) {
    const int Dv = a->Dv;
    __m256 acc[4][4];
    for (int i = 0; i < HN; i++)
        for (int u = 0; u < NV; u++) acc[i][u] = _mm256_loadu_ps(out + (size_t)(hb + i) * Dv + d0 + 8 * u);
    for (int j = j0; j < j1; j++) {
        const size_t vr = vrow[j] + d0;
        for (int i = 0; i < HN; i++) {
            const size_t vh = vr + (size_t)((hb + i) / G) * Dv;
            const __m256 w = _mm256_broadcast_ss(s + (size_t)(hb + i) * n + j);
            for (int u = 0; u < NV; u++)
                acc[i][u] = _mm256_fmadd_ps(w, hs_ld8(a->v, vh + 8 * u, half), acc[i][u]);
        }
    }
    for (int i = 0; i < HN; i++)
        for (int u = 0; u < NV; u++)
            _mm256_storeu_ps(out + (size_t)(hb + i) * Dv + d0 + 8 * u, acc[i][u]);
}

static inline __attribute__((always_inline)) void item_impl(void *ctx, int it, const int half) {
    attn_t *a = (attn_t *)ctx;
    const int G = a->H / a->Hkv, D = a->D, Dv = a->Dv, Hkv = a->Hkv;
    const int b = it / a->chunks, c = it % a->chunks;
    const int h0 = c * Hkv / a->chunks, h1 = (c + 1) * Hkv / a->chunks, nh = (h1 - h0) * G;
    const int len = (int)a->lens[b];
    const int lo = a->window > 0 && len > a->window ? len - a->window : 0;
    const int n = len - lo;
    float *out = a->out + ((size_t)b * a->H + (size_t)h0 * G) * Dv;
    memset(out, 0, sizeof(float) * (size_t)nh * Dv);
    if (n <= 0 || nh == 0) return;
    /* s[head][j]: scores, then weights; vrow[j]: where token j's V row (head h0) starts */
    const size_t ns = ((size_t)nh * n + 1) & ~(size_t)1; /* vrow 8-byte aligned after s */
    float *s = malloc(sizeof(float) * ns + sizeof(size_t) * n);
    if (s == NULL) {
        __atomic_store_n(&a->err, -1, __ATOMIC_RELAXED);
        return;
    }
    const int64_t *table = a->tables + (size_t)b * a->W;
    for (int i = lo / a->bs; i <= (len - 1) / a->bs; i++) {
        int64_t blk = table[i];
        if (blk < 0 || blk >= a->num_blocks) {
            __atomic_store_n(&a->err, -2, __ATOMIC_RELAXED);
            free(s);
            return;
        }
    }
    const float *q = a->q + ((size_t)b * a->H + (size_t)h0 * G) * D;
    const size_t esz = half == 2 ? 1 : half ? sizeof(uint16_t) : sizeof(float);
    const int pf = (size_t)(h1 - h0) * (D > Dv ? D : Dv) * esz <= 1024;
    /* Token-major passes: a token's K (then V) rows of all heads are contiguous in the cache,
     * and a block's tokens are too, so each pass streams whole cache lines in order. */
    int j = lo;
    if (D % 8 == 0) /* 8 tokens at a time: their 8 dots per head reduced together */
        for (; j + 8 <= len; j += 8) {
            size_t kr[8]; /* element offsets of the 8 tokens' K rows (head h0) */
            for (int t = 0; t < 8; t++) {
                size_t slot = (size_t)table[(j + t) / a->bs] * a->bs + (j + t) % a->bs;
                kr[t] = (slot * Hkv + h0) * D;
            }
            /* Blocks are scattered: fetch one block ahead where rows are short (long rows
             * make long in-block streams the hardware prefetcher already follows). */
            if (pf && j + 8 + a->bs < len)
                prefetch_rows(a->k, esz, table, a->bs, j + a->bs, 8, Hkv, h0, h1, D);
            for (int h = 0; h < nh; h++) {
                const float *qh = q + (size_t)h * D;
                const size_t kh = (size_t)(h / G) * D;
                __m256 acc[8];
                for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
                for (int d = 0; d < D; d += 8) {
                    __m256 qv = _mm256_loadu_ps(qh + d);
                    for (int t = 0; t < 8; t++)
                        acc[t] = _mm256_fmadd_ps(qv, hs_ld8(a->k, kr[t] + kh + d, half), acc[t]);
                }
                _mm256_storeu_ps(s + (size_t)h * n + (j - lo),
                                 _mm256_mul_ps(hs_hsum8(acc), _mm256_set1_ps(a->scale)));
            }
        }
    for (; j < len; j++) {
        size_t slot = (size_t)table[j / a->bs] * a->bs + j % a->bs;
        const size_t kr = (slot * Hkv + h0) * D;
        for (int h = 0; h < nh; h++)
            s[(size_t)h * n + (j - lo)] =
                dot(q + (size_t)h * D, a->k, kr + (size_t)(h / G) * D, D, half) * a->scale;
    }
    size_t *vrow = (size_t *)(s + ns);
    if (half == 2) /* vrow first holds each token's scale row: slot * Hkv + h0 */
        for (int j = lo; j < len; j++) {
            vrow[j - lo] = ((size_t)table[j / a->bs] * a->bs + j % a->bs) * Hkv + h0;
            for (int h = 0; h < nh; h++) s[(size_t)h * n + (j - lo)] *= a->ks[vrow[j - lo] + h / G];
        }
    for (int h = 0; h < nh; h++) {
        float *p = s + (size_t)h * n;
        const float sink = a->sinks ? a->sinks[h0 * G + h] : 0.0f;
        float inv = 1.0f / softmax_row(p, n, a->sinks != NULL, sink);
        if (half == 2)
            for (int j = 0; j < n; j++) p[j] *= inv * a->vs[vrow[j] + h / G];
        else
            for (int j = 0; j < n; j++) p[j] *= inv;
    }
    for (int j = lo; j < len; j++)
        vrow[j - lo] = (((size_t)table[j / a->bs] * a->bs + j % a->bs) * Hkv + h0) * Dv;
    /* out[h] = sum_j p[h, j] V[j] (out is zeroed above), in tiles of V_TILE tokens whose rows
     * stay in L1/L2 while every head block and column chunk passes over them: up to 4 heads x
     * 32 columns accumulate in registers, one load per FMA. */
    for (int j0 = 0; j0 < n; j0 += V_TILE) {
        const int j1 = j0 + V_TILE < n ? j0 + V_TILE : n;
        for (int hb = 0; hb < nh; hb += 4) {
            const int hn = nh - hb < 4 ? nh - hb : 4;
            int d0 = 0;
            for (; d0 + 32 <= Dv; d0 += 32) {
                if (hn == 4)
                    v_block(a, vrow, s, n, j0, j1, hb, G, d0, out, 4, 4, half);
                else
                    v_block(a, vrow, s, n, j0, j1, hb, G, d0, out, hn, 4, half);
            }
            for (; d0 + 8 <= Dv; d0 += 8) v_block(a, vrow, s, n, j0, j1, hb, G, d0, out, hn, 1, half);
            for (; d0 < Dv; d0++)
                for (int i = 0; i < hn; i++) {
                    float acc = out[(size_t)(hb + i) * Dv + d0];
                    for (int j = j0; j < j1; j++)
                        acc += s[(size_t)(hb + i) * n + j] * hs_ld1(a->v, vrow[j] + (hb + i) / G * Dv + d0, half);
                    out[(size_t)(hb + i) * Dv + d0] = acc;
                }
        }
    }
    free(s);
}

/* One specialised copy per cache element type (the constant folds every ld8/ld1 branch). */
static void item_f32(void *ctx, int it) { item_impl(ctx, it, 0); }
static void item_f16(void *ctx, int it) { item_impl(ctx, it, 1); }
static void item_i8(void *ctx, int it) { item_impl(ctx, it, 2); }

static int run(int nthreads, int B, int H, int Hkv, int D, int Dv, int bs, int W, int window,
               int num_blocks, float scale, const float *sinks, const float *q, const void *k,
               const void *v, const int64_t *tables, const int64_t *lens, float *out,
               const float *ks, const float *vs, int half) {
    if (Hkv <= 0 || H % Hkv != 0) return -3;
    /* Whole sequences per item when there are plenty; else split the KV heads too. */
    int chunks = B >= 4 * nthreads ? 1 : Hkv;
    attn_t a = {H, Hkv, D, Dv, bs, W, window, num_blocks, chunks, scale, sinks, q, k, v, ks, vs,
                tables, lens, out, 0};
    hs_parallel_for(nthreads, B * chunks, half == 2 ? item_i8 : half ? item_f16 : item_f32, &a);
    return a.err;
}

/* q [B, H, D]; k [num_blocks * bs, Hkv, D]; v [num_blocks * bs, Hkv, Dv]; tables [B, W];
 * lens [B] (context length including the query token); out [B, H, Dv]. window <= 0: none.
 * sinks [H] or NULL.
 * Returns 0, -1 when out of memory, -2 when a table entry is outside [0, num_blocks). */
int hetserve_paged_decode_attention(int nthreads, int B, int H, int Hkv, int D, int Dv, int bs,
                                    int W, int window, int num_blocks, float scale,
                                    const float *sinks, const float *q, const float *k, const float *v,
                                    const int64_t *tables, const int64_t *lens, float *out) {
    return run(nthreads, B, H, Hkv, D, Dv, bs, W, window, num_blocks, scale, sinks, q, k, v, tables,
               lens, out, NULL, NULL, 0);
}

/* The same over an fp16 cache: k, v hold IEEE half bits. */
int hetserve_paged_decode_attention_f16(int nthreads, int B, int H, int Hkv, int D, int Dv, int bs,
                                        int W, int window, int num_blocks, float scale,
                                        const float *sinks, const float *q, const uint16_t *k,
                                        const uint16_t *v, const int64_t *tables,
                                        const int64_t *lens, float *out) {
    return run(nthreads, B, H, Hkv, D, Dv, bs, W, window, num_blocks, scale, sinks, q, k, v, tables,
               lens, out, NULL, NULL, 1);
}

/* The same over an int8 cache: k, v hold int8 rows, ks [num_blocks * bs, Hkv] and vs their
 * scales (a cache element is row[i] * scale). */
int hetserve_paged_decode_attention_i8(int nthreads, int B, int H, int Hkv, int D, int Dv, int bs,
                                       int W, int window, int num_blocks, float scale,
                                       const float *sinks, const float *q, const int8_t *k,
                                       const int8_t *v, const int64_t *tables,
                                       const int64_t *lens, float *out, const float *ks,
                                       const float *vs) {
    return run(nthreads, B, H, Hkv, D, Dv, bs, W, window, num_blocks, scale, sinks, q, k, v, tables,
               lens, out, ks, vs, 2);
}
