/* Paged decode attention over fp32, fp16 or int8 caches on AVX2 + FMA (+ F16C) CPUs
 * (hetserve.layers.native_decode). An fp16 cache (`--kv-cache-dtype float16`) is widened in
 * registers as it is read: half the bytes stream from memory, the arithmetic stays fp32.
 * An int8 cache (`--kv-cache-dtype int8`) is widened the same way, and its per-token, per-KV-head
 * scales are applied outside the dot products: K's to each score, V's to each weight
 * (p[h, j] * vscale[j]), so the inner loops only convert and multiply-add. (Integer dot
 * products with q rounded to int8 per head ran ~10% faster at a 4,000-token context on 2 Zen 3
 * cores; not kept: a decode step would differ from the prefill kernel, whose q is exact, by q's
 * rounding, and a P/D hand-off's output from a colocated run's.)
 *
 * One query token per sequence; its context is read straight from the paged cache, with no
 * gather into a padded copy:
 *   out[b, h] = sum_j p[b, h, j] * V[slot(b, j), h / G],
 *   p[b, h, :] = softmax_j(scale * q[b, h] . K[slot(b, j), h / G]),   j in [lo_b, len_b)
 * where slot(b, j) = table[b, j / bs] * bs + j % bs and, with a sliding window W,
 * lo_b = max(0, len_b - W) (else 0). With attention sinks (gpt-oss), head h's softmax has one
 * more logit, sinks[h], in its denominator only.
 *
 * Work items are chunks of CHUNK tokens of one sequence, every head (flash-decoding's split of
 * the context): an item streams its tokens' whole cache rows (all KV heads are contiguous in a
 * row) and keeps, per head, its own maximum score m, the sum l of e^(s - m) and the
 * unnormalised sum o of e^(s - m) V; a second pass merges a sequence's chunks in order,
 * out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c. The chunking depends on the sequence
 * alone, so a sequence's result is the same bits in any batch and on any thread count. With
 * fewer chunks than 2 per thread (short contexts, few sequences) each chunk's KV heads are
 * split over several items, which changes no head's arithmetic.
 * Scores widen each K element once for up to 4 query heads of its KV head (register blocks of
 * 4 heads x 2 tokens, or 2 x 4; 1 head x 8 tokens where G is odd), a token pair's rows of every
 * KV head in turn, so the cache is read in address order; the weighted sum of V widens each V
 * element once for up to 4 heads, in register blocks of 4 heads x 16 columns over tiles of
 * V_TILE tokens kept in L1. exp is a vectorized polynomial (simd.h, about 2 ulp).
 *
 * The rows are prefetched into L2 ahead of use, so that memory and arithmetic overlap: K rows
 * K_AHEAD tokens ahead of the scores, each token's V row while its scores are computed (the V
 * pass then reads L2), and during the V pass the next chunk's first K rows (the thread's next
 * item, its ranges being contiguous). On a 2-core Zen 4, 8 layers' caches of a 4,000-token
 * context (16 query and 4 KV heads of 128, from DRAM), a step took 6.0-6.2 -> 4.2-5.0 ms with
 * an fp16 cache, 9.4-10.0 -> 8.1-8.7 fp32, 5.1 -> 2.9 int8: the hardware prefetchers alone
 * kept ~10 GB/s of the ~35 that two plain read loops reach there. Each score and weighted sum
 * adds in the same order as before: the same bits.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "simd.h"

#define CHUNK 128 /* tokens per work item; fixed so results never depend on the batch */
#define V_TILE 32 /* tokens per tile of the weighted sum of V */
#define K_AHEAD 32 /* tokens between a K row's prefetch and its scores */
#define NEXT_K 16 /* the next chunk's K rows prefetched per V tile (4 tiles: its first 64) */

typedef struct {
    int B, H, Hkv, D, Dv, bs, W, window, num_blocks;
    int split; /* work items per chunk, each a range of its KV heads (more items than chunks
                * when there are few: a short context on many threads) */
    float scale;
    const float *sinks; /* [H] or NULL */
    const float *q;
    const void *k, *v; /* float, uint16_t fp16 bits (item_f16) or int8_t (item_i8) */
    const float *ks, *vs; /* int8: scales [num_blocks * bs, Hkv] of K and V; else NULL */
    const int64_t *tables, *lens;
    float *out;
    const int *first; /* [B + 1]: sequence b's chunks are first[b] .. first[b + 1] - 1 */
    float *part;      /* per chunk: m [H], l [H], o [H, Dv] */
    int err;
} attn_t;

