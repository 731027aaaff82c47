/* Small per-layer kernels over fp32 rows (hetserve.layers.norm, .rotary, .attention and
 * hetserve.moe.router): RMSNorm, rotary embedding, the router's logits and softmax top-k
 * routing, and the head of a GQA attention layer (q/k norm + rotary + KV cache write).
 *
 * RMSNorm: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w.
 * torch runs it as a composite of five to six kernels (pow, mean, add, rsqrt, mul, mul), each
 * with its own dispatch and output allocation; inside the engine that cost ~100+ us per norm of
 * a 64-token decode batch, and a decoding layer has up to four norms. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pool.h"
#include "simd.h"

typedef struct {
    int dim, rows_per_item, rows;
    float eps;
    const float *x, *w;
    float *out;
} norm_t;

/* One row: o = x / sqrt(mean(x^2) + eps) * w (o may alias x). */
static inline void norm_row(const float *x, const float *w, int dim, float eps, float *o) {
    __m256 acc = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= dim; d += 8) {
        __m256 v = _mm256_loadu_ps(x + d);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hs_hsum(acc);
    for (; d < dim; d++) ss += x[d] * x[d];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    const __m256 vi = _mm256_set1_ps(inv);
    for (d = 0; d + 8 <= dim; d += 8)
        _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + d), vi),
                                              _mm256_loadu_ps(w + d)));
    for (; d < dim; d++) o[d] = x[d] * inv * w[d];
}

static void norm_rows(void *ctx, int it) {
    const norm_t *n = (const norm_t *)ctx;
    const int r0 = it * n->rows_per_item;
    const int r1 = r0 + n->rows_per_item < n->rows ? r0 + n->rows_per_item : n->rows;
    for (int r = r0; r < r1; r++)
        norm_row(n->x + (size_t)r * n->dim, n->w, n->dim, n->eps, n->out + (size_t)r * n->dim);
}

/* x, out [rows, dim] (out may alias x); w [dim]. Items of ~64 KiB of rows: small inputs stay
 * on the calling thread. */
void hetserve_rms_norm(int nthreads, int rows, int dim, float eps, const float *x,
                       const float *w, float *out) {
    int per = (64 << 10) / (dim * 4);
    per = per < 1 ? 1 : per;
    norm_t n = {dim, per, rows, eps, x, w, out};
    hs_parallel_for(nthreads, (rows + per - 1) / per, norm_rows, &n);
}

/* ---- rotary embedding ----------------------------------------------------------------------
 * x [T, heads, 2 * half] -> out (same shape, no aliasing) with, per token t and head,
 *   out[:half] = x1 * cos[t] - x2 * sin[t],  out[half:] = x2 * cos[t] + x1 * sin[t]
 * where (x1, x2) are the two halves of the head, or with `interleaved` its even and odd
 * elements (DeepSeek; the output is then de-interleaved, as hetserve's rotary.py does). cos and
 * sin [T, half] are the angles already looked up at each token's position. */
typedef struct {
    int T, heads, half, interleaved, tokens_per_item;
    const float *x, *cos, *sin;
    float *out;
} rope_t;

/* One head of 2 * half values: x -> o (no aliasing). */
static inline void rope_head(const float *x, const float *c, const float *s, int half,
                             int interleaved, float *o) {
    if (interleaved) {
        for (int i = 0; i < half; i++) {
            float a = x[2 * i], b = x[2 * i + 1];
            o[i] = a * c[i] - b * s[i];
            o[half + i] = b * c[i] + a * s[i];
        }
        return;
    }
    int i = 0;
    for (; i + 8 <= half; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
        __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
        _mm256_storeu_ps(o + i, _mm256_fmsub_ps(a, cv, _mm256_mul_ps(b, sv)));
        _mm256_storeu_ps(o + half + i, _mm256_fmadd_ps(b, cv, _mm256_mul_ps(a, sv)));
    }
    for (; i < half; i++) {
        float a = x[i], b = x[half + i];
        o[i] = a * c[i] - b * s[i];
        o[half + i] = b * c[i] + a * s[i];
    }
}

