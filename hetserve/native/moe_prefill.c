/* The routed experts' phases on the GEMM tiles (moe_gemm.h): what a work item of
 * hetserve_moe_forward runs where its expert has many pairs (prefill) and its weights are int8
 * with one scale per row. Each item covers whole strips of 16 rows (4 quads, the callers make
 * items of whole strips); per strip the panel is packed once and met by all of the expert's
 * pairs, PB at a time (their int16 rows packed once per item for all its strips: amx_item).
 * Out of memory for its scratch, an item returns -1 having written nothing, and the caller
 * runs it on the quad path. The float steps after the integer sums are phase1 / phase2's own
 * (moe_kernels.c), in the same order, so the results are theirs bit for bit. */
/* No implicit fused multiply-adds: the decode and GEMM paths round the same float steps the same
 * way (a contraction GCC chose in one and not the other changed last bits). */
#pragma GCC optimize("fp-contract=off")
#include <stdlib.h>

#include "moe_amx.h"
#include "moe_gemm.h"
#include "moe_job.h"
#include "moe_kgemm.h"

#define PB 96 /* pairs per block: their sums wait in scratch, their rows stay in L2 */

/* The epilogues every tile path shares, in the row kernels' float steps. Phase 1, pair p of a
 * strip of GEMM_ROWS gate rows from i0: its gate and up sums g, u (each times its row's scale
 * gs / us where the tiles leave them out, else NULL), times the activation row's scale xs (1
 * where the sums carry it: x * 1 is x), plus the bias; act(gate, up) times the router weight
 * into a[p, i0 ..]. */
static inline void strip_gate(const job_t *j, int p, int i0, const float *g, const float *u,
                              const float *gs, const float *us, float xs, const float *b13) {
    const int I = j->I;
    float gl[GEMM_ROWS], ul[GEMM_ROWS], wl[GEMM_ROWS];
    for (int r = 0; r < GEMM_ROWS; r++) {
        const float gv = gs ? g[r] * gs[r] : g[r], uv = us ? u[r] * us[r] : u[r];
        gl[r] = gv * xs + (b13 ? b13[i0 + r] : 0.0f);
        ul[r] = uv * xs + (b13 ? b13[I + i0 + r] : 0.0f);
        wl[r] = j->pw[p];
    }
    gate_lanes(j, gl, ul, wl, j->a + (size_t)p * I + i0, GEMM_ROWS);
}

/* Phase 2, pair p of a strip of W2 rows from n0: its sums o (times the rows' scales s2 [H] where
 * given) times the activation row's scale as, plus router weight x bias, into y[p, n0 ..]. */
static inline void strip_down(const job_t *j, int p, int n0, const float *o, const float *s2,
                              float as, const float *b2) {
    const float pw = j->pw[p];
    float *y = j->y + (size_t)p * j->H + n0;
    for (int r = 0; r < GEMM_ROWS; r++)
        y[r] = (s2 ? o[r] * s2[n0 + r] : o[r]) * as + (b2 ? pw * b2[n0 + r] : 0.0f);
}

typedef struct {
    int16_t *panel[2]; /* [K / 2][16][2] each: gate and up (phase 1) or one (phase 2) */
    int32_t *isum;     /* [PB][16] */
    float *out[2];     /* [PB][16] */
} strips_t;

/* Scratch for K inputs, or NULL when out of memory. */
static char *strips_alloc(strips_t *s, int K) {
    const size_t panel = (size_t)K * GEMM_ROWS * sizeof(int16_t);
    const size_t sums = (size_t)PB * GEMM_ROWS * sizeof(float);
    char *buf = aligned_alloc(64, 2 * panel + 3 * sums);
    if (buf == NULL) return NULL;
    s->panel[0] = (int16_t *)buf;
    s->panel[1] = (int16_t *)(buf + panel);
    s->isum = (int32_t *)(buf + 2 * panel);
    s->out[0] = (float *)(buf + 2 * panel + sums);
    s->out[1] = (float *)(buf + 2 * panel + 2 * sums);
    return buf;
}

/* Phase 1 for units (quads of gate rows) [u0, u1) of active expert ai; u0 - ai * per and
 * u1 - u0 multiples of 4. Quantized W13 stores a gate quad, then its up quad (moe_kernels.c). */
