/* A whole decode step's decoder layers in one call (hetserve/model/fused_decode.py).
 *
 * At one token per sequence the matrices of a layer take ~0.5 ms together on a 2-core CPU, and
 * the dozen Python-level steps between them (norms, the q/k/v split, rotary, the cache write,
 * attention, residual adds, the router, the experts' wrapper) cost ~0.15 ms more per layer:
 * a quarter of the step. This file chains the same kernels the modules call, layer after layer,
 * with no Python in between:
 *
 *   h = x + o_proj(attention(rope(qk_norm(qkv_proj(rms_norm(x))))))      (K/V into the cache)
 *   x = h + ffn(rms_norm(h)),  ffn = routed experts (softmax top-k router) or a dense SwiGLU MLP
 *
 * Each step is the module path's kernel (hetserve_rms_norm, hetserve_qlinear,
 * hetserve_qk_rope_cache, hetserve_paged_decode_attention, hetserve_router_logits,
 * hetserve_topk_softmax, hetserve_moe_forward) on the same inputs, so the results are the
 * module path's bit for bit, except the dense MLP's silu (hs_silu here, torch's there). The layer constants come from Python once (hs_layer_t, mirrored by a
 * ctypes Structure there); a call brings only the step's tokens, positions, slots and tables. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "simd.h"

/* The kernels of the other files this one chains. */
void hetserve_rms_norm(int nthreads, int rows, int dim, float eps, const float *x,
                       const float *w, float *out);
int hetserve_qlinear(int fmt, int G, int nthreads, int T, int N, int K, const float *x,
                     float *out, const void *w, const void *s);
int hetserve_qk_rope_cache(int nthreads, int T, int nq, int nkv, int half, int interleaved,
                           long sq, long sk, long sv, int max_pos, long num_slots, float eps,
                           const float *q, const float *k, const float *v, const float *qw,
                           const float *kw, const float *cos, const float *sin,
                           const int64_t *positions, const int64_t *slots, float *q_out,
                           float *k_cache, float *v_cache);
int hetserve_qk_rope_cache_f16(int nthreads, int T, int nq, int nkv, int half, int interleaved,
                               long sq, long sk, long sv, int max_pos, long num_slots, float eps,
                               const float *q, const float *k, const float *v, const float *qw,
                               const float *kw, const float *cos, const float *sin,
                               const int64_t *positions, const int64_t *slots, float *q_out,
                               uint16_t *k_cache, uint16_t *v_cache);
int hetserve_qk_rope_cache_i8(int nthreads, int T, int nq, int nkv, int half, int interleaved,
                              long sq, long sk, long sv, int max_pos, long num_slots, float eps,
                              const float *q, const float *k, const float *v, const float *qw,
                              const float *kw, const float *cos, const float *sin,
                              const int64_t *positions, const int64_t *slots, float *q_out,
                              int8_t *k_cache, int8_t *v_cache, float *ks, float *vs);
int hetserve_paged_decode_attention_i8(int nthreads, int B, int H, int Hkv, int D, int Dv, int bs,
                                       int W, int window, int num_blocks, float scale,
                                       const float *sinks, const float *q, const int8_t *k,
                                       const int8_t *v, const int64_t *tables,
                                       const int64_t *lens, float *out, const float *ks,
                                       const float *vs);
int hetserve_paged_decode_attention_f16(int nthreads, int B, int H, int Hkv, int D, int Dv, int bs,
                                        int W, int window, int num_blocks, float scale,
                                        const float *sinks, const float *q, const uint16_t *k,
                                        const uint16_t *v, const int64_t *tables,
                                        const int64_t *lens, float *out);
int hetserve_paged_decode_attention(int nthreads, int B, int H, int Hkv, int D, int Dv, int bs,
                                    int W, int window, int num_blocks, float scale,
                                    const float *sinks, const float *q, const float *k,
                                    const float *v, const int64_t *tables, const int64_t *lens,
                                    float *out);
void hetserve_router_logits(int nthreads, int T, int E, int H, const float *x, const float *w,
                            float *out);
void hetserve_topk_softmax(int nthreads, int T, int E, int k, int renorm, float scale,
                           const float *logits, float *w, int64_t *ids);
int hetserve_moe_forward(int fmt, int nthreads, int E, int H, int I, int G, int T, int k,
                         const int64_t *ids, const float *tw, const float *x, float *out,
                         const void *w13, const void *s13, const void *w2, const void *s2,
                         const float *b13, const float *b2, int act, float alpha, float limit);

/* One quantized linear as hetserve_qlinear takes it, plus an optional bias [n]. */
typedef struct {
    int fmt, group, n, k;
    const void *w, *s;
    const float *bias;
} hs_qlin_t;

enum { FFN_EXPERTS = 1, FFN_DENSE = 2 };

