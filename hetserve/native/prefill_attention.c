/* Causal prefill attention read in place from the paged fp32, fp16 or int8 KV cache
 * (hetserve.layers.native_prefill; the decode kernel is attention.c).
 *
 * One prompt chunk of T query tokens at positions [start, start + T) attends to its context
 * [0, start + T) (chunked prefill: earlier chunks are already in the cache):
 *   out[t, h] = sum_j p[t, h, j] * V[slot[j], h / G],
 *   p[t, h, :] = softmax_j(scale * q[t, h] . K[slot[j], h / G]),  j in [lo_t, start + t]
 * with lo_t = max(0, start + t - W + 1) under a sliding window W (else 0); slot[j] is where
 * context token j lives in the paged cache (the span's kv_slots). With attention sinks
 * (gpt-oss) head h's softmax has one more logit, sinks[h], in its denominator only: a row's
 * running maximum starts at the sink and its running sum at e^0 = 1.
 *
 * Flash-style: a work item is a KV head and a tile of query tokens (the G query heads of that
 * KV head for about ROWS rows in all, so every K and V element read serves ROWS dot products);
 * it walks its keys in tiles of BK, and no score matrix beyond ROWS x BK exists. Each key tile
 * is read from the cache once per item, widened to fp32 (int8: times its row's scale) and laid
 * out for the microkernels: K transposed ([D][BK]) so that scores come from broadcast q
 * elements times 8 consecutive keys, V as rows padded to 16 columns. Both products are 6-row
 * by 16-column register blocks (12 accumulators, the classic AVX2 sgemm shape). Softmax is
 * online: per row, a running max m and sum l; when a tile raises m the row's output so far and
 * l are scaled by e^(m_old - m_new). Tiles wholly after a row's position or before its window
 * hold no valid key for it and leave its state as it is. exp is simd.h's polynomial (about 2
 * ulp); results do not depend on the thread count (items write disjoint rows).
 *
 * bf16 products (`bf`, the avx512bf16 build, D and Dv multiples of 16): q (scaled), K, the
 * softmax weights p and V are rounded to bf16 (nearest even) and multiplied by vdpbf16ps in
 * pairs with fp32 sums, twice the fp32 FMA rate: K tiles as [D / 2][BK] pairs of dimensions,
 * V tiles as [BK / 2][Dvp] pairs of keys, 6-row by 32-column blocks of 512-bit accumulators;
 * the softmax, its running state and the output stay fp32. Each product's factors then carry
 * 2^-9 relative rounding (fp32's 2^-24), about what fp16 cache entries carry (2^-11).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "simd.h"

#define BK 64   /* keys per tile */
#define MR 6    /* query rows per register block */
#define ROWS 48 /* query rows (tokens x the group's heads) per work item, about */

#if defined(__AVX512BF16__)
#define PF_BF16 1
#else
#define PF_BF16 0
#endif

typedef struct {
    int T, start, H, Hkv, D, Dv, Dvp, window, bq;
    int bf;            /* bf16 products (PF_BF16 builds only) */
    size_t kst, vst;   /* a key tile's K and V in 4-byte elements (fp32 or bf16 pairs) */
    int tlo, ntiles; /* the key tiles any query sees: [tlo, tlo + ntiles) */
    long num_slots;
    float scale;
    const float *sinks, *q;
    const void *k, *v;    /* float, uint16_t fp16 bits or int8_t (as `half` says) */
    const float *ks, *vs; /* int8: scales [num_slots, Hkv]; else NULL */
    const int64_t *slots;
    float *out;
    float *kbuf, *vbuf; /* the key tiles, widened and laid out (load_tile): [Hkv][ntiles] */
    int err;
} pf_t;

/* Keys [j0, j0 + n) of KV head h into kt [D][BK] (transposed) and vt [BK][Dvp], fp32 and
 * scaled; columns / rows up to nc (n rounded up to 16) and V's padding columns are zero, so
 * the microkernels' padding lanes compute finite values (0 * garbage could be NaN). Returns
 * -2 when a slot is outside the cache. */