int hs_phase1_gemm(const job_t *j, int ai, int u0, int u1) {
    const int H = j->H, I = j->I, per = I / 4;
    const int e = j->act_e[ai], off = j->act_off[ai], cnt = j->act_cnt[ai];
    const int8_t *w = (const int8_t *)j->w13 + (size_t)e * 2 * I * H;
    const float *s13 = (const float *)j->s13 + (size_t)e * 2 * I;
    const float *b13 = j->b13 ? j->b13 + (size_t)e * 2 * I : NULL;
    strips_t s;
    char *buf = strips_alloc(&s, H);
    if (buf == NULL) return -1;
    amx_rows_t ax = {0};
    if (amx_item(&ax, j->x16, j->tok + off, cnt, H, j->a8) < 0) {
        free(buf);
        return -1;
    }
    for (int v = u0 - ai * per; v < u1 - ai * per; v += 4) { /* strip: gate rows 4v .. 4v + 15 */
        const int i0 = 4 * v;
        const int8_t *gq[4], *uq[4];
        for (int q = 0; q < 4; q++) {
            gq[q] = w + (size_t)(2 * (v + q)) * 4 * H;
            uq[q] = gq[q] + (size_t)4 * H;
        }
        strip_pack(&ax, gq, H, s.panel[0]);
        strip_pack(&ax, uq, H, s.panel[1]);
        float sg[GEMM_ROWS], su[GEMM_ROWS]; /* the rows' scales: gate quad, then its up quad */
        for (int r = 0; r < GEMM_ROWS; r++)
            sg[r] = s13[8 * (v + r / 4) + r % 4], su[r] = s13[8 * (v + r / 4) + 4 + r % 4];
        for (int p0 = 0; p0 < cnt; p0 += PB) {
            const int n = cnt - p0 < PB ? cnt - p0 : PB;
            /* the item's next strip: its 4 gate and 4 up quads, 32 H bytes on from these */
            const char *next = p0 == 0 && v + 4 < u1 - ai * per
                                   ? (const char *)(w + (size_t)(2 * (v + 4)) * 4 * H)
                                   : NULL;
            strip_sums(&ax, s.panel[0], H, p0, n, s.isum, s.out[0], next);
            strip_sums(&ax, s.panel[1], H, p0, n, s.isum, s.out[1],
                       next ? next + (size_t)16 * H : NULL);
            for (int m = 0; m < n; m++) {
                const int p = off + p0 + m;
                strip_gate(j, p, i0, s.out[0] + m * GEMM_ROWS, s.out[1] + m * GEMM_ROWS, sg, su,
                           j->xsc[j->tok[p]], b13);
            }
        }
    }
    amx_item_end(&ax);
    free(buf);
    return 0;
}

/* Phase 2 for units (quads of W2 rows) [u0, u1) of active expert ai, whole strips. */
int hs_phase2_gemm(const job_t *j, int ai, int u0, int u1) {
    const int H = j->H, I = j->I, per = H / 4;
    const int e = j->act_e[ai], off = j->act_off[ai], cnt = j->act_cnt[ai];
    const int8_t *w = (const int8_t *)j->w2 + (size_t)e * H * I;
    const float *s2 = (const float *)j->s2 + (size_t)e * H;
    const float *b2 = j->b2 ? j->b2 + (size_t)e * H : NULL;
    strips_t s;
    char *buf = strips_alloc(&s, I);
    if (buf == NULL) return -1;
    amx_rows_t ax = {0};
    if (amx_item(&ax, j->a16 + (size_t)off * I, NULL, cnt, I, j->a8) < 0) {
        free(buf);
        return -1;
    }
    for (int v = u0 - ai * per; v < u1 - ai * per; v += 4) { /* strip: rows 4v .. 4v + 15 */
        const int n0 = 4 * v;
        const int8_t *q[4];
        for (int k = 0; k < 4; k++) q[k] = w + (size_t)(v + k) * 4 * I;
        strip_pack(&ax, q, I, s.panel[0]);
        for (int p0 = 0; p0 < cnt; p0 += PB) {
            const int n = cnt - p0 < PB ? cnt - p0 : PB;
            const char *next = p0 == 0 && v + 4 < u1 - ai * per /* the item's next strip */
                                   ? (const char *)(w + (size_t)(v + 4) * 4 * I)
                                   : NULL;
            strip_sums(&ax, s.panel[0], I, p0, n, s.isum, s.out[0], next);
            for (int m = 0; m < n; m++) {
                const int p = off + p0 + m;
                strip_down(j, p, n0, s.out[0] + m * GEMM_ROWS, s2, j->asc[p], b2);
            }
        }
    }
    amx_item_end(&ax);
    free(buf);
    return 0;
}

