/* Decode helpers of the MLA families (model/deepseek.py, deepseek_v32.py): the V3.2 indexer's
 * scores over the paged keys, and the absorbed per-head products (further down).
 *
 * DeepSeek-V3.2's lightning indexer at decode: one query token per
 * sequence scores every key of its context, read in place from the paged cache,
 *   score[b, j] = sum_h w[b, h] * relu(q[b, h] . K[slot(b, j)])   for j < len_b, else -inf,
 * with slot(b, j) = table[b, j / bs] * bs + j % bs. Keys are fp32, fp16 (F16C) or int8 rows with
 * one scale each (a row's dot products times its scale). The torch path gathered and widened
 * every key into a copy and ran two einsums: at a 32k context that scan was most of the step.
 *
 * Per key row: its D / 8 vectors are loaded once per group of 8 heads, each head's products
 * summed in a vector of its own, the 8 horizontal sums taken together (hs_hsum8). Work items are
 * chunks of CHUNK keys of one sequence; they write disjoint scores, so the result does not depend
 * on the thread count. Needs D and H multiples of 8 (the caller checks). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "pool.h"
#include "simd.h"

#define CHUNK 256

typedef struct {
    int B, H, D, bs, W, N, num_blocks, half;
    const float *q, *w, *ks;
    const void *k;
    const int64_t *tables, *lens;
    float *out;
    const int *first; /* [B + 1]: sequence b's items */
    int err;
} index_t;

static inline __attribute__((always_inline)) void score_chunk(index_t *a, int b, int j0, int j1,
                                                              const int half) {
    const int H = a->H, D = a->D, bs = a->bs;
    const float *q = a->q + (size_t)b * H * D, *w = a->w + (size_t)b * H;
    float *out = a->out + (size_t)b * a->N;
    for (int j = j0; j < j1; j++) {
        const int64_t block = a->tables[(size_t)b * a->W + j / bs];
        if (block < 0 || block >= a->num_blocks) {
            __atomic_store_n(&a->err, 1, __ATOMIC_RELAXED);
            return;
        }
        const size_t slot = (size_t)block * bs + j % bs;
        const size_t row = slot * (size_t)D;
        const __m256 scale = _mm256_set1_ps(half == 2 ? a->ks[slot] : 1.0f);
        __m256 total = _mm256_setzero_ps();
        for (int g = 0; g < H; g += 8) {
            __m256 acc[8];
            for (int h = 0; h < 8; h++) acc[h] = _mm256_setzero_ps();
            for (int i = 0; i < D; i += 8) {
                const __m256 kv = hs_ld8(a->k, row + i, half);
                for (int h = 0; h < 8; h++)
                    acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)(g + h) * D + i), kv, acc[h]);
            }
            const __m256 dots = _mm256_mul_ps(hs_hsum8(acc), scale);
            total = _mm256_fmadd_ps(_mm256_loadu_ps(w + g), _mm256_max_ps(dots, _mm256_setzero_ps()),
                                    total);
        }
        out[j] = hs_hsum(total);
    }
}

static void item(void *ctx, int it) {
    index_t *a = ctx;
    int b = 0;
    while (a->first[b + 1] <= it) b++;
    const int len = (int)a->lens[b];
    const int j0 = (it - a->first[b]) * CHUNK, j1 = j0 + CHUNK < len ? j0 + CHUNK : len;
    if (a->half == 2) score_chunk(a, b, j0, j1, 2);
    else if (a->half == 1) score_chunk(a, b, j0, j1, 1);
    else score_chunk(a, b, j0, j1, 0);
}

/* q [B, H, D] (scaled as the indexer scales it), w [B, H]; k the layer's key rows [slots, D]
 * (fp32, fp16 bits or int8 with ks [slots]); tables [B, W], lens [B]; out [B, N] (N >= every
 * len). half: 0 fp32, 1 fp16, 2 int8. Returns 0, 1 for a table entry outside the cache, 2 for a
 * length past N or the table. */
int hetserve_index_scores(int nthreads, int B, int H, int D, int bs, int W, int N, int num_blocks,
                          int half, const float *q, const float *w, const void *k,
                          const float *ks, const int64_t *tables, const int64_t *lens, float *out) {
    int first[B + 1];
    first[0] = 0;
    for (int b = 0; b < B; b++) {
        const int64_t len = lens[b];
        if (len < 0 || len > N || len > (int64_t)W * bs) return 2;
        for (int j = (int)len; j < N; j++) out[(size_t)b * N + j] = -INFINITY;
        first[b + 1] = first[b] + (int)((len + CHUNK - 1) / CHUNK);
    }
    index_t a = {B, H, D, bs, W, N, num_blocks, half, q, w, ks, k, tables, lens, out, first, 0};
    hs_parallel_for(nthreads, first[B], item, &a);
    return a.err;
}

/* Per-head matrix-vector products for MLA's absorbed decode (model/deepseek.py):
 *   out[b, h, n] = sum_k w[h, n, k] * x[b, h, k],   w fp16 bits [H][N][K], x and out fp32,
 * each head its own matrix (kv_b_proj's key half transposed, or its value half). torch's bmm
 * ran these as one-row GEMMs on one thread over fp32 copies: 4 MB a product at 16 heads, about
 * a fifth of a short-context decode step. Work items are (head, 16 rows); K a multiple of 8. */
typedef struct {
    int B, H, N, K;
    const uint16_t *w;
    const float *x;
    float *out;
} heads_t;

#define HEAD_ROWS 16

static void heads_item(void *ctx, int it) {
    const heads_t *a = ctx;
    const int per = (a->N + HEAD_ROWS - 1) / HEAD_ROWS;
    const int h = it / per, n0 = (it % per) * HEAD_ROWS;
    const int n1 = n0 + HEAD_ROWS < a->N ? n0 + HEAD_ROWS : a->N, K = a->K;
    for (int n = n0; n < n1; n++) {
        const uint16_t *row = a->w + ((size_t)h * a->N + n) * K;
        for (int b = 0; b < a->B; b++) {
            const float *x = a->x + ((size_t)b * a->H + h) * K;
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            int k = 0;
            for (; k + 16 <= K; k += 16) {
                acc0 = _mm256_fmadd_ps(hs_ld8(row, k, 1), _mm256_loadu_ps(x + k), acc0);
                acc1 = _mm256_fmadd_ps(hs_ld8(row, k + 8, 1), _mm256_loadu_ps(x + k + 8), acc1);
            }
            for (; k < K; k += 8)
                acc0 = _mm256_fmadd_ps(hs_ld8(row, k, 1), _mm256_loadu_ps(x + k), acc0);
            a->out[((size_t)b * a->H + h) * a->N + n] = hs_hsum(_mm256_add_ps(acc0, acc1));
        }
    }
}

void hetserve_heads_gemv_f16(int nthreads, int B, int H, int N, int K, const uint16_t *w,
                             const float *x, float *out) {
    heads_t a = {B, H, N, K, w, x, out};
    hs_parallel_for(nthreads, H * ((N + HEAD_ROWS - 1) / HEAD_ROWS), heads_item, &a);
}