static inline __attribute__((always_inline)) int load_tile(const pf_t *a, int h, int j0, int n,
                                                           int nc, float *kt, float *vt,
                                                           const int half) {
    const int D = a->D, Dv = a->Dv, Dvp = a->Dvp, Hkv = a->Hkv;
    size_t kr[BK], vr[BK];
    float ksc[BK], vsc[BK];
    for (int j = 0; j < nc; j++) {
        if (j >= n) {
            kr[j] = vr[j] = 0, ksc[j] = vsc[j] = 0.0f;
            continue;
        }
        const int64_t slot = a->slots[j0 + j];
        if (slot < 0 || slot >= a->num_slots) return -2;
        const size_t row = (size_t)slot * Hkv + h;
        kr[j] = row * D, vr[j] = row * Dv;
        ksc[j] = half == 2 ? a->ks[row] : 1.0f;
        vsc[j] = half == 2 ? a->vs[row] : 1.0f;
    }
    for (int jb = 0; jb < nc; jb += 8) {
        int d = 0;
        for (; d + 8 <= D; d += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = jb + i < n ? _mm256_mul_ps(hs_ld8(a->k, kr[jb + i] + d, half),
                                                  _mm256_set1_ps(ksc[jb + i]))
                                  : _mm256_setzero_ps();
            hs_tr8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(kt + (size_t)(d + i) * BK + jb, r[i]);
        }
        for (; d < D; d++)
            for (int i = 0; i < 8; i++)
                kt[(size_t)d * BK + jb + i] =
                    jb + i < n ? hs_ld1(a->k, kr[jb + i] + d, half) * ksc[jb + i] : 0.0f;
    }
    for (int j = 0; j < nc; j++) {
        float *row = vt + (size_t)j * Dvp;
        if (j >= n) {
            memset(row, 0, sizeof(float) * Dvp);
            continue;
        }
        const __m256 sc = _mm256_set1_ps(vsc[j]);
        int d = 0;
        for (; d + 8 <= Dv; d += 8)
            _mm256_storeu_ps(row + d, _mm256_mul_ps(hs_ld8(a->v, vr[j] + d, half), sc));
        for (; d < Dv; d++) row[d] = hs_ld1(a->v, vr[j] + d, half) * vsc[j];
        for (; d < Dvp; d++) row[d] = 0.0f;
    }
    return 0;
}

#if PF_BF16
/* bf16 pairs of 16 fp32 values, as 8 uint32 (element 2i in the low half). */
static inline __attribute__((always_inline)) __m256i bf_pairs16(const float *x) {
    return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x));
}

/* load_tile's bf16 form: kt [D / 2][BK] pairs of K's dimensions (2e, 2e + 1) per key, vt
 * [BK / 2][Dvp] pairs of keys (2u, 2u + 1) per column; zero past n (keys) and Dv. The fp32
 * values (scaled, as load_tile's) are rounded to bf16 once here. */
static inline __attribute__((always_inline)) int load_tile_bf(const pf_t *a, int h, int j0, int n,
                                                              uint32_t *kt, uint32_t *vt,
                                                              const int half) {
    const int D = a->D, Dv = a->Dv, Dvp = a->Dvp, Hkv = a->Hkv;
    float row[2][512 + 16];
    for (int j = 0; j < BK; j++) {
        if (j >= n) {
            for (int e = 0; e < D / 2; e++) kt[(size_t)e * BK + j] = 0;
            continue;
        }
        const int64_t slot = a->slots[j0 + j];
        if (slot < 0 || slot >= a->num_slots) return -2;
        const size_t r = (size_t)slot * Hkv + h;
        const float sc = half == 2 ? a->ks[r] : 1.0f;
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(row[0] + d, _mm256_mul_ps(hs_ld8(a->k, r * D + d, half), _mm256_set1_ps(sc)));
        for (int d = 0; d < D; d += 16) {
            uint32_t pr[8];
            _mm256_storeu_si256((__m256i *)pr, bf_pairs16(row[0] + d));
            for (int e = 0; e < 8; e++) kt[(size_t)(d / 2 + e) * BK + j] = pr[e];
        }
    }
    for (int u = 0; u < BK / 2; u++) {
        for (int w = 0; w < 2; w++) {
            const int j = 2 * u + w;
            float *dst = row[w];
            if (j >= n) {
                memset(dst, 0, sizeof(float) * Dvp);
                continue;
            }
            const int64_t slot = a->slots[j0 + j]; /* checked above */
            const size_t r = (size_t)slot * Hkv + h;
            const __m256 sc = _mm256_set1_ps(half == 2 ? a->vs[r] : 1.0f);
            for (int d = 0; d < Dv; d += 8)
                _mm256_storeu_ps(dst + d, _mm256_mul_ps(hs_ld8(a->v, r * Dv + d, half), sc));
            for (int d = Dv; d < Dvp; d++) dst[d] = 0.0f;
        }
        for (int c = 0; c < Dvp; c += 16) {
            const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row[0] + c)));
            const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row[1] + c)));
            _mm512_storeu_si512(vt + (size_t)u * Dvp + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
    return 0;
}