/* ---- The K-quants, the 4-bit i-quants and grouped int8 (GGUF q8_0) on the tiles of
 * moe_kgemm.h: phase 1 / phase 2 ---- */

#define KG_TBK 512 /* tokens widened at once (x16: 512 x K int16) */

static inline int kg_unit_rows(int fmt) {
    return fmt == F_MXFP4 || fmt == F_I4 ? TILE_ROWS : fmt == F_Q4K ? 8 : 4; /* unit_rows */
}

/* The 4 quads of the strip whose first unit starts at row `row` of the [E * N, K] matrix w
 * (grouped int8: fp16 scales sv, G columns each), its units of R rows `stride` rows apart (W13
 * alternates gate and up units). */
static void kg_quads(int fmt, int G, const void *w, const void *sv, int K, size_t row,
                     int stride, kg_quad_t q[4]) {
    if (fmt == F_I4) { /* one tile of 16 rows, its groups' scales and minimums inside */
        const kg_quad_t tile = {(const uint8_t *)w + row / TILE_ROWS * I4_TILE_BYTES(K, G), 1, 0,
                                NULL};
        q[0] = tile;
        return;
    }
    if (fmt == F_MXFP4) { /* one tile of 16 rows */
        const kg_quad_t tile = {(const uint8_t *)w + row * (K / 2), 1, 0,
                                (const uint8_t *)sv + row * (K / 32)};
        q[0] = tile;
        return;
    }
    /* bytes per row: int8's K, the K-quants' blocks (q4_K: 144 per 256) */
    const size_t rb = fmt == F_I8 ? (size_t)K : (size_t)(K / Q4K_SB) * kq_bytes(fmt);
    const uint8_t *b = (const uint8_t *)w;
    for (int t = 0; t < 4; t++) {
        const int unit = fmt == F_Q4K ? t / 2 : t; /* q4_K: a unit is a pair of quads */
        const size_t r = row + (size_t)unit * stride;
        const kg_quad_t one = {b + r * rb, fmt == F_Q4K ? 2 : 1, fmt == F_Q4K ? t % 2 : 0,
                               fmt == F_I8 ? (const uint16_t *)sv + r * (K / G) : NULL};
        q[t] = one;
    }
}

typedef struct {
    kg_strip_t st[2];
    int16_t *x16, *ms;
    int32_t *xp; /* the block's activation rows packed for the tiles (gemm_pack_x) */
    int32_t *isum;
    float *out[2];
    char *buf;
} kg_scratch_t;

/* Scratch for `strips` strips of K columns and, unless the activations are read in place
 * (wide = 0), the widened rows of up to `tokens` tokens. */
static int kg_scratch(kg_scratch_t *s, int K, int strips, int tokens, int wide) {
    const size_t sb = kg_strip_bytes(K), nsb = (size_t)(K / Q4K_SB);
    const size_t nt = wide ? (size_t)(tokens < KG_TBK ? tokens : KG_TBK) : 0;
    const size_t x = nt * K * 2, ms = nt * nsb * KG_MS * 2;
    const size_t sums = (size_t)PB * GEMM_ROWS * 4;
    const size_t xp = (gemm_xp_bytes(tokens < KG_TBK ? tokens : KG_TBK, K) + 63) / 64 * 64;
    s->buf = aligned_alloc(64, xp + (strips * sb + x + ms + 3 * sums + 63) / 64 * 64);
    if (s->buf == NULL) return -1;
    char *p = s->buf;
    s->xp = (int32_t *)p, p += xp;
    for (int i = 0; i < strips; i++, p += sb) kg_strip_init(&s->st[i], p, K);
    s->x16 = (int16_t *)p, p += x;
    s->ms = (int16_t *)p, p += ms;
    s->isum = (int32_t *)p, p += sums;
    s->out[0] = (float *)p, p += sums;
    s->out[1] = (float *)p;
    return 0;
}

