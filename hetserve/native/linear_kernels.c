/* Plain int8 linear (hetserve_int8_linear) on the routed experts' int8 microkernel. Built with
 * the other kernels by hetserve/native/__init__.py. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "moe_quads.h"
#include "pool.h"

#define TB 32 /* tokens per cache block */
#define RC 8  /* row quads per work chunk */

/* ---- plain int8 linear: y[t, n] = s[n] * sum_k q[n, k] * x[t, k] ------------------------------
 * The same weight-only format and quad layout as the experts (one [N, K] matrix, N % 4 == 0,
 * K % 32 == 0): what `cpu-int8` placement puts on the non-expert linears of CPU-only serving. */
typedef struct {
    const int8_t *w;
    const float *s, *xsc;
    const int16_t *x16;
    float *out;
    int T, N, K;
} lin_t;

static void lin_item(void *ctx, int c) {
    const lin_t *l = (const lin_t *)ctx;
    const int quads = l->N / 4, K = l->K;
    const int u0 = c * RC, u1 = u0 + RC < quads ? u0 + RC : quads;
    for (int t0 = 0; t0 < l->T; t0 += TB) {
        int t1 = t0 + TB < l->T ? t0 + TB : l->T;
        for (int u = u0; u < u1; u++) {
            const int n0 = 4 * u;
            const int8_t *q = l->w + (size_t)n0 * K;
            for (int m = t0; m < t1; m += 2) {
                int MB = t1 - m >= 2 ? 2 : 1;
                const int16_t *const xr[2] = {l->x16 + (size_t)m * K,
                                              l->x16 + (size_t)(m + MB - 1) * K};
                float o[4][MBMAX];
                if (MB == 2)
                    quad_i8(q, K, xr, 2, o);
                else
                    quad_i8(q, K, xr, 1, o);
                for (int mm = 0; mm < MB; mm++) {
                    float *y = l->out + (size_t)(m + mm) * l->N + n0;
                    for (int r = 0; r < 4; r++) y[r] = o[r][mm] * l->s[n0 + r] * l->xsc[m + mm];
                }
            }
        }
    }
}

/* x [T, K] fp32 -> out [T, N]; w quad-interleaved int8 [N, K], s [N]. Returns 0 or -1 (OOM). */
int hetserve_int8_linear(int nthreads, int T, int N, int K, const float *x, float *out,
                         const void *w, const float *s) {
    if (T <= 0) return 0;
    char *buf = malloc(sizeof(int16_t) * (size_t)T * K + sizeof(float) * (size_t)T);
    if (buf == NULL) return -1;
    int16_t *x16 = (int16_t *)buf;
    float *xsc = (float *)(x16 + (size_t)T * K);
    quantize_rows(x, K, 0, T, x16, xsc, 0, 0, NULL);
    lin_t l = {(const int8_t *)w, s, xsc, x16, out, T, N, K};
    hs_parallel_for(nthreads < 1 ? 1 : nthreads, (N / 4 + RC - 1) / RC, lin_item, &l);
    free(buf);
    return 0;
}
