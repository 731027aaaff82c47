/* One decode token of B sequences through a linear-attention layer's stateful part, in place on
 * their state slots (hetserve/layers/linear_attention.py):
 *
 *   1. the short convolution: each of C = 2*Hk*Dk + Hv*Dv channels shifts the token's input into
 *      its window (conv_state[slot, c, 0..K-2], oldest first), y = SiLU(sum_j w[c, j] * win[j]);
 *   2. q and k (per key head) L2-normalised as x / sqrt(|x|^2 + 1e-6), q scaled by Dk^-1/2;
 *   3. the gated delta rule on S = state[slot, h] ([Dk, Dv]) for each value head h, whose key
 *      head is h / (Hv / Hk):  S' = diag(a) S;  u = beta (v - S'^T k);  S = S' + k u^T;
 *      o = S^T q,  with a = exp(log_decay) one per head or one per key channel (per_channel).
 *
 * Why in C: torch runs step 3 as gather, decay, two einsums, an outer-product add and a scatter
 * back, six passes over the state plus a copy each way; here an item (one sequence and value
 * head) reads its [Dk, Dv] state once for S'^T k and once more, from cache, to update it and
 * read o. Measured at 32 heads of 128 x 128 and 8 sequences on 2 cores: see the commit that
 * added it. The sums run in another order than torch's, so results differ by fp32 rounding.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"
#include "simd.h"

typedef struct {
    int B, Hk, Hv, Dk, Dv, K, C, per_channel;
    const int64_t *slots;
    float *conv_state;
    const float *conv_w, *mixed, *log_decay, *beta;
    float *state, *out, *qkv; /* qkv: [B, C] scratch, the conv output normalised */
} lin_t;

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* Phase 1, one sequence: convolution, window shift, q/k normalisation. */
static void conv_item(void *ctx, int b) {
    const lin_t *a = (const lin_t *)ctx;
    const int C = a->C, K = a->K;
    float *win = a->conv_state + a->slots[b] * (int64_t)C * (K - 1);
    const float *x = a->mixed + (int64_t)b * C;
    float *y = a->qkv + (int64_t)b * C;
    for (int c = 0; c < C; c++) {
        float *w = win + (int64_t)c * (K - 1);
        const float *wc = a->conv_w + (int64_t)c * K;
        float acc = wc[K - 1] * x[c];
        for (int j = 0; j < K - 1; j++) acc += wc[j] * w[j];
        for (int j = 0; j + 1 < K - 1; j++) w[j] = w[j + 1];
        if (K > 1) w[K - 2] = x[c];
        y[c] = silu(acc);
    }
    const float qscale = 1.0f / sqrtf((float)a->Dk);
    for (int part = 0; part < 2; part++) { /* q heads, then k heads */
        for (int h = 0; h < a->Hk; h++) {
            float *v = y + (int64_t)(part * a->Hk + h) * a->Dk;
            float ss = 0.0f;
            for (int i = 0; i < a->Dk; i++) ss += v[i] * v[i];
            const float inv = 1.0f / sqrtf(ss + 1e-6f) * (part == 0 ? qscale : 1.0f);
            for (int i = 0; i < a->Dk; i++) v[i] *= inv;
        }
    }
}

/* Phase 2, one (sequence, value head): the delta rule on its state. */
static void delta_item(void *ctx, int item) {
    const lin_t *a = (const lin_t *)ctx;
    const int b = item / a->Hv, h = item % a->Hv, Dk = a->Dk, Dv = a->Dv;
    const int kh = h / (a->Hv / a->Hk);
    const float *y = a->qkv + (int64_t)b * a->C;
    const float *q = y + (int64_t)kh * Dk;
    const float *k = y + (int64_t)(a->Hk + kh) * Dk;
    const float *v = y + (int64_t)2 * a->Hk * Dk + (int64_t)h * Dv;
    float *S = a->state + ((int64_t)a->slots[b] * a->Hv + h) * Dk * Dv;
    const float *g = a->log_decay + (int64_t)item * (a->per_channel ? Dk : 1);
    const float beta = a->beta[item];
    float *o = a->out + (int64_t)item * Dv;
    float u[Dv], decay[Dk];
    for (int i = 0; i < Dk; i++) decay[i] = expf(g[a->per_channel ? i : 0]);
    for (int j = 0; j < Dv; j++) u[j] = 0.0f;
    int j0 = Dv - Dv % 8;
    for (int i = 0; i < Dk; i++) { /* u = S'^T k */
        const float c = decay[i] * k[i];
        const float *row = S + (int64_t)i * Dv;
        const __m256 vc = _mm256_set1_ps(c);
        for (int j = 0; j < j0; j += 8)
            _mm256_storeu_ps(u + j, _mm256_fmadd_ps(vc, _mm256_loadu_ps(row + j),
                                                    _mm256_loadu_ps(u + j)));
        for (int j = j0; j < Dv; j++) u[j] += c * row[j];
    }
    for (int j = 0; j < Dv; j++) {
        u[j] = beta * (v[j] - u[j]);
        o[j] = 0.0f;
    }
    for (int i = 0; i < Dk; i++) { /* S = diag(a) S + k u^T;  o += q[i] S[i] */
        float *row = S + (int64_t)i * Dv;
        const __m256 va = _mm256_set1_ps(decay[i]), vk = _mm256_set1_ps(k[i]);
        const __m256 vq = _mm256_set1_ps(q[i]);
        for (int j = 0; j < j0; j += 8) {
            __m256 s = _mm256_fmadd_ps(vk, _mm256_loadu_ps(u + j),
                                       _mm256_mul_ps(va, _mm256_loadu_ps(row + j)));
            _mm256_storeu_ps(row + j, s);
            _mm256_storeu_ps(o + j, _mm256_fmadd_ps(vq, s, _mm256_loadu_ps(o + j)));
        }
        for (int j = j0; j < Dv; j++) {
            row[j] = decay[i] * row[j] + k[i] * u[j];
            o[j] += q[i] * row[j];
        }
    }
}

/* mixed [B, C] (the pre-conv q|k|v of each sequence's token); conv_state [num_slots, C, K-1];
 * conv_w [C, K]; log_decay [B, Hv] or [B, Hv, Dk]; beta [B, Hv]; state [num_slots, Hv, Dk, Dv];
 * out [B, Hv, Dv]. Returns 0, -1 when out of memory, -2 for a slot out of range. */
int hetserve_delta_decode(int nthreads, int B, int Hk, int Hv, int Dk, int Dv, int K,
                          int per_channel, int num_slots, const int64_t *slots, float *conv_state,
                          const float *conv_w, const float *mixed, const float *log_decay,
                          const float *beta, float *state, float *out) {
    for (int b = 0; b < B; b++)
        if (slots[b] < 0 || slots[b] >= num_slots) return -2;
    if (Hk < 1 || Hv % Hk || K < 1) return -2;
    const int C = 2 * Hk * Dk + Hv * Dv;
    float *qkv = (float *)malloc(sizeof(float) * (size_t)B * C);
    if (qkv == NULL) return -1;
    lin_t a = {B,     Hk,   Hv,       Dk,    Dv,        K,    C,     per_channel, slots,
               conv_state, conv_w, mixed, log_decay, beta, state, out, qkv};
    hs_parallel_for(nthreads, B, conv_item, &a);
    hs_parallel_for(nthreads, B * Hv, delta_item, &a);
    free(qkv);
    return 0;
}