/* Widens tokens [t0, t0 + n) of the expert's pairs (pair off + t: activation row rows[t]). */
static void kg_widen_block(const job_t *j, int which, int fmt, int K, const int *rows, int n,
                           kg_scratch_t *s) {
    const int nsb = K / Q4K_SB;
    const int8_t *pl = which == 1 ? j->xpl : j->apl;
    const int16_t *ps = which == 1 ? j->xps : j->aps;
    for (int m = 0; m < n; m++)
        kg_widen(fmt, pl + (size_t)rows[m] * K, ps + (size_t)rows[m] * nsb * 16, K,
                 s->x16 + (size_t)m * K, s->ms + (size_t)m * nsb * KG_MS);
}

/* int8, MXFP4 and int4: their int16 activation rows and per-row scales are read in place. */
static inline int kg_in_place(int fmt) {
    return fmt == F_I8 || fmt == F_MXFP4 || fmt == F_I4;
}

/* The tiles' scales of activation row r of phase `which` (a token for phase 1, a pair for
 * phase 2; K its columns), row m of the widened block s where the format is not read in place
 * (the rows themselves: kg_pack_block). */
static inline void kg_act(const job_t *j, int which, int fmt, int K, int G, size_t r, int m,
                          const kg_scratch_t *s, const int16_t **ms, const float **xd,
                          const float **xg) {
    const int nsb = K / Q4K_SB, in_place = kg_in_place(fmt);
    *ms = s->ms + (size_t)m * nsb * KG_MS;
    *xd = in_place ? (which == 1 ? j->xsc : j->asc) + r : (which == 1 ? j->xpd : j->apd) + r * nsb;
    *xg = fmt == F_I4 ? (which == 1 ? j->xgs : j->ags) + r * (K / G) : NULL;
}

/* Packs the block's nt activation rows for the tiles into s->xp: the widened ones, or those
 * read in place (rows[m]: a token for phase 1, a pair for phase 2). */
static void kg_pack_block(const job_t *j, int which, int fmt, int K, const int *rows, int nt,
                          kg_scratch_t *s) {
    if (kg_in_place(fmt)) gemm_pack_x(which == 1 ? j->x16 : j->a16, rows, nt, K, s->xp);
    else gemm_pack_x(s->x16, NULL, nt, K, s->xp);
}

/* Phase 1 for units [u0, u1) of active expert ai on the K-quant tiles: whole strips (16 gate
 * rows) only, else -1 with nothing written (the caller runs the row kernels), as when out of
 * memory. */
int hs_phase1_kgemm(const job_t *j, int ai, int u0, int u1) {
    const int H = j->H, I = j->I, fmt = jfmt(j, 1), R = kg_unit_rows(fmt), su = GEMM_ROWS / R;
    const int per = I / R, G = jg(j, 1), gk = kg_group(fmt, G);
    const int i8 = kg_in_place(fmt);
    const int e = j->act_e[ai], off = j->act_off[ai], cnt = j->act_cnt[ai];
    if ((u0 - ai * per) % su || (u1 - u0) % su) return -1;
    const float *b13 = j->b13 ? j->b13 + (size_t)e * 2 * I : NULL;
    kg_scratch_t s;
    if (kg_scratch(&s, H, 2, cnt, !i8) != 0) return -1;
    for (int t0 = 0; t0 < cnt; t0 += KG_TBK) {
        const int nt = cnt - t0 < KG_TBK ? cnt - t0 : KG_TBK;
        if (!i8) kg_widen_block(j, 1, fmt, H, j->tok + off + t0, nt, &s);
        kg_pack_block(j, 1, fmt, H, j->tok + off + t0, nt, &s);
        for (int v = u0 - ai * per; v < u1 - ai * per; v += su) { /* gate rows R v .. R v + 15 */
            const int i0 = R * v;
            kg_quad_t gq[4], uq[4];
            const size_t row = (size_t)e * 2 * I + 2 * (size_t)R * v;
            kg_quads(fmt, G, j->w13, j->s13, H, row, 2 * R, gq);
            kg_quads(fmt, G, j->w13, j->s13, H, row + R, 2 * R, uq);
            kg_pack(fmt, G, gq, H, &s.st[0]);
            kg_pack(fmt, G, uq, H, &s.st[1]);
            for (int p0 = 0; p0 < nt; p0 += PB) {
                const int n = nt - p0 < PB ? nt - p0 : PB;
                const int16_t *ms[PB];
                const float *xd[PB], *xg[PB];
                for (int m = 0; m < n; m++)
                    kg_act(j, 1, fmt, H, G, (size_t)j->tok[off + t0 + p0 + m], p0 + m, &s, &ms[m],
                           &xd[m], &xg[m]);
                const int span = i8 ? H : Q4K_SB;
                const int32_t *xp = s.xp + (size_t)p0 * (H / 2);
                kg_strip_gemm(&s.st[0], fmt, H, gk, span, xp, xd, ms, xg, n, s.isum, s.out[0],
                              NULL);
                kg_strip_gemm(&s.st[1], fmt, H, gk, span, xp, xd, ms, xg, n, s.isum, s.out[1],
                              NULL);
                for (int m = 0; m < n; m++) /* scales inside the sums (kg_strip_gemm) */
                    strip_gate(j, off + t0 + p0 + m, i0, s.out[0] + m * GEMM_ROWS,
                               s.out[1] + m * GEMM_ROWS, NULL, NULL, 1.0f, b13);
            }
        }
    }
    free(s.buf);
    return 0;
}