static void rope_rows(void *ctx, int it) {
    const rope_t *r = (const rope_t *)ctx;
    const int t0 = it * r->tokens_per_item;
    const int t1 = t0 + r->tokens_per_item < r->T ? t0 + r->tokens_per_item : r->T;
    const int half = r->half, dim = 2 * half;
    for (int t = t0; t < t1; t++) {
        const float *c = r->cos + (size_t)t * half, *s = r->sin + (size_t)t * half;
        for (int h = 0; h < r->heads; h++) {
            size_t off = ((size_t)t * r->heads + h) * dim;
            rope_head(r->x + off, c, s, half, r->interleaved, r->out + off);
        }
    }
}

void hetserve_rope(int nthreads, int T, int heads, int half, int interleaved, const float *x,
                   const float *cos, const float *sin, float *out) {
    int per = (64 << 10) / (heads * half * 8);
    per = per < 1 ? 1 : per;
    rope_t r = {T, heads, half, interleaved, per, x, cos, sin, out};
    hs_parallel_for(nthreads, (T + per - 1) / per, rope_rows, &r);
}

/* ---- MoE routing: softmax over E experts, top-k, optional renormalisation -------------------
 * w[t, j] = softmax(logits[t])[ids[t, j]] for the k largest (ties: lower expert id first),
 * then, with `renorm`, divided by their sum (+1e-20, like the reference), times `scale`.
 * ids come out in descending weight order. */
typedef struct {
    int T, E, k, renorm;
    float scale;
    const float *logits;
    float *w;
    int64_t *ids;
} route_t;

#define ROUTE_TOKENS 64 /* tokens per work item */