static inline int lo_of(const attn_t *a, int len) {
    return a->window > 0 && len > a->window ? len - a->window : 0;
}

static inline size_t part_floats(const attn_t *a) { return (size_t)a->H * (2 + (size_t)a->Dv); }

/* The scores of NT tokens (row offsets kr[0..NT) at their KV head) against NH query heads of
 * that KV head (q: the first one's D floats, the others D apart), NH * NT = 8:
 * s[i * m + t] = scale * q_i . K_t. Each K element is widened once for its NH heads (4 x 2,
 * 2 x 4); 1 x 8 where G is odd, eight rows side by side. */
static inline __attribute__((always_inline)) void score_blk(const attn_t *a, const size_t *kr,
                                                            const float *q, float *s, int m,
                                                            const int NH, const int NT,
                                                            const int half) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int d = 0; d < a->D; d += 8) {
        __m256 kv[8];
        for (int t = 0; t < NT; t++) kv[t] = hs_ld8(a->k, kr[t] + d, half);
        for (int i = 0; i < NH; i++) {
            const __m256 qv = _mm256_loadu_ps(q + (size_t)i * a->D + d);
            for (int t = 0; t < NT; t++)
                acc[i * NT + t] = _mm256_fmadd_ps(qv, kv[t], acc[i * NT + t]);
        }
    }
    float r[8];
    _mm256_storeu_ps(r, _mm256_mul_ps(hs_hsum8(acc), _mm256_set1_ps(a->scale)));
    for (int i = 0; i < NH; i++)
        for (int t = 0; t < NT; t++) s[(size_t)i * m + t] = r[i * NT + t];
}

/* The scores of tokens [t, t + 8) of the chunk (cache rows row[]) for every query head of KV
 * heads [g0, g1), in register blocks of NH heads x NT tokens: a block's token rows for every KV
 * head in turn, so the cache is read in address order. NH and NT are constants where inlined,
 * so the row offsets stay in registers. */
static inline __attribute__((always_inline)) void score_rows(const attn_t *a, const size_t *row,
                                                             const float *q, float *s, int m,
                                                             int t, int g0, int g1, const int NH,
                                                             const int NT, const int half) {
    const int Hkv = a->Hkv, D = a->D, G = a->H / a->Hkv;
    for (int u = t; u < t + 8; u += NT)
        for (int g = g0; g < g1; g++) {
            size_t kr[8];
            for (int w = 0; w < NT; w++) kr[w] = (row[u + w] * Hkv + g) * D;
            const float *qg = q + (size_t)g * G * D;
            float *sg = s + (size_t)g * G * m + u;
            for (int i = 0; i < G; i += NH)
                score_blk(a, kr, qg + (size_t)i * D, sg + (size_t)i * m, m, NH, NT, half);
        }
}

/* Prefetch into L2 the bytes [off, off + n) of a cache (element offset off, n bytes).
 * always_inline: a separate function whose only effect is a prefetch is "const" to GCC's
 * interprocedural analysis, which then deletes its calls (GCC 12 at -O2 and -O3). */
static inline __attribute__((always_inline)) void prefetch_l2(const void *base, size_t off,
                                                              size_t esz, size_t n) {
    const char *p = (const char *)base + off * esz;
    for (size_t o = 0; o < n; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
}

/* a . cache[off, off + n) */
static inline __attribute__((always_inline)) float dot(const float *a, const void *b, size_t off,
                                                       int n, const int half) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), hs_ld8(b, off + i, half), acc);
    float s = hs_hsum(acc);
    for (; i < n; i++) s += a[i] * hs_ld1(b, off + i, half);
    return s;
}

/* o[i, d0 .. d0 + 8 NV) += sum_{t in [t0, t1)} p[i, t] V_t[d0 ..] for HN heads (rows of o and p
 * from o and p, strides Dv and m) whose V rows start at vr[t] (element offsets). */
static inline __attribute__((always_inline)) void v_block(
    const attn_t *a, const size_t *vr, const float *p, int m, int t0, int t1, float *o, int d0,
    const int HN, const int NV, const int half) {
    const int Dv = a->Dv;
    __m256 acc[4][2];
    for (int i = 0; i < HN; i++)
        for (int u = 0; u < NV; u++) acc[i][u] = _mm256_loadu_ps(o + (size_t)i * Dv + d0 + 8 * u);
    for (int t = t0; t < t1; t++) {
        __m256 vv[2];
        for (int u = 0; u < NV; u++) vv[u] = hs_ld8(a->v, vr[t] + d0 + 8 * u, half);
        for (int i = 0; i < HN; i++) {
            const __m256 w = _mm256_broadcast_ss(p + (size_t)i * m + t);
            for (int u = 0; u < NV; u++) acc[i][u] = _mm256_fmadd_ps(w, vv[u], acc[i][u]);
        }
    }
    for (int i = 0; i < HN; i++)
        for (int u = 0; u < NV; u++) _mm256_storeu_ps(o + (size_t)i * Dv + d0 + 8 * u, acc[i][u]);
}