/* Phase 2 for units [u0, u1) of active expert ai on the K-quant tiles (as phase 1). */
int hs_phase2_kgemm(const job_t *j, int ai, int u0, int u1) {
    const int H = j->H, I = j->I, fmt = jfmt(j, 2), R = kg_unit_rows(fmt), su = GEMM_ROWS / R;
    const int per = H / R, G = jg(j, 2), gk = kg_group(fmt, G);
    const int i8 = kg_in_place(fmt);
    const int e = j->act_e[ai], off = j->act_off[ai], cnt = j->act_cnt[ai];
    if ((u0 - ai * per) % su || (u1 - u0) % su) return -1;
    const float *b2 = j->b2 ? j->b2 + (size_t)e * H : NULL;
    kg_scratch_t s;
    if (kg_scratch(&s, I, 1, cnt, !i8) != 0) return -1;
    int rows[KG_TBK];
    for (int t0 = 0; t0 < cnt; t0 += KG_TBK) {
        const int nt = cnt - t0 < KG_TBK ? cnt - t0 : KG_TBK;
        for (int m = 0; m < nt; m++) rows[m] = off + t0 + m;
        if (!i8) kg_widen_block(j, 2, fmt, I, rows, nt, &s);
        kg_pack_block(j, 2, fmt, I, rows, nt, &s);
        for (int v = u0 - ai * per; v < u1 - ai * per; v += su) { /* rows R v .. R v + 15 */
            const int n0 = R * v;
            kg_quad_t q[4];
            kg_quads(fmt, G, j->w2, j->s2, I, (size_t)e * H + n0, R, q);
            kg_pack(fmt, G, q, I, &s.st[0]);
            for (int p0 = 0; p0 < nt; p0 += PB) {
                const int n = nt - p0 < PB ? nt - p0 : PB;
                const int16_t *ms[PB];
                const float *xd[PB], *xg[PB];
                for (int m = 0; m < n; m++)
                    kg_act(j, 2, fmt, I, G, (size_t)(off + t0 + p0 + m), p0 + m, &s, &ms[m], &xd[m],
                           &xg[m]);
                kg_strip_gemm(&s.st[0], fmt, I, gk, i8 ? I : Q4K_SB,
                              s.xp + (size_t)p0 * (I / 2), xd, ms, xg, n, s.isum,
                              s.out[0], NULL);
                for (int m = 0; m < n; m++)
                    strip_down(j, off + t0 + p0 + m, n0, s.out[0] + m * GEMM_ROWS, NULL, 1.0f,
                               b2);
            }
        }
    }
    free(s.buf);
    return 0;
}

/* 1 where the expert GEMMs run on AMX tiles in this process (an AMX build, the tiles granted;
 * an emulated build says 1 too), else 0. */
int hetserve_amx_ready(void) {
#ifdef HS_AMX
    return amx_ready();
#else
    return 0;
#endif
}