/* Everything fixed about one layer (and its KV cache). Field order is the ctypes mirror's. */
typedef struct {
    int hidden, nq, nkv, head_dim, interleaved, max_pos, block_size, num_blocks;
    long num_slots;
    float eps, qk_eps, scale;
    const float *in_norm, *post_norm, *q_norm, *k_norm, *cos, *sin;
    void *k_cache, *v_cache; /* fp32, fp16 bits (kv_half 1) or int8 (kv_half 2) */
    hs_qlin_t qkv, o;
    int ffn;
    /* FFN_EXPERTS: the router [E, hidden] fp32 and hetserve_moe_forward's arguments */
    int num_experts, top_k, renorm, efmt, einter, egroup, eact, ethreads;
    float route_scale, ealpha, elimit;
    const float *router;
    const void *w13, *s13, *w2, *s2;
    const float *b13, *b2;
    /* FFN_DENSE: down(silu(gate(x)) * up(x)) */
    hs_qlin_t gate, up, down;
    int kv_half; /* the KV cache holds fp16 (1, --kv-cache-dtype float16) or int8 (2) */
    float *k_scale, *v_scale; /* kv_half 2: the scales [num_slots, nkv] */
    /* split 1: q, k and v are three linears (a GGUF file's of different types), qkv holding q's
     * (nq * head_dim rows), k_lin and v_lin the others; split 0: qkv is the three fused */
    int split;
    hs_qlin_t k_lin, v_lin;
} hs_layer_t;

static int qlin(const hs_qlin_t *l, int nthreads, int T, const float *x, float *out) {
    int rc = hetserve_qlinear(l->fmt, l->group, nthreads, T, l->n, l->k, x, out, l->w, l->s);
    if (rc == 0 && l->bias)
        for (int t = 0; t < T; t++)
            for (int i = 0; i < l->n; i++) out[(size_t)t * l->n + i] += l->bias[i];
    return rc;
}

static void add_rows(float *x, const float *y, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) x[i] += y[i];
}

/* The attention head (norms, rotary, KV write) then decode attention, over the layer's fp32,
 * fp16 or int8 cache. Returns 0, -4 for a position or slot out of range, or the attention's code. */
static int attend(const hs_layer_t *L, int nthreads, int B, const float *qkv, const float *k,
                  const float *v, const int64_t *positions, const int64_t *slots, float *q,
                  const int64_t *tables, int width, const int64_t *lens, float *att) {
    const int D = L->head_dim, half = D / 2;
    /* rows of q, k and v: one fused row per token, or each of the three linears' own */
    const long sq = L->split ? (long)L->nq * D : L->qkv.n;
    const long sk = L->split ? (long)L->nkv * D : L->qkv.n, sv = sk;
    if (L->kv_half == 2) {
        if (hetserve_qk_rope_cache_i8(nthreads, B, L->nq, L->nkv, half, L->interleaved, sq, sk, sv,
                                      L->max_pos, L->num_slots, L->qk_eps, qkv, k, v, L->q_norm,
                                      L->k_norm, L->cos, L->sin, positions, slots, q,
                                      L->k_cache, L->v_cache, L->k_scale, L->v_scale))
            return -4;
        return hetserve_paged_decode_attention_i8(nthreads, B, L->nq, L->nkv, D, D,
                                                  L->block_size, width, 0, L->num_blocks,
                                                  L->scale, NULL, q, L->k_cache, L->v_cache,
                                                  tables, lens, att, L->k_scale, L->v_scale);
    }
    if (L->kv_half) {
        if (hetserve_qk_rope_cache_f16(nthreads, B, L->nq, L->nkv, half, L->interleaved, sq, sk, sv,
                                       L->max_pos, L->num_slots, L->qk_eps, qkv, k, v, L->q_norm,
                                       L->k_norm, L->cos, L->sin, positions, slots, q,
                                       L->k_cache, L->v_cache))
            return -4;
        return hetserve_paged_decode_attention_f16(nthreads, B, L->nq, L->nkv, D, D,
                                                   L->block_size, width, 0, L->num_blocks,
                                                   L->scale, NULL, q, L->k_cache, L->v_cache,
                                                   tables, lens, att);
    }
    if (hetserve_qk_rope_cache(nthreads, B, L->nq, L->nkv, half, L->interleaved, sq, sk, sv,
                               L->max_pos, L->num_slots, L->qk_eps, qkv, k, v, L->q_norm,
                               L->k_norm, L->cos, L->sin, positions, slots, q, L->k_cache,
                               L->v_cache))
        return -4;
    return hetserve_paged_decode_attention(nthreads, B, L->nq, L->nkv, D, D, L->block_size, width,
                                           0, L->num_blocks, L->scale, NULL, q, L->k_cache,
                                           L->v_cache, tables, lens, att);
}

/* One layer on x [B, hidden] in place; buf is scratch of decode_scratch() floats, ids room for
 * the router's B x top_k expert ids. */
