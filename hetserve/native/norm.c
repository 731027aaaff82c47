/* RMSNorm over fp32 rows (hetserve.layers.norm): out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w.
 * torch runs it as a composite of five to six kernels (pow, mean, add, rsqrt, mul, mul), each
 * with its own dispatch and output allocation; inside the engine that cost ~100+ us per norm of
 * a 64-token decode batch, and a decoding layer has up to four norms. */
#include <immintrin.h>
#include <math.h>

#include "pool.h"
#include "simd.h"

typedef struct {
    int dim, rows_per_item, rows;
    float eps;
    const float *x, *w;
    float *out;
} norm_t;

static void norm_rows(void *ctx, int it) {
    const norm_t *n = (const norm_t *)ctx;
    const int r0 = it * n->rows_per_item;
    const int r1 = r0 + n->rows_per_item < n->rows ? r0 + n->rows_per_item : n->rows;
    const int dim = n->dim;
    for (int r = r0; r < r1; r++) {
        const float *x = n->x + (size_t)r * dim;
        float *o = n->out + (size_t)r * dim;
        __m256 acc = _mm256_setzero_ps();
        int d = 0;
        for (; d + 8 <= dim; d += 8) {
            __m256 v = _mm256_loadu_ps(x + d);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hs_hsum(acc);
        for (; d < dim; d++) ss += x[d] * x[d];
        const float inv = 1.0f / sqrtf(ss / (float)dim + n->eps);
        const __m256 vi = _mm256_set1_ps(inv);
        for (d = 0; d + 8 <= dim; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + d), vi),
                                                  _mm256_loadu_ps(n->w + d)));
        for (; d < dim; d++) o[d] = x[d] * inv * n->w[d];
    }
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