/* ---- FP8 experts on bf16 tiles (AVX512-BF16 + GFNI builds) ----
 *
 * The row kernel (quad_fp8_bf16) converts each 64 weights to bf16 again for every two pairs; at
 * prefill an expert's strip of 16 rows is converted once into the int16 tiles' panel layout
 * ([K / 2][16 rows][2] bf16: the e4m3 bits moved by the same GFNI affine ops, exact, value x
 * 2^-120) and met by all its pairs, 12 at a time: per input pair one vdpbf16ps per token for
 * each of the activation row's two bf16 halves (hi, lo: bf16_rows), into fp32 lanes, one per
 * row. Per group of G inputs the lanes are scaled by the rows' group scales and added up, then
 * the same epilogue as the row kernels' (times the activation row's scale, bias, gate). The
 * fp32 sums run in another order than the row kernel's (lanes per row here, per input there):
 * results within fp32 rounding of it, not the same bits (tests/moe/test_fp8_tiles.py). */
#if HS_FP8_BF16

/* The 4 FP8 quads q[0..3] ([K / 16][4][16] e4m3 each) as bf16 in panel [K / 2][16][2]. */
static void fp8_pack(const uint8_t *const q[4], int K, int16_t *panel) {
    const __m128i ahi = _mm_set1_epi64x(FP8_BF16_HI), alo = _mm_set1_epi64x(FP8_BF16_LO);
    for (int c = 0; c < K / 16; c++) {
        int16_t *dst = panel + (size_t)c * 8 * 2 * GEMM_ROWS;
        for (int j = 0; j < 4; j++) {
            __m256i r[4];
            for (int x = 0; x < 4; x++) {
                const __m128i v = _mm_loadu_si128((const __m128i *)(q[j] + 64 * (size_t)c + 16 * x));
                const __m128i h = _mm_gf2p8affine_epi64_epi8(v, ahi, 0);
                const __m128i l = _mm_gf2p8affine_epi64_epi8(v, alo, 0);
                r[x] = _mm256_set_m128i(_mm_unpackhi_epi8(l, h), _mm_unpacklo_epi8(l, h));
            }
            gemm_panel_put(r, j, dst);
        }
    }
}

/* c[m][0..15] += sum over input pairs [kp0, kp1) of panel[kp][row] . (token m's hi pair +
 * its lo pair), fp32, for NT <= GEMM_NT tokens packed by gemm_pack_xs (hi in xh, lo in xl). */
static inline __attribute__((always_inline)) void fp8_tile(const int16_t *panel, int kp0,
                                                           int kp1, const int32_t *xh,
                                                           const int32_t *xl, float *const *c,
                                                           const int NT) {
    __m512 ah[GEMM_NT], al[GEMM_NT];
#pragma GCC unroll 12
    for (int m = 0; m < NT; m++) ah[m] = _mm512_loadu_ps(c[m]), al[m] = _mm512_setzero_ps();
    for (int kp = kp0; kp < kp1; kp++) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + (size_t)kp * 2 * GEMM_ROWS);
        const int32_t *hk = xh + (size_t)kp * GEMM_NT, *lk = xl + (size_t)kp * GEMM_NT;
#pragma GCC unroll 12
        for (int m = 0; m < NT; m++) {
            ah[m] = _mm512_dpbf16_ps(ah[m], w, (__m512bh)_mm512_set1_epi32(hk[m]));
            al[m] = _mm512_dpbf16_ps(al[m], w, (__m512bh)_mm512_set1_epi32(lk[m]));
        }
    }
#pragma GCC unroll 12
    for (int m = 0; m < NT; m++) _mm512_storeu_ps(c[m], _mm512_add_ps(ah[m], al[m]));
}

static void fp8_tile_n(const int16_t *panel, int kp0, int kp1, const int32_t *xh,
                       const int32_t *xl, float *const *c, int n) {
    switch (n) {
#define HS_N(v) case v: fp8_tile(panel, kp0, kp1, xh, xl, c, v); break;
    HS_N(1) HS_N(2) HS_N(3) HS_N(4) HS_N(5) HS_N(6)
    HS_N(7) HS_N(8) HS_N(9) HS_N(10) HS_N(11) HS_N(12)
#undef HS_N
    default: break;
    }
}

/* out[m][r] = sum over groups g of sc[g][r] * (the strip's row r against token m over group g)
 * for n tokens packed from the item's first (xh / xl at the block's first token's group); acc:
 * scratch [n][16] fp32. */