/* Heads [0, hn) of one KV head over tokens [t0, t1): every column of o. */
static inline __attribute__((always_inline)) void v_heads(const attn_t *a, const size_t *vr,
                                                          const float *p, int m, int t0, int t1,
                                                          float *o, int hn, const int half) {
    const int Dv = a->Dv;
    int d0 = 0;
    for (; d0 + 16 <= Dv; d0 += 16) {
        if (hn == 4) v_block(a, vr, p, m, t0, t1, o, d0, 4, 2, half);
        else if (hn == 2) v_block(a, vr, p, m, t0, t1, o, d0, 2, 2, half);
        else if (hn == 3) v_block(a, vr, p, m, t0, t1, o, d0, 3, 2, half);
        else v_block(a, vr, p, m, t0, t1, o, d0, 1, 2, half);
    }
    for (; d0 + 8 <= Dv; d0 += 8) v_block(a, vr, p, m, t0, t1, o, d0, hn < 4 ? hn : 4, 1, half);
    for (; d0 < Dv; d0++)
        for (int i = 0; i < hn; i++) {
            float acc = o[(size_t)i * Dv + d0];
            for (int t = t0; t < t1; t++)
                acc += p[(size_t)i * m + t] * hs_ld1(a->v, vr[t] + d0, half);
            o[(size_t)i * Dv + d0] = acc;
        }
}

/* int8 cache: s[h][t] *= scales[slot t, h / G] for the heads of KV heads [g0, g1), a token's
 * Hkv scales read together (scales [slots, Hkv], row[t]: token t's slot). */
static void scale_rows(float *s, int m, const size_t *row, int Hkv, int g0, int g1, int G,
                       const float *scales) {
    for (int u = 0; u < m; u++) {
        const float *sc = scales + row[u] * Hkv;
        for (int g = g0, h = g0 * G; g < g1; g++)
            for (const int he = h + G; h < he; h++) s[(size_t)h * m + u] *= sc[g];
    }
}

/* e^x for one value: hs_exp's lane 0 (the same polynomial, the same bits as in a vector). */
static inline float exp1(float x) {
    return _mm256_cvtss_f32(hs_exp(_mm256_set1_ps(x)));
}