static void route_rows(void *ctx, int item) {
    const route_t *r = (const route_t *)ctx;
    const int E = r->E, k = r->k;
    const int t1 = (item + 1) * ROUTE_TOKENS < r->T ? (item + 1) * ROUTE_TOKENS : r->T;
    for (int t = item * ROUTE_TOKENS; t < t1; t++) {
        const float *l = r->logits + (size_t)t * E;
        float mx = l[0];
        for (int e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        float sum = 0.0f;
        for (int e = 0; e < E; e++) sum += expf(l[e] - mx);
        float *wt = r->w + (size_t)t * k;
        int64_t *it = r->ids + (size_t)t * k;
        int n = 0; /* insertion into a sorted top-k list: E and k are small */
        for (int e = 0; e < E; e++) {
            float v = l[e];
            if (n == k && v <= l[it[k - 1]]) continue;
            int pos = n < k ? n++ : k - 1;
            while (pos > 0 && l[it[pos - 1]] < v) {
                it[pos] = it[pos - 1];
                pos--;
            }
            it[pos] = e;
        }
        float tot = 0.0f;
        for (int j = 0; j < k; j++) {
            wt[j] = expf(l[it[j]] - mx) / sum;
            tot += wt[j];
        }
        float f = r->renorm ? r->scale / (tot + 1e-20f) : r->scale;
        for (int j = 0; j < k; j++) wt[j] *= f;
    }
}

void hetserve_topk_softmax(int nthreads, int T, int E, int k, int renorm, float scale,
                           const float *logits, float *w, int64_t *ids) {
    route_t r = {T, E, k, renorm, scale, logits, w, ids};
    hs_parallel_for(nthreads, (T + ROUTE_TOKENS - 1) / ROUTE_TOKENS, route_rows, &r);
}

/* ---- the router's logits at decode: out [T, E] = x [T, H] . W [E, H]^T, fp32 ------------------
 * Each dot product is summed in one fixed order (two 8-lane accumulators over 16-column steps,
 * then the tail), whatever T, the blocking and the thread count: the fused decode step and the
 * router module get the same bits. Blocks of LG_E router rows x LG_T tokens share their loads
 * (a row and a token's 8 columns: one load each per block), each half of a 16-column step in
 * turn so the accumulators and the loads fit the registers (AVX2: 12 + 2 + 1 of 16; AVX-512 29
 * of 32). One row against 4 tokens at a time loaded 10 vectors per 8 multiply-adds and took
 * ~200 us of a 32-token decode layer (64 x 2048 rows, 2 threads; the tokens from L2). */
#ifdef HS_AVX512
#define LG_E 4
#else
#define LG_E 2
#endif
#define LG_T 3
typedef struct {
    int T, E, H, per;
    const float *x, *w;
    float *out;
} logits_t;

/* Rows [e0, e0 + ne) against tokens [t0, t0 + nt), ne <= LG_E, nt <= LG_T (constants inlined). */
static inline __attribute__((always_inline)) void logits_block(const logits_t *g, int e0, int ne,
                                                              int t0, int nt) {
    const int H = g->H;
    const float *w = g->w + (size_t)e0 * H, *x = g->x + (size_t)t0 * H;
    __m256 a0[LG_E][LG_T], a1[LG_E][LG_T];
    for (int i = 0; i < ne; i++)
        for (int m = 0; m < nt; m++) a0[i][m] = a1[i][m] = _mm256_setzero_ps();
    int h = 0;
    for (; h + 16 <= H; h += 16) {
        __m256 wv[LG_E];
        for (int i = 0; i < ne; i++) wv[i] = _mm256_loadu_ps(w + (size_t)i * H + h);
        for (int m = 0; m < nt; m++) {
            const __m256 xv = _mm256_loadu_ps(x + (size_t)m * H + h);
            for (int i = 0; i < ne; i++) a0[i][m] = _mm256_fmadd_ps(wv[i], xv, a0[i][m]);
        }
        for (int i = 0; i < ne; i++) wv[i] = _mm256_loadu_ps(w + (size_t)i * H + h + 8);
        for (int m = 0; m < nt; m++) {
            const __m256 xv = _mm256_loadu_ps(x + (size_t)m * H + h + 8);
            for (int i = 0; i < ne; i++) a1[i][m] = _mm256_fmadd_ps(wv[i], xv, a1[i][m]);
        }
    }
    for (int i = 0; i < ne; i++)
        for (int m = 0; m < nt; m++) {
            const float *wr = w + (size_t)i * H, *xr = x + (size_t)m * H;
            float s = hs_hsum(_mm256_add_ps(a0[i][m], a1[i][m]));
            for (int j = h; j < H; j++) s += wr[j] * xr[j];
            g->out[(size_t)(t0 + m) * g->E + e0 + i] = s;
        }
}

static void logits_item(void *ctx, int it) {
    const logits_t *g = (const logits_t *)ctx;
    const int e1 = (it + 1) * g->per < g->E ? (it + 1) * g->per : g->E;
    for (int e = it * g->per; e < e1; e += LG_E) {
        const int ne = e1 - e < LG_E ? e1 - e : LG_E;
        for (int t0 = 0; t0 < g->T; t0 += LG_T) {
            const int nt = g->T - t0 < LG_T ? g->T - t0 : LG_T;
            if (ne == LG_E && nt == LG_T) logits_block(g, e, LG_E, t0, LG_T);
            else if (ne == LG_E) logits_block(g, e, LG_E, t0, nt);
            else logits_block(g, e, ne, t0, nt);
        }
    }
}

void hetserve_router_logits(int nthreads, int T, int E, int H, const float *x, const float *w,
                            float *out) {
    int per = (64 << 10) / (H * 4); /* ~64 KiB of router rows per item */
    per = per < 1 ? 1 : per;
    logits_t g = {T, E, H, per, x, w, out};
    hs_parallel_for(nthreads, (E + per - 1) / per, logits_item, &g);
}

/* ---- the head of a GQA attention layer: q/k norm, rotary, KV cache write -------------------
 * Per token t, with D = 2 * half floats per head and row strides sq, sk, sv (in floats; q, k
 * and v may be the three parts of one fused qkv row):
 *   q heads  q[t * sq + h * D]   -> (RMSNorm by qw) -> rotary -> q_out[t, h]
 *   k heads  k[t * sk + h * D]   -> (RMSNorm by kw) -> rotary -> k_cache[slots[t], h]
 *   v heads  v[t * sv + h * D]   ->                             v_cache[slots[t], h]
 * qw / kw NULL: no per-head norm (Qwen3 has one, Llama not). Rotary angles are read from the
 * tables cos / sin [max_pos, half] at positions[t]. One call instead of ~8 torch ops and 4 module
 * calls per layer (at decode the per-op cost dominates this work). Returns 0, or -1 (writing
 * nothing) if a slot is outside [0, num_slots) or a position outside [0, max_pos).
 * hetserve_qk_rope_cache_f16 writes an fp16 cache (--kv-cache-dtype float16): the same rows
 * rounded to nearest-even, as torch's .to(float16) rounds them; hetserve_qk_rope_cache_i8 an
 * int8 cache with one fp32 scale per token and KV head (ks, vs [num_slots, nkv]), rounded as
 * kv/paged.py's quantize_rows rounds (bit for bit). */
typedef struct {
    int T, nq, nkv, half, interleaved, tokens_per_item, kv_half;
    long sq, sk, sv;
    float eps;
    const float *q, *k, *v, *qw, *kw, *cos, *sin;
    const int64_t *positions, *slots;
    float *q_out;
    void *k_cache, *v_cache; /* float, uint16_t fp16 bits (kv_half 1) or int8_t (kv_half 2) */
    float *ks, *vs;          /* kv_half 2: the scales [num_slots, nkv] */
} qkv_t;

/* n floats as int8 at element i of cache, their scale at *scale: inv = 127 / absmax,
 * q = round-half-even(x * inv), scale = absmax / 127 (0 and zeros for an all-zero row), in the
 * same fp32 operations as torch's quantize_rows. */
static void put_row_i8(int8_t *dst, const float *x, int n, float *scale) {
    float amax = 0.0f;
    for (int j = 0; j < n; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *scale = amax / 127.0f;
    int j = 0;
    const __m256 vi = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (; j + 8 <= n; j += 8) {
        __m256 y = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), vi),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i v = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(y, lo), hi));
        __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(dst + j), _mm_packs_epi16(w, w));
    }
    for (; j < n; j++) {
        float y = nearbyintf(x[j] * inv);
        dst[j] = (int8_t)(y > 127.0f ? 127.0f : y < -127.0f ? -127.0f : y);
    }
}