static void fp8_strip(const int16_t *panel, int K, int G, const float *sc, const int32_t *xh,
                      const int32_t *xl, int n, float *acc, float *out) {
    for (int i = 0; i < n * GEMM_ROWS; i++) out[i] = 0.0f;
    for (int g = 0; g < K / G; g++) {
        for (int i = 0; i < n * GEMM_ROWS; i++) acc[i] = 0.0f;
        for (int k0 = g * G; k0 < (g + 1) * G; k0 += GEMM_KC) {
            const int k1 = k0 + GEMM_KC < (g + 1) * G ? k0 + GEMM_KC : (g + 1) * G;
            for (int m0 = 0; m0 < n; m0 += GEMM_NT) {
                const int nt = n - m0 < GEMM_NT ? n - m0 : GEMM_NT;
                float *c[GEMM_NT];
                for (int m = 0; m < nt; m++) c[m] = acc + (size_t)(m0 + m) * GEMM_ROWS;
                fp8_tile_n(panel, k0 / 2, k1 / 2, xh + (size_t)m0 * (K / 2),
                           xl + (size_t)m0 * (K / 2), c, nt);
            }
        }
        const __m512 s = _mm512_loadu_ps(sc + (size_t)g * GEMM_ROWS);
        for (int m = 0; m < n; m++) {
            float *o = out + (size_t)m * GEMM_ROWS;
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(acc + (size_t)m * GEMM_ROWS), s,
                                                _mm512_loadu_ps(o)));
        }
    }
}

/* The strip's group scales [K / G][16] from its 4 quads' ([K / G][4] each, sq[j]). */
static void fp8_scales(const float *const sq[4], int ng, float *sc) {
    for (int g = 0; g < ng; g++)
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < 4; r++) sc[(size_t)g * GEMM_ROWS + 4 * j + r] = sq[j][4 * g + r];
}

/* Scratch of one FP8 item: panels (2), strip scales (2), the pairs' packed hi and lo rows,
 * the block's fp32 sums and outputs. */
typedef struct {
    int16_t *panel[2];
    float *sc[2], *acc, *out[2];
    int32_t *xh, *xl;
    char *buf;
} fp8_scratch_t;

static int fp8_scratch(fp8_scratch_t *s, int K, int G, int cnt) {
    const size_t panel = (size_t)K * GEMM_ROWS * 2, scb = (size_t)(K / G) * GEMM_ROWS * 4;
    const size_t xp = (gemm_xp_bytes(cnt, K) + 63) / 64 * 64;
    const size_t sums = (size_t)PB * GEMM_ROWS * 4;
    s->buf = aligned_alloc(64, 2 * panel + 2 * ((scb + 63) / 64 * 64) + 2 * xp + 3 * sums);
    if (s->buf == NULL) return -1;
    char *p = s->buf;
    s->panel[0] = (int16_t *)p, p += panel;
    s->panel[1] = (int16_t *)p, p += panel;
    s->sc[0] = (float *)p, p += (scb + 63) / 64 * 64;
    s->sc[1] = (float *)p, p += (scb + 63) / 64 * 64;
    s->xh = (int32_t *)p, p += xp;
    s->xl = (int32_t *)p, p += xp;
    s->acc = (float *)p, p += sums;
    s->out[0] = (float *)p, p += sums;
    s->out[1] = (float *)p;
    return 0;
}