static inline __attribute__((always_inline)) void item_impl(void *ctx, int it, const int half) {
    attn_t *a = (attn_t *)ctx;
    const int H = a->H, G = H / a->Hkv, D = a->D, Dv = a->Dv, Hkv = a->Hkv;
    const int c = it / a->split, part = it % a->split; /* chunk c, its KV heads [g0, g1) */
    const int g0 = part * Hkv / a->split, g1 = (part + 1) * Hkv / a->split;
    const int h0 = g0 * G, h1 = g1 * G; /* their query heads */
    int b = 0, hi = a->B - 1; /* the sequence of chunk c: first[b] <= c < first[b + 1] */
    while (b < hi) {
        const int mid = (b + hi + 1) / 2;
        if (a->first[mid] <= c) b = mid;
        else hi = mid - 1;
    }
    const int len = (int)a->lens[b], lo = lo_of(a, len);
    const int j0 = lo + (c - a->first[b]) * CHUNK, j1 = j0 + CHUNK < len ? j0 + CHUNK : len;
    const int m = j1 - j0;
    float *mx = a->part + (size_t)c * part_floats(a), *l = mx + H, *o = l + H;
    const int64_t *table = a->tables + (size_t)b * a->W;
    /* s[h][t]: scores, then weights; row[t]: token j0 + t's slot */
    float *s = malloc(sizeof(float) * (size_t)H * m + sizeof(size_t) * 2 * m);
    if (s == NULL) {
        __atomic_store_n(&a->err, -1, __ATOMIC_RELAXED);
        return;
    }
    size_t *row = (size_t *)(s + (((size_t)H * m + 1) & ~(size_t)1)), *kr = row + m;
    for (int t = 0; t < m; t++) {
        const int64_t blk = table[(j0 + t) / a->bs];
        if (blk < 0 || blk >= a->num_blocks) {
            __atomic_store_n(&a->err, -2, __ATOMIC_RELAXED);
            free(s);
            return;
        }
        row[t] = (size_t)blk * a->bs + (j0 + t) % a->bs;
    }
    const float *q = a->q + (size_t)b * H * D;
    /* The bytes of a token's rows at KV heads [g0, g1) (contiguous in the cache) */
    const size_t esz = half == 2 ? 1 : half ? 2 : 4;
    const size_t kbytes = (size_t)(g1 - g0) * D * esz, vbytes = (size_t)(g1 - g0) * Dv * esz;
    /* Token blocks outer: the rows are read in order, each once from memory (the G heads of a
     * KV head read it again from L1). */
    int t = 0;
    if (D % 8 == 0)
        for (; t + 8 <= m; t += 8) {
            for (int u = t; u < t + 8; u++) {
                if (u + K_AHEAD < m) prefetch_l2(a->k, (row[u + K_AHEAD] * Hkv + g0) * D, esz, kbytes);
                prefetch_l2(a->v, (row[u] * Hkv + g0) * Dv, esz, vbytes);
            }
            /* NH x NT register blocks (NH * NT = 8): the widest head block G allows */
            if (G % 4 == 0) score_rows(a, row, q, s, m, t, g0, g1, 4, 2, half);
            else if (G % 2 == 0) score_rows(a, row, q, s, m, t, g0, g1, 2, 4, half);
            else score_rows(a, row, q, s, m, t, g0, g1, 1, 8, half);
        }
    for (; t < m; t++)
        for (int h = h0; h < h1; h++)
            s[(size_t)h * m + t] =
                dot(q + (size_t)h * D, a->k, (row[t] * Hkv + h / G) * D, D, half) * a->scale;
    if (half == 2) scale_rows(s, m, row, Hkv, g0, g1, G, a->ks); /* K's scales */
    /* Per head: the chunk's maximum, its weights e^(s - max) (times V's scale for int8), their
     * sum. */
    for (int h = h0; h < h1; h++) {
        float *p = s + (size_t)h * m;
        float best = p[0];
        int j = 0;
        if (m >= 8) {
            __m256 v = _mm256_loadu_ps(p);
            for (j = 8; j + 8 <= m; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(p + j));
            best = hs_hmax(v);
        }
        for (; j < m; j++) best = p[j] > best ? p[j] : best;
        const __m256 vm = _mm256_set1_ps(best);
        __m256 acc = _mm256_setzero_ps();
        for (j = 0; j + 8 <= m; j += 8) {
            const __m256 e = hs_exp(_mm256_sub_ps(_mm256_loadu_ps(p + j), vm));
            _mm256_storeu_ps(p + j, e);
            acc = _mm256_add_ps(acc, e);
        }
        float sum = hs_hsum(acc);
        if (j < m) { /* the tail through the same polynomial, padded with -inf-like values */
            float x[8];
            for (int u = 0; u < 8; u++) x[u] = j + u < m ? p[j + u] - best : -100.0f;
            _mm256_storeu_ps(x, hs_exp(_mm256_loadu_ps(x)));
            for (int u = 0; j + u < m; u++) p[j + u] = x[u], sum += x[u];
        }
        mx[h] = best;
        l[h] = sum;
    }
    if (half == 2) scale_rows(s, m, row, Hkv, g0, g1, G, a->vs); /* V's, into the weights */
    /* o[h] = sum_t p[h, t] V_t, tile by tile: a tile's V rows stay in L1 while every head and
     * column block passes over them. */
    memset(o + (size_t)h0 * Dv, 0, sizeof(float) * (size_t)(h1 - h0) * Dv);
    /* the next chunk of this sequence: this thread's next item where items are whole chunks */
    const int next = a->split == 1 && c + 1 < a->first[b + 1] ? j1 : len;
    for (int g = g0; g < g1; g++) {
        for (int u = 0; u < m; u++) kr[u] = (row[u] * Hkv + g) * Dv;
        for (int t0 = 0; t0 < m; t0 += V_TILE) {
            const int t1 = t0 + V_TILE < m ? t0 + V_TILE : m;
            if (g == g0) /* the next chunk's first K rows, while this V pass computes */
                for (int j = next + t0 / V_TILE * NEXT_K, u = 0; u < NEXT_K && j < len; j++, u++) {
                    const int64_t blk = table[j / a->bs];
                    if (blk < 0 || blk >= a->num_blocks) break; /* its item reports it */
                    prefetch_l2(a->k, (((size_t)blk * a->bs + j % a->bs) * Hkv) * D, esz,
                                (size_t)Hkv * D * esz);
                }
            for (int hb = g * G; hb < (g + 1) * G; hb += 4) {
                const int hn = (g + 1) * G - hb < 4 ? (g + 1) * G - hb : 4;
                v_heads(a, kr, s + (size_t)hb * m, m, t0, t1, o + (size_t)hb * Dv, hn, half);
            }
        }
    }
    free(s);
}