/* s[i][0..32) = q[i] . k[0..32) for rows i < mr: q [mr][D / 2] bf16 pairs, kt [D / 2][BK]. */
static inline __attribute__((always_inline)) void qk_block_bf(const uint32_t *q, int D,
                                                              const uint32_t *kt, float *s,
                                                              const int mr) {
    __m512 acc[MR][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int e = 0; e < D / 2; e++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + (size_t)e * BK);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + (size_t)e * BK + 16);
        for (int i = 0; i < mr; i++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)q[(size_t)i * (D / 2) + e]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], b, k0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], b, k1);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm512_storeu_ps(s + (size_t)i * BK, acc[i][0]);
        _mm512_storeu_ps(s + (size_t)i * BK + 16, acc[i][1]);
    }
}

/* o[i][0..16 nv) += sum_{u < nu} p[i] pair u * vt[u][0..16 nv): p [mr][BK / 2] bf16 pairs of
 * weights, vt [BK / 2][Dvp] (o row stride Dvp). */
static inline __attribute__((always_inline)) void pv_block_bf(const uint32_t *p, const uint32_t *vt,
                                                              int nu, int Dvp, float *o,
                                                              const int mr, const int nv) {
    __m512 acc[MR][2];
    for (int i = 0; i < mr; i++)
        for (int w = 0; w < nv; w++) acc[i][w] = _mm512_loadu_ps(o + (size_t)i * Dvp + 16 * w);
    for (int u = 0; u < nu; u++) {
        __m512bh v[2];
        for (int w = 0; w < nv; w++) v[w] = (__m512bh)_mm512_loadu_si512(vt + (size_t)u * Dvp + 16 * w);
        for (int i = 0; i < mr; i++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)p[(size_t)i * (BK / 2) + u]);
            for (int w = 0; w < nv; w++) acc[i][w] = _mm512_dpbf16_ps(acc[i][w], b, v[w]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int w = 0; w < nv; w++) _mm512_storeu_ps(o + (size_t)i * Dvp + 16 * w, acc[i][w]);
}
#endif

/* Phase 1 item `it`: key tile tlo + it / Hkv of KV head it % Hkv into kbuf / vbuf. */
static inline __attribute__((always_inline)) void tile_impl(void *ctx, int it, const int half) {
    pf_t *a = (pf_t *)ctx;
    const int h = it % a->Hkv, i = it / a->Hkv, j0 = (a->tlo + i) * BK, L = a->start + a->T;
    const size_t at = (size_t)h * a->ntiles + i;
    float *kt = a->kbuf + at * a->kst, *vt = a->vbuf + at * a->vst;
    const int n = L - j0 < BK ? L - j0 : BK;
#if PF_BF16
    if (a->bf) {
        if (load_tile_bf(a, h, j0, n, (uint32_t *)kt, (uint32_t *)vt, half) != 0)
            __atomic_store_n(&a->err, -2, __ATOMIC_RELAXED);
        return;
    }
#endif
    if (load_tile(a, h, j0, n, BK, kt, vt, half) != 0)
        __atomic_store_n(&a->err, -2, __ATOMIC_RELAXED);
}