int hs_phase1_fp8(const job_t *j, int ai, int u0, int u1) {
    const int H = j->H, I = j->I, per = I / 4, G = jg(j, 1);
    if (G % 16 || (u0 - ai * per) % 4 || (u1 - u0) % 4) return -1;
    const int e = j->act_e[ai], off = j->act_off[ai], cnt = j->act_cnt[ai];
    const uint8_t *w = (const uint8_t *)j->w13 + (size_t)e * 2 * I * H;
    const float *s13 = (const float *)j->s13 + (size_t)e * 2 * I * (H / G);
    const float *b13 = j->b13 ? j->b13 + (size_t)e * 2 * I : NULL;
    fp8_scratch_t s;
    if (fp8_scratch(&s, H, G, cnt) != 0) return -1;
    /* each pair's row: [hi H | lo H] bf16 (bf16_rows) */
    gemm_pack_xs(j->x16, j->tok + off, cnt, H, 2 * H, s.xh);
    gemm_pack_xs(j->x16 + H, j->tok + off, cnt, H, 2 * H, s.xl);
    for (int v = u0 - ai * per; v < u1 - ai * per; v += 4) { /* strip: gate rows 4v .. 4v + 15 */
        const int i0 = 4 * v;
        const uint8_t *gq[4], *uq[4];
        const float *gs[4], *us[4];
        for (int q = 0; q < 4; q++) {
            const size_t gr = (size_t)(2 * (v + q)) * 4; /* the gate quad's first row */
            gq[q] = w + gr * H, uq[q] = gq[q] + (size_t)4 * H;
            gs[q] = s13 + gr * (H / G), us[q] = gs[q] + (size_t)4 * (H / G);
        }
        fp8_pack(gq, H, s.panel[0]);
        fp8_pack(uq, H, s.panel[1]);
        fp8_scales(gs, H / G, s.sc[0]);
        fp8_scales(us, H / G, s.sc[1]);
        for (int p0 = 0; p0 < cnt; p0 += PB) {
            const int n = cnt - p0 < PB ? cnt - p0 : PB;
            const size_t xo = (size_t)p0 * (H / 2);
            fp8_strip(s.panel[0], H, G, s.sc[0], s.xh + xo, s.xl + xo, n, s.acc, s.out[0]);
            fp8_strip(s.panel[1], H, G, s.sc[1], s.xh + xo, s.xl + xo, n, s.acc, s.out[1]);
            for (int m = 0; m < n; m++) { /* group scales inside the sums (fp8_strip) */
                const int p = off + p0 + m;
                strip_gate(j, p, i0, s.out[0] + m * GEMM_ROWS, s.out[1] + m * GEMM_ROWS, NULL,
                           NULL, j->xsc[j->tok[p]], b13);
            }
        }
    }
    free(s.buf);
    return 0;
}

int hs_phase2_fp8(const job_t *j, int ai, int u0, int u1) {
    const int H = j->H, I = j->I, per = H / 4, G = jg(j, 2);
    if (G % 16 || (u0 - ai * per) % 4 || (u1 - u0) % 4) return -1;
    const int e = j->act_e[ai], off = j->act_off[ai], cnt = j->act_cnt[ai];
    const uint8_t *w = (const uint8_t *)j->w2 + (size_t)e * H * I;
    const float *s2 = (const float *)j->s2 + (size_t)e * H * (I / G);
    const float *b2 = j->b2 ? j->b2 + (size_t)e * H : NULL;
    fp8_scratch_t s;
    if (fp8_scratch(&s, I, G, cnt) != 0) return -1;
    const int16_t *a = j->a16 + (size_t)off * 2 * I; /* the expert's pairs, [hi I | lo I] each */
    gemm_pack_xs(a, NULL, cnt, I, 2 * I, s.xh);
    gemm_pack_xs(a + I, NULL, cnt, I, 2 * I, s.xl);
    for (int v = u0 - ai * per; v < u1 - ai * per; v += 4) { /* strip: rows 4v .. 4v + 15 */
        const int n0 = 4 * v;
        const uint8_t *q[4];
        const float *sq[4];
        for (int k = 0; k < 4; k++) {
            const size_t r = (size_t)(v + k) * 4;
            q[k] = w + r * I, sq[k] = s2 + r * (I / G);
        }
        fp8_pack(q, I, s.panel[0]);
        fp8_scales(sq, I / G, s.sc[0]);
        for (int p0 = 0; p0 < cnt; p0 += PB) {
            const int n = cnt - p0 < PB ? cnt - p0 : PB;
            const size_t xo = (size_t)p0 * (I / 2);
            fp8_strip(s.panel[0], I, G, s.sc[0], s.xh + xo, s.xl + xo, n, s.acc, s.out[0]);
            for (int m = 0; m < n; m++) {
                const int p = off + p0 + m;
                strip_down(j, p, n0, s.out[0] + m * GEMM_ROWS, NULL, j->asc[p], b2);
            }
        }
    }
    free(s.buf);
    return 0;
}

#else

int hs_phase1_fp8(const job_t *j, int ai, int u0, int u1) {
    (void)j, (void)ai, (void)u0, (void)u1;
    return -1;
}

int hs_phase2_fp8(const job_t *j, int ai, int u0, int u1) {
    (void)j, (void)ai, (void)u0, (void)u1;
    return -1;
}

#endif