/* One specialised copy per cache element type (the constant folds every ld8/ld1 branch). */
static void item_f32(void *ctx, int it) { item_impl(ctx, it, 0); }
static void item_f16(void *ctx, int it) { item_impl(ctx, it, 1); }
static void item_i8(void *ctx, int it) { item_impl(ctx, it, 2); }

/* Sequence b's chunks merged in order into out[b] (zeros for an empty context). */
static void merge(void *ctx, int b) {
    attn_t *a = (attn_t *)ctx;
    const int H = a->H, Dv = a->Dv, c0 = a->first[b], nc = a->first[b + 1] - c0;
    float *out = a->out + (size_t)b * H * Dv;
    const size_t pf = part_floats(a);
    for (int h = 0; h < H; h++) {
        float *oh = out + (size_t)h * Dv;
        memset(oh, 0, sizeof(float) * Dv);
        if (nc == 0) continue;
        float best = a->sinks ? a->sinks[h] : a->part[c0 * pf + h];
        for (int c = 0; c < nc; c++) {
            const float m = a->part[(c0 + c) * pf + h];
            best = m > best ? m : best;
        }
        float den = 0.0f;
        if (a->sinks) den = exp1(a->sinks[h] - best); /* in the denominator only */
        for (int c = 0; c < nc; c++) {
            const float *pc = a->part + (c0 + c) * pf;
            const float e = exp1(pc[h] - best);
            den += e * pc[H + h];
            const __m256 w = _mm256_set1_ps(e);
            const float *oc = pc + 2 * (size_t)H + (size_t)h * Dv;
            int d = 0;
            for (; d + 8 <= Dv; d += 8)
                _mm256_storeu_ps(oh + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(oc + d),
                                                         _mm256_loadu_ps(oh + d)));
            for (; d < Dv; d++) oh[d] += e * oc[d];
        }
        const __m256 inv = _mm256_set1_ps(1.0f / den);
        int d = 0;
        for (; d + 8 <= Dv; d += 8)
            _mm256_storeu_ps(oh + d, _mm256_mul_ps(_mm256_loadu_ps(oh + d), inv));
        for (; d < Dv; d++) oh[d] *= 1.0f / den;
    }
}

static int run(int nthreads, int B, int H, int Hkv, int D, int Dv, int bs, int W, int window,
               int num_blocks, float scale, const float *sinks, const float *q, const void *k,
               const void *v, const int64_t *tables, const int64_t *lens, float *out,
               const float *ks, const float *vs, int half) {
    if (Hkv <= 0 || H % Hkv != 0) return -3;
    int *first = malloc(sizeof(int) * (size_t)(B + 1));
    if (first == NULL) return -1;
    attn_t a = {B, H, Hkv, D, Dv, bs, W, window, num_blocks, 1, scale, sinks, q, k, v, ks, vs,
                tables, lens, out, first, NULL, 0};
    first[0] = 0;
    for (int b = 0; b < B; b++) {
        const int len = (int)lens[b], n = len - lo_of(&a, len);
        first[b + 1] = first[b] + (n > 0 ? (n + CHUNK - 1) / CHUNK : 0);
    }
    a.part = malloc(sizeof(float) * part_floats(&a) * (size_t)(first[B] > 0 ? first[B] : 1));
    if (a.part == NULL) {
        free(first);
        return -1;
    }
    /* Few chunks (a short context, few sequences): each split by KV heads into enough items
     * for 2 per thread. A head's arithmetic is the same in any split: the bits do not change. */
    while (a.split < Hkv && first[B] * a.split < 2 * nthreads) a.split++;
    while (Hkv % a.split) a.split++; /* whole KV heads per item, evenly */
    hs_parallel_for(nthreads, first[B] * a.split, half == 2 ? item_i8 : half ? item_f16 : item_f32,
                    &a);
    if (a.err == 0) hs_parallel_for(nthreads, B, merge, &a);
    free(a.part);
    free(first);
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