/* s[i][0..16) = q[i] . kt[:, 0..16) for rows i < mr: q [mr][D] (row stride D), kt [D][BK],
 * s row stride BK. */
static inline __attribute__((always_inline)) void qk_block(const float *q, int D, const float *kt,
                                                           float *s, const int mr) {
    __m256 acc[MR][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        const __m256 k0 = _mm256_loadu_ps(kt + (size_t)d * BK), k1 = _mm256_loadu_ps(kt + (size_t)d * BK + 8);
        for (int i = 0; i < mr; i++) {
            const __m256 b = _mm256_broadcast_ss(q + (size_t)i * D + d);
            acc[i][0] = _mm256_fmadd_ps(b, k0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(b, k1, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(s + (size_t)i * BK, acc[i][0]);
        _mm256_storeu_ps(s + (size_t)i * BK + 8, acc[i][1]);
    }
}

/* o[i][0..16) += sum_{j < nc} p[i][j] * vt[j][0..16) for rows i < mr (o row stride Dvp). */
static inline __attribute__((always_inline)) void pv_block(const float *p, const float *vt, int nc,
                                                           int Dvp, float *o, const int mr) {
    __m256 acc[MR][2];
    for (int i = 0; i < mr; i++) {
        acc[i][0] = _mm256_loadu_ps(o + (size_t)i * Dvp);
        acc[i][1] = _mm256_loadu_ps(o + (size_t)i * Dvp + 8);
    }
    for (int j = 0; j < nc; j++) {
        const __m256 v0 = _mm256_loadu_ps(vt + (size_t)j * Dvp), v1 = _mm256_loadu_ps(vt + (size_t)j * Dvp + 8);
        for (int i = 0; i < mr; i++) {
            const __m256 b = _mm256_broadcast_ss(p + (size_t)i * BK + j);
            acc[i][0] = _mm256_fmadd_ps(b, v0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(b, v1, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(o + (size_t)i * Dvp, acc[i][0]);
        _mm256_storeu_ps(o + (size_t)i * Dvp + 8, acc[i][1]);
    }
}

/* Software prefetch of the next key tile while this one is multiplied: `left` bytes from p,
 * a few lines per microkernel call. Past about 2k tokens the widened tiles (1 KiB a key and
 * KV head at D = 128) outgrow the last-level cache, and the microkernels' strided reads of a
 * tile fresh from memory left the 8k prompt at 0.7x its 2k rate. */
typedef struct {
    const char *p;
    long left;
} pf_cursor;

static inline void prefetch_some(pf_cursor *c, int lines) {
    for (; lines > 0 && c->left > 0; lines--, c->p += 64, c->left -= 64) _mm_prefetch(c->p, _MM_HINT_T1);
}

/* The row-count switch: one unrolled copy of each block per remainder. */
#define BY_ROWS(mr, call)                                                                          \
    switch (mr) {                                                                                  \
    case 6: call(6); break;                                                                        \
    case 5: call(5); break;                                                                        \
    case 4: call(4); break;                                                                        \
    case 3: call(3); break;                                                                        \
    case 2: call(2); break;                                                                        \
    default: call(1); break;                                                                       \
    }

/* Masks row r's scores of keys [j0, j0 + nc) to its valid range [vlo, vhi) (absolute
 * positions), folds the tile into its running max m / sum l and rescales its output o; its
 * scores become the weights of the tile's keys (0 outside the range). */
static void online_softmax(float *s, int j0, int nc, int vlo, int vhi, float *m, float *l,
                           float *o, int Dvp) {
    const int a = vlo > j0 ? vlo - j0 : 0, b = vhi - j0 < nc ? vhi - j0 : nc;
    if (a >= b) { /* no valid key here: weights 0, state unchanged */
        memset(s, 0, sizeof(float) * nc);
        return;
    }
    for (int j = 0; j < a; j++) s[j] = -INFINITY;
    for (int j = b; j < nc; j++) s[j] = -INFINITY;
    __m256 vmx = _mm256_set1_ps(*m); /* -inf before the row's first key */
    for (int j = 0; j < nc; j += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(s + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float m_new = _mm_cvtss_f32(m4);
    const __m256 vm = _mm256_set1_ps(m_new);
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < nc; j += 8) { /* hs_exp(-inf) is 0 */
        const __m256 e = hs_exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    const float corr = m_new == *m ? 1.0f : expf(*m - m_new); /* 0 while m is -inf */
    if (corr != 1.0f) {
        const __m256 vc = _mm256_set1_ps(corr);
        for (int d = 0; d < Dvp; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), vc));
    }
    *l = *l * corr + hs_hsum(acc);
    *m = m_new;
}

/* Phase 2 item `it`: query tile it / Hkv of KV head it % Hkv, over the key tiles it sees. */
static void item(void *ctx, int it) {
    pf_t *a = (pf_t *)ctx;
    const int G = a->H / a->Hkv, D = a->D, Dv = a->Dv, Dvp = a->Dvp;
    const int h = it % a->Hkv, t0 = it / a->Hkv * a->bq;
    const int t1 = t0 + a->bq < a->T ? t0 + a->bq : a->T;
    const int R = (t1 - t0) * G;
    const int first = a->start + t0, last = a->start + t1 - 1; /* query positions */
    const int lo = a->window > 0 && first - a->window + 1 > 0 ? first - a->window + 1 : 0;
    /* qs [R][D] (scaled), s [R][BK], o [R][Dvp], m [R], l [R]; bf16: qs [R][D / 2] and the
     * weights p [R][BK / 2] as bf16 pairs (p in the second half of qs's room) */
    const size_t nq = (size_t)R * D, ns = (size_t)R * BK, no = (size_t)R * Dvp;
    float *qs = malloc(sizeof(float) * (nq + ns + no + 2 * (size_t)R + 16));
    if (qs == NULL) {
        __atomic_store_n(&a->err, -1, __ATOMIC_RELAXED);
        return;
    }
    float *s = qs + nq, *o = s + ns, *m = o + no, *l = m + R;
    for (int r = 0; r < R; r++) {
        const int t = t0 + r / G, g = r % G;
        const float *src = a->q + ((size_t)t * a->H + (size_t)h * G + g) * D;
        for (int d = 0; d < D; d++) qs[(size_t)r * D + d] = src[d] * a->scale;
        m[r] = a->sinks ? a->sinks[h * G + g] : -INFINITY;
        l[r] = a->sinks ? 1.0f : 0.0f;
    }
    memset(o, 0, sizeof(float) * no);
#if PF_BF16
    uint32_t *q2 = (uint32_t *)qs, *p2 = q2 + (size_t)R * D / 2;
    if (a->bf) /* in place, row by row: row r's pairs end before row r + 1's floats begin */
        for (int r = 0; r < R; r++)
            for (int d = 0; d < D; d += 16)
                _mm256_storeu_si256((__m256i *)(q2 + ((size_t)r * D + d) / 2), bf_pairs16(qs + (size_t)r * D + d));
#endif
    /* Tiles on the BK grid of positions: a row meets the same tiles whatever chunk and query
     * tile it is in, so its arithmetic (and result) does not depend on the chunking. */
    const int cw = a->bf ? 32 : 16; /* a block's columns: keys (QK), V columns (PV) */
    for (int j0 = lo / BK * BK; j0 <= last; j0 += BK) {
        const int n = last + 1 - j0 < BK ? last + 1 - j0 : BK, nc = (n + cw - 1) & -cw;
        const size_t at = (size_t)h * a->ntiles + (j0 / BK - a->tlo);
        const float *kt = a->kbuf + at * a->kst, *vt = a->vbuf + at * a->vst;
        /* the next tile's K then V, spread over this tile's ceil(R / MR) * (BK + Dvp) / cw
         * microkernel calls (tiles of a head are consecutive in kbuf and in vbuf) */
        const int more = j0 + BK <= last;
        pf_cursor ck = {(const char *)(kt + a->kst), more ? (long)(sizeof(float) * a->kst) : 0};
        pf_cursor cv = {(const char *)(vt + a->vst), more ? (long)(sizeof(float) * a->vst) : 0};
        const int calls = (R + MR - 1) / MR * (BK + Dvp) / cw;
        const int per = (int)((ck.left + cv.left) / 64 / calls) + 1;
        for (int rb = 0; rb < R; rb += MR) {
            const int mr = R - rb < MR ? R - rb : MR;
            for (int jc = 0; jc < nc; jc += cw) {
                prefetch_some(ck.left > 0 ? &ck : &cv, per);
#if PF_BF16
                if (a->bf) {
#define QK(c) qk_block_bf(q2 + (size_t)rb * D / 2, D, (const uint32_t *)kt + jc, s + (size_t)rb * BK + jc, c)
                    BY_ROWS(mr, QK)
#undef QK
                    continue;
                }
#endif
#define QK(c) qk_block(qs + (size_t)rb * D, D, kt + jc, s + (size_t)rb * BK + jc, c)
                BY_ROWS(mr, QK)
#undef QK
            }
        }
        for (int r = 0; r < R; r++) {
            const int pos = a->start + t0 + r / G;
            const int vlo = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
            float *sr = s + (size_t)r * BK;
            online_softmax(sr, j0, nc, vlo, pos + 1, m + r, l + r, o + (size_t)r * Dvp, Dvp);
#if PF_BF16
            if (a->bf) /* the row's weights as bf16 pairs for pv_block_bf */
                for (int j = 0; j < nc; j += 32)
                    _mm512_storeu_si512(p2 + ((size_t)r * BK + j) / 2,
                                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + j + 16),
                                                                      _mm512_loadu_ps(sr + j)));
#endif
        }
        for (int rb = 0; rb < R; rb += MR) {
            const int mr = R - rb < MR ? R - rb : MR;
            for (int dc = 0; dc < Dvp; dc += cw) {
                prefetch_some(ck.left > 0 ? &ck : &cv, per);
#if PF_BF16
                if (a->bf) {
                    const int nv = Dvp - dc >= 32 ? 2 : 1;
#define PV(c)                                                                                      \
    (nv == 2 ? pv_block_bf(p2 + (size_t)rb * BK / 2, (const uint32_t *)vt + dc, nc / 2, Dvp,       \
                           o + (size_t)rb * Dvp + dc, c, 2)                                        \
             : pv_block_bf(p2 + (size_t)rb * BK / 2, (const uint32_t *)vt + dc, nc / 2, Dvp,       \
                           o + (size_t)rb * Dvp + dc, c, 1))
                    BY_ROWS(mr, PV)
#undef PV
                    continue;
                }
#endif
#define PV(c) pv_block(s + (size_t)rb * BK, vt + dc, nc, Dvp, o + (size_t)rb * Dvp + dc, c)
                BY_ROWS(mr, PV)
#undef PV
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const int t = t0 + r / G, g = r % G;
        float *dst = a->out + ((size_t)t * a->H + (size_t)h * G + g) * Dv;
        const float inv = 1.0f / l[r];
        for (int d = 0; d < Dv; d++) dst[d] = o[(size_t)r * Dvp + d] * inv;
    }
    free(qs);
}

/* One specialised copy per cache element type (the constant folds every load's branch). */
static void tile_f32(void *ctx, int it) { tile_impl(ctx, it, 0); }
static void tile_f16(void *ctx, int it) { tile_impl(ctx, it, 1); }
static void tile_i8(void *ctx, int it) { tile_impl(ctx, it, 2); }

/* Whether bf16 products apply to these sizes (and this build has them). */
static int bf_ok(int D, int Dv) {
    return PF_BF16 && D % 16 == 0 && Dv % 16 == 0 && D <= 512 && Dv <= 512;
}

static int run(int nthreads, int T, int start, int H, int Hkv, int D, int Dv, int window,
               long num_slots, float scale, const float *sinks, const float *q, const void *k,
               const void *v, const int64_t *slots, float *out, const float *ks, const float *vs,
               int half, int bf) {
    if (Hkv <= 0 || H % Hkv != 0 || T < 0 || start < 0 || D <= 0 || Dv <= 0) return -3;
    if (T == 0) return 0;
    bf = bf && bf_ok(D, Dv);
    const int G = H / Hkv, bq = ROWS / G > 0 ? ROWS / G : 1, Dvp = (Dv + 15) & ~15;
    const int lo = window > 0 && start - window + 1 > 0 ? start - window + 1 : 0;
    const int tlo = lo / BK, ntiles = (start + T + BK - 1) / BK - tlo;
    /* Phase 1: every key tile widened and laid out once, for all the query tiles reading it
     * (per query tile it cost ~7% of the products at 48 rows). */
    const size_t kst = (size_t)D * BK / (bf ? 2 : 1), vst = (size_t)BK * Dvp / (bf ? 2 : 1);
    float *kbuf = malloc(sizeof(float) * (size_t)ntiles * Hkv * (kst + vst));
    if (kbuf == NULL) return -1;
    pf_t a = {T, start, H, Hkv, D, Dv, Dvp, window, bq, bf, kst, vst, tlo, ntiles, num_slots,
              scale, sinks, q, k, v, ks, vs, slots, out, kbuf,
              kbuf + (size_t)Hkv * ntiles * kst, 0};
    hs_parallel_for(nthreads, ntiles * Hkv, half == 2 ? tile_i8 : half ? tile_f16 : tile_f32, &a);
    /* Phase 2: a KV head's query tiles, each over the key tiles it sees. */
    const int tiles = (T + bq - 1) / bq;
    if (a.err == 0)
        hs_parallel_for(nthreads, tiles * Hkv, item, &a);
    free(kbuf);
    return a.err;
}

/* q [T, H, D] (rows at positions start..start+T-1); k [num_slots, Hkv, D], v [num_slots, Hkv,
 * Dv] (the paged cache, fp32); slots [start + T]: the cache slot of every context token;
 * out [T, H, Dv]; window <= 0: none; sinks [H] or NULL; bf: bf16 products where
 * hetserve_prefill_bf16_ok(D, Dv) (else fp32, as with bf = 0).
 * Returns 0, -1 when out of memory, -2 when a slot is outside [0, num_slots), -3 on bad
 * shapes. */
int hetserve_prefill_attention(int nthreads, int T, int start, int H, int Hkv, int D, int Dv,
                               int window, long num_slots, float scale, const float *sinks,
                               const float *q, const float *k, const float *v,
                               const int64_t *slots, float *out, int bf) {
    return run(nthreads, T, start, H, Hkv, D, Dv, window, num_slots, scale, sinks, q, k, v, slots,
               out, NULL, NULL, 0, bf);
}

/* The same over an fp16 cache: k, v hold IEEE half bits. */
int hetserve_prefill_attention_f16(int nthreads, int T, int start, int H, int Hkv, int D, int Dv,
                                   int window, long num_slots, float scale, const float *sinks,
                                   const float *q, const uint16_t *k, const uint16_t *v,
                                   const int64_t *slots, float *out, int bf) {
    return run(nthreads, T, start, H, Hkv, D, Dv, window, num_slots, scale, sinks, q, k, v, slots,
               out, NULL, NULL, 1, bf);
}

/* The same over an int8 cache: ks [num_slots, Hkv] and vs are the rows' scales. */
int hetserve_prefill_attention_i8(int nthreads, int T, int start, int H, int Hkv, int D, int Dv,
                                  int window, long num_slots, float scale, const float *sinks,
                                  const float *q, const int8_t *k, const int8_t *v,
                                  const int64_t *slots, float *out, const float *ks,
                                  const float *vs, int bf) {
    return run(nthreads, T, start, H, Hkv, D, Dv, window, num_slots, scale, sinks, q, k, v, slots,
               out, ks, vs, 2, bf);
}

/* 1 where this build multiplies in bf16 for heads of D / Dv dimensions when asked, else 0. */
int hetserve_prefill_bf16_ok(int D, int Dv) { return bf_ok(D, Dv); }