static int layer_step(const hs_layer_t *L, int nthreads, int B, float *x,
                      const int64_t *positions, const int64_t *slots, const int64_t *tables,
                      int width, const int64_t *lens, float *buf, int64_t *ids) {
    const int H = L->hidden, D = L->head_dim, nqkv = (L->nq + 2 * L->nkv) * D;
    float *xn = buf, *qkv = xn + (size_t)B * H, *q = qkv + (size_t)B * nqkv;
    float *att = q + (size_t)B * L->nq * D, *y = att + (size_t)B * L->nq * D;
    float *tmp = y + (size_t)B * H; /* router logits and weights, or the MLP's gate and up */
    int rc;
    hetserve_rms_norm(nthreads, B, H, L->eps, x, L->in_norm, xn);
    if ((rc = qlin(&L->qkv, nthreads, B, xn, qkv))) return rc;
    const float *k = qkv + (size_t)L->nq * D, *v = k + (size_t)L->nkv * D;
    if (L->split) { /* q [B, nq D], then k [B, nkv D], then v [B, nkv D] */
        float *ks = qkv + (size_t)B * L->nq * D, *vs = ks + (size_t)B * L->nkv * D;
        if ((rc = qlin(&L->k_lin, nthreads, B, xn, ks))) return rc;
        if ((rc = qlin(&L->v_lin, nthreads, B, xn, vs))) return rc;
        k = ks, v = vs;
    }
    if ((rc = attend(L, nthreads, B, qkv, k, v, positions, slots, q, tables, width, lens, att)))
        return rc;
    if ((rc = qlin(&L->o, nthreads, B, att, y))) return rc;
    add_rows(x, y, (size_t)B * H);
    hetserve_rms_norm(nthreads, B, H, L->eps, x, L->post_norm, xn);
    if (L->ffn == FFN_EXPERTS) {
        const int E = L->num_experts, K = L->top_k;
        float *tw = tmp + (size_t)B * E;
        hetserve_router_logits(nthreads, B, E, H, xn, L->router, tmp);
        hetserve_topk_softmax(nthreads, B, E, K, L->renorm, L->route_scale, tmp, tw, ids);
        rc = hetserve_moe_forward(L->efmt, L->ethreads ? L->ethreads : nthreads, E, H, L->einter,
                                  L->egroup, B, K, ids, tw, xn, y, L->w13, L->s13, L->w2,
                                  L->s2, L->b13, L->b2, L->eact, L->ealpha, L->elimit);
        if (rc) return rc;
    } else {
        const int I = L->gate.n;
        float *g = tmp, *u = tmp + (size_t)B * I;
        if ((rc = qlin(&L->gate, nthreads, B, xn, g)) || (rc = qlin(&L->up, nthreads, B, xn, u)))
            return rc;
        size_t n = (size_t)B * I, i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(g + i, _mm256_mul_ps(hs_silu(_mm256_loadu_ps(g + i)),
                                                  _mm256_loadu_ps(u + i)));
        for (; i < n; i++) {
            float s = g[i] / (1.0f + expf(-g[i]));
            g[i] = s * u[i];
        }
        if ((rc = qlin(&L->down, nthreads, B, g, y))) return rc;
    }
    add_rows(x, y, (size_t)B * H);
    return 0;
}

/* Floats of scratch one layer needs for B tokens. */
static size_t decode_scratch(const hs_layer_t *L, int B) {
    size_t tmp = L->ffn == FFN_EXPERTS ? (size_t)B * (L->num_experts + L->top_k)
                                       : 2 * (size_t)B * L->gate.n;
    const size_t nqkv = (size_t)(L->nq + 2 * L->nkv) * L->head_dim;
    return (size_t)B * (2 * L->hidden + nqkv + 2 * L->nq * L->head_dim) + tmp;
}

/* x [B, hidden] fp32, in place: through layers [0, nlayers). positions, slots [B]; tables
 * [B, width] block ids, lens [B] context lengths (the new token included). Returns 0, -1 out
 * of memory, -2 an expert id out of range, -4 a position or KV slot out of range. */
int hetserve_decode_layers(int nthreads, int nlayers, const hs_layer_t *layers, int B, float *x,
                           const int64_t *positions, const int64_t *slots,
                           const int64_t *tables, int width, const int64_t *lens) {
    size_t need = 0, top_k = 0;
    for (int l = 0; l < nlayers; l++) {
        size_t n = decode_scratch(&layers[l], B);
        need = n > need ? n : need;
        if (layers[l].ffn == FFN_EXPERTS && (size_t)layers[l].top_k > top_k)
            top_k = (size_t)layers[l].top_k;
    }
    /* the int64 ids first: malloc's alignment serves both */
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)B * top_k + sizeof(float) * need);
    if (ids == NULL) return -1;
    float *buf = (float *)(ids + (size_t)B * top_k);
    int rc = 0;
    for (int l = 0; l < nlayers && rc == 0; l++)
        rc = layer_step(&layers[l], nthreads, B, x, positions, slots, tables, width, lens, buf,
                        ids);
    free(ids);
    return rc;
}