/* n floats into the cache at element i: copied, or rounded to fp16 bits. */
static void put_row(void *cache, size_t i, const float *x, int n, int kv_half) {
    if (!kv_half) {
        memcpy((float *)cache + i, x, sizeof(float) * n);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + i;
    int j = 0;
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
    for (; j < n; j++) dst[j] = _cvtss_sh(x[j], _MM_FROUND_TO_NEAREST_INT);
}

static void qkv_rows(void *ctx, int it) {
    const qkv_t *a = (const qkv_t *)ctx;
    const int t0 = it * a->tokens_per_item;
    const int t1 = t0 + a->tokens_per_item < a->T ? t0 + a->tokens_per_item : a->T;
    const int half = a->half, dim = 2 * half, nkv = a->nkv;
    float tmp[dim], row[dim];
    for (int t = t0; t < t1; t++) {
        const float *c = a->cos + a->positions[t] * half, *s = a->sin + a->positions[t] * half;
        const size_t slot = (size_t)a->slots[t];
        for (int h = 0; h < a->nq; h++) {
            const float *x = a->q + t * a->sq + (size_t)h * dim;
            if (a->qw) norm_row(x, a->qw, dim, a->eps, tmp), x = tmp;
            rope_head(x, c, s, half, a->interleaved, a->q_out + ((size_t)t * a->nq + h) * dim);
        }
        for (int h = 0; h < nkv; h++) {
            const float *x = a->k + t * a->sk + (size_t)h * dim;
            if (a->kw) norm_row(x, a->kw, dim, a->eps, tmp), x = tmp;
            rope_head(x, c, s, half, a->interleaved, row);
            if (a->kv_half == 2)
                put_row_i8((int8_t *)a->k_cache + (slot * nkv + h) * dim, row, dim,
                           a->ks + slot * nkv + h);
            else
                put_row(a->k_cache, (slot * nkv + h) * dim, row, dim, a->kv_half);
        }
        if (a->kv_half == 2)
            for (int h = 0; h < nkv; h++)
                put_row_i8((int8_t *)a->v_cache + (slot * nkv + h) * dim,
                           a->v + t * a->sv + (size_t)h * dim, dim, a->vs + slot * nkv + h);
        else
            put_row(a->v_cache, slot * nkv * dim, a->v + t * a->sv, nkv * dim, a->kv_half);
    }
}

static int qk_rope_cache(int nthreads, int T, int nq, int nkv, int half, int interleaved, long sq,
                         long sk, long sv, int max_pos, long num_slots, float eps, const float *q,
                         const float *k, const float *v, const float *qw, const float *kw,
                         const float *cos, const float *sin, const int64_t *positions,
                         const int64_t *slots, float *q_out, void *k_cache, void *v_cache,
                         float *ks, float *vs, int kv_half) {
    for (int t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_pos || slots[t] < 0 || slots[t] >= num_slots)
            return -1;
    int per = (64 << 10) / ((nq + 2 * nkv) * half * 8);
    per = per < 1 ? 1 : per;
    qkv_t a = {T, nq, nkv, half, interleaved, per, kv_half, sq, sk, sv, eps, q, k, v, qw, kw,
               cos, sin, positions, slots, q_out, k_cache, v_cache, ks, vs};
    hs_parallel_for(nthreads, (T + per - 1) / per, qkv_rows, &a);
    return 0;
}

int hetserve_qk_rope_cache(int nthreads, int T, int nq, int nkv, int half, int interleaved,
                           long sq, long sk, long sv, int max_pos, long num_slots, float eps,
                           const float *q, const float *k, const float *v, const float *qw,
                           const float *kw, const float *cos, const float *sin,
                           const int64_t *positions, const int64_t *slots, float *q_out,
                           float *k_cache, float *v_cache) {
    return qk_rope_cache(nthreads, T, nq, nkv, half, interleaved, sq, sk, sv, max_pos, num_slots,
                         eps, q, k, v, qw, kw, cos, sin, positions, slots, q_out, k_cache, v_cache,
                         NULL, NULL, 0);
}

int hetserve_qk_rope_cache_f16(int nthreads, int T, int nq, int nkv, int half, int interleaved,
                               long sq, long sk, long sv, int max_pos, long num_slots, float eps,
                               const float *q, const float *k, const float *v, const float *qw,
                               const float *kw, const float *cos, const float *sin,
                               const int64_t *positions, const int64_t *slots, float *q_out,
                               uint16_t *k_cache, uint16_t *v_cache) {
    return qk_rope_cache(nthreads, T, nq, nkv, half, interleaved, sq, sk, sv, max_pos, num_slots,
                         eps, q, k, v, qw, kw, cos, sin, positions, slots, q_out, k_cache, v_cache,
                         NULL, NULL, 1);
}

int hetserve_qk_rope_cache_i8(int nthreads, int T, int nq, int nkv, int half, int interleaved,
                              long sq, long sk, long sv, int max_pos, long num_slots, float eps,
                              const float *q, const float *k, const float *v, const float *qw,
                              const float *kw, const float *cos, const float *sin,
                              const int64_t *positions, const int64_t *slots, float *q_out,
                              int8_t *k_cache, int8_t *v_cache, float *ks, float *vs) {
    return qk_rope_cache(nthreads, T, nq, nkv, half, interleaved, sq, sk, sv, max_pos, num_slots,
                         eps, q, k, v, qw, kw, cos, sin, positions, slots, q_out, k_cache, v_cache,
                         ks, vs, 2);
}

/* Block copies of the KV tiers (engine/kv_store.py: a victim-cache stage or unstage): for
 * every i < k and part j < nparts, nbytes[j] bytes from src[j] + src_idx[i] * src_stride[j] to
 * dst[j] + dst_idx[i] * dst_stride[j]. One memcpy per (block, part) on the thread team; torch's
 * index_select + indexed assignment made two passes and ran at ~2-3 GB/s. */
typedef struct {
    int nparts;
    const int64_t *nbytes, *src_stride, *src_idx, *dst_stride, *dst_idx;
    const uint64_t *src, *dst;
} copy_t;

static void copy_item(void *p, int item) {
    const copy_t *c = (const copy_t *)p;
    int i = item / c->nparts, j = item % c->nparts;
    memcpy((char *)(uintptr_t)c->dst[j] + c->dst_idx[i] * c->dst_stride[j],
           (const char *)(uintptr_t)c->src[j] + c->src_idx[i] * c->src_stride[j],
           (size_t)c->nbytes[j]);
}

void hetserve_copy_parts(int nthreads, int k, int nparts, const int64_t *nbytes,
                         const uint64_t *src, const int64_t *src_stride, const int64_t *src_idx,
                         const uint64_t *dst, const int64_t *dst_stride, const int64_t *dst_idx) {
    copy_t c = {nparts, nbytes, src_stride, src_idx, dst_stride, dst_idx, src, dst};
    hs_parallel_for(nthreads, k * nparts, copy_item, &c);
}
