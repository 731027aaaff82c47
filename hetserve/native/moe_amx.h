/* The int8 expert GEMM of moe_prefill.c on AMX tiles (Intel Sapphire Rapids and later), giving
 * the AVX paths' own int32 sums, so the same bits.
 *
 * The AVX paths multiply int16 activations by int8 weights (moe_gemm.h). AMX multiplies bytes:
 * TDPBSSD signed x signed, TDPBUSD unsigned x signed, 64 products into each int32 accumulator
 * per instruction, accumulating modulo 2^32. An int16 x splits exactly as x = 256 hi + lo with
 * hi = x >> 8 (signed byte) and lo = x & 255 (unsigned byte), so sum x w = 256 sum hi w +
 * sum lo w, two tile products. Their int32 sums wrap, but their combination, taken modulo
 * 2^32, is the residue of the exact sum, which fits int32 (moe_quads.h's KBLOCK bound): it is
 * that sum. The float steps after it are gemm_strip's (one float add per KBLOCK, in order).
 * W8A8 rows (moe_job.h's F_A8: |x| <= 127) are their own bytes: one TDPBSSD per 64 inputs.
 *
 * Layouts. A weight strip (16 rows, as for gemm_strip) is packed per 64 inputs into one B
 * tile: 16 tile rows of 4 inputs, each [16 weight rows][4 inputs] bytes (amx_pack, a 4 x 4
 * transpose of 32-bit words per quad and 16 inputs). Activations are split once per work item
 * into hi and lo byte rows ([pairs rounded up to 16][K], zeros past the last pair; amx_split),
 * 16 pairs to an A tile. Tiles: 0, 1 the hi / lo sums, 4 the weights, 5, 6 the activations.
 *
 * The Linux kernel hands out AMX state only to a process that asks (arch_prctl
 * ARCH_REQ_XCOMP_PERM); amx_ready asks once and says whether the tiles may be used; where not,
 * the callers take the AVX path. Each thread loads the tile configuration before its tiles
 * and releases it after (amx_begin / amx_end).
 *
 * HS_AMX_EMULATE (tests only) builds the same loops on a C model of the five tile
 * instructions, so a CPU without AMX checks the layouts and the hi / lo split bit for bit
 * against the AVX path; only the instructions themselves differ on AMX hardware. */
#ifndef HETSERVE_MOE_AMX_H
#define HETSERVE_MOE_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe_gemm.h"

/* Packs quads q[0..3] (rows 4j..4j+3 of the strip, [K / 16][4][16] int8 each; NULL: zeros)
 * into the strip's B tiles: panel [K / 4][16 rows][4 inputs] int8. */
static inline void amx_pack(const int8_t *const q[4], int K, int8_t *panel) {
    for (int c = 0; c < K / 16; c++)
        for (int j = 0; j < 4; j++) {
            __m128i r[4];
            for (int i = 0; i < 4; i++)
                r[i] = q[j] ? _mm_loadu_si128((const __m128i *)(q[j] + 64 * (size_t)c + 16 * i))
                            : _mm_setzero_si128();
            /* r[i] = row i's 4 words of 4 inputs; out t = word t of rows 0..3 */
            const __m128i t0 = _mm_unpacklo_epi32(r[0], r[1]), t1 = _mm_unpackhi_epi32(r[0], r[1]);
            const __m128i t2 = _mm_unpacklo_epi32(r[2], r[3]), t3 = _mm_unpackhi_epi32(r[2], r[3]);
            const __m128i o[4] = {_mm_unpacklo_epi64(t0, t2), _mm_unpackhi_epi64(t0, t2),
                                  _mm_unpacklo_epi64(t1, t3), _mm_unpackhi_epi64(t1, t3)};
            for (int t = 0; t < 4; t++)
                _mm_storeu_si128((__m128i *)(panel + (size_t)(4 * c + t) * 64 + 16 * j), o[t]);
        }
}

#ifdef HS_AMX

#define AMX_K 64 /* inputs per tile product */

#ifdef HS_AMX_EMULATE
/* A C model of the tiles this file uses: 16 rows of 64 bytes each, per thread. */
typedef struct {
    _Alignas(64) uint8_t b[16][64];
} amx_tile_t;
static __thread amx_tile_t amx_t[8];

static inline void amx_load(int t, const void *base, long stride) {
    for (int r = 0; r < 16; r++) memcpy(amx_t[t].b[r], (const char *)base + r * stride, 64);
}
static inline void amx_store(int t, void *base, long stride) {
    for (int r = 0; r < 16; r++) memcpy((char *)base + r * stride, amx_t[t].b[r], 64);
}
static inline void amx_zero(int t) { memset(&amx_t[t], 0, sizeof(amx_t[t])); }
/* c[m][n] += sum over k < 16, i < 4 of a[m][4k + i] * b[k][4n + i], modulo 2^32 */
static inline void amx_dp(int c, int a, int b, int a_unsigned) {
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            uint32_t acc;
            memcpy(&acc, &amx_t[c].b[m][4 * n], 4);
            for (int k = 0; k < 16; k++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t av = amx_t[a].b[m][4 * k + i];
                    const int32_t x = a_unsigned ? (int32_t)av : (int32_t)(int8_t)av;
                    acc += (uint32_t)(x * (int32_t)(int8_t)amx_t[b].b[k][4 * n + i]);
                }
            memcpy(&amx_t[c].b[m][4 * n], &acc, 4);
        }
}
#define AMX_LOAD(t, base, stride) amx_load(t, base, stride)
#define AMX_STORE(t, base, stride) amx_store(t, base, stride)
#define AMX_ZERO(t) amx_zero(t)
#define AMX_DPBSSD(c, a, b) amx_dp(c, a, b, 0)
#define AMX_DPBUSD(c, a, b) amx_dp(c, a, b, 1)
static inline int amx_ready(void) { return 1; }
static inline void amx_begin(void) {}
static inline void amx_end(void) {}
#else
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define AMX_STORE(t, base, stride) _tile_stored(t, base, stride)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define AMX_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)

#define AMX_ARCH_REQ_XCOMP_PERM 0x1023
#define AMX_XFEATURE_XTILEDATA 18

/* 1 where this process may use the tiles (asked for once), else 0. */
static inline int amx_ready(void) {
    static int state; /* 0 not asked, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, AMX_ARCH_REQ_XCOMP_PERM, AMX_XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_cfg_t;

static inline void amx_begin(void) {
    amx_cfg_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}
static inline void amx_end(void) { _tile_release(); }
#endif

/* Whether the tiles take a matrix of K inputs here. */
static inline int amx_usable(int K) { return K % AMX_K == 0 && amx_ready(); }

/* Rows of pairs rounded up to whole A tiles. */
static inline int amx_rows(int n) { return (n + 15) / 16 * 16; }

/* hi[m][k] = x[m][k] >> 8, lo[m][k] = x[m][k] & 255 for the n rows x[m] (K int16 each); rows
 * n .. amx_rows(n) - 1 zero. W8A8 rows (|x| <= 127, lo NULL): hi[m][k] = x[m][k] itself, one
 * tile product. */
static inline void amx_split(const int16_t *const *x, int n, int K, int8_t *hi, uint8_t *lo) {
    for (int m = 0; m < n; m++) {
        const int16_t *s = x[m];
        int8_t *h = hi + (size_t)m * K;
        uint8_t *l = lo ? lo + (size_t)m * K : NULL;
        if (l == NULL) {
            for (int k = 0; k < K; k++) h[k] = (int8_t)s[k];
            continue;
        }
        for (int k = 0; k < K; k++) {
            h[k] = (int8_t)(s[k] >> 8);
            l[k] = (uint8_t)(s[k] & 255);
        }
    }
    const size_t pad = (size_t)(amx_rows(n) - n) * K;
    memset(hi + (size_t)n * K, 0, pad);
    if (lo) memset(lo + (size_t)n * K, 0, pad);
}

/* gemm_strip's result (out [n][16] fp32) from the strip's B tiles and n pairs' split rows
 * (hi, lo: [amx_rows(n)][K]; lo NULL: W8A8 rows, hi the values); isum: scratch [16][16] int32
 * twice. */
static inline void amx_strip(const int8_t *panel, int K, const int8_t *hi, const uint8_t *lo,
                             int n, int32_t *isum, float *out) {
    for (int i = 0; i < n * GEMM_ROWS; i++) out[i] = 0.0f;
    int32_t *shi = isum, *slo = isum + 256;
    for (int kb = 0; kb < K; kb += KBLOCK) {
        const int ke = kb + KBLOCK < K ? kb + KBLOCK : K;
        for (int m0 = 0; m0 < n; m0 += 16) {
            AMX_ZERO(0);
            AMX_ZERO(1);
            for (int k0 = kb; k0 < ke; k0 += AMX_K) {
                AMX_LOAD(4, panel + (size_t)k0 * GEMM_ROWS, 64);
                AMX_LOAD(5, hi + (size_t)m0 * K + k0, K);
                AMX_DPBSSD(0, 5, 4);
                if (lo) {
                    AMX_LOAD(6, lo + (size_t)m0 * K + k0, K);
                    AMX_DPBUSD(1, 6, 4);
                }
            }
            AMX_STORE(0, shi, 64);
            AMX_STORE(1, slo, 64);
            const int mn = n - m0 < 16 ? n - m0 : 16;
            for (int m = 0; m < mn; m++)
                for (int r = 0; r < GEMM_ROWS; r++) {
                    const uint32_t s = lo ? ((uint32_t)shi[16 * m + r] << 8) + (uint32_t)slo[16 * m + r]
                                          : (uint32_t)shi[16 * m + r];
                    out[(m0 + m) * GEMM_ROWS + r] += (float)(int32_t)s;
                }
        }
    }
}

#endif /* HS_AMX */

/* A work item's activations prepared once for all its strips: split for the AMX tiles (on), or
 * packed for the AVX tiles (xp: gemm_pack_x, or gemm_pack_x8 where a8). */
typedef struct {
    int on;
    int a8; /* W8A8 rows on the AVX-512 byte tiles (gemm_strip) */
    int8_t *hi;
    uint8_t *lo;
    int32_t *xp;
} amx_rows_t;

/* Prepares cnt rows (rows of K int16 from base: row tok[m] where tok, else row m; a8: W8A8
 * rows, |x| <= 127) for the tiles: split where the AMX tiles take K, else packed for the AVX
 * tiles (the byte tiles for a8 rows on AVX-512; the int16 ones give the same sums anywhere);
 * -1 when out of memory (the caller then runs the row kernels). */
static inline int amx_rows_split(amx_rows_t *a, const int16_t *base, const int *tok, int cnt,
                                 int K, int a8) {
#ifdef HS_AMX
    if (amx_usable(K)) {
        enum { BLOCK = 64 }; /* row pointers a block at a time */
        const int16_t *x[BLOCK];
        const size_t bytes = (size_t)amx_rows(cnt) * K;
        char *mem = aligned_alloc(64, ((a8 ? 1 : 2) * bytes + 63) / 64 * 64);
        if (mem == NULL) return -1;
        a->hi = (int8_t *)mem;
        a->lo = a8 ? NULL : (uint8_t *)(mem + bytes);
        for (int p0 = 0; p0 < cnt; p0 += BLOCK) {
            const int n = cnt - p0 < BLOCK ? cnt - p0 : BLOCK;
            for (int m = 0; m < n; m++) x[m] = base + (size_t)(tok ? tok[p0 + m] : p0 + m) * K;
            amx_split(x, n, K, a->hi + (size_t)p0 * K, a8 ? NULL : a->lo + (size_t)p0 * K);
        }
        a->on = 1;
        return 0;
    }
#endif
    a->xp = aligned_alloc(64, (gemm_xp_bytes(cnt, K) + 63) / 64 * 64);
    if (a->xp == NULL) return -1;
#ifdef HS_AVX512
    if (a8) {
        a->a8 = 1;
        gemm_pack_x8(base, tok, cnt, K, a->xp);
        return 0;
    }
#else
    (void)a8;
#endif
    gemm_pack_x(base, tok, cnt, K, a->xp);
    return 0;
}

static inline void amx_rows_free(amx_rows_t *a) {
    if (a->on) free(a->hi);
    free(a->xp);
    a->on = a->a8 = 0;
    a->xp = NULL;
}

/* This thread's tiles on (amx_begin) or off (amx_end) around its use of rows split in a. */
static inline void amx_rows_begin(const amx_rows_t *a) {
#ifdef HS_AMX
    if (a->on) amx_begin();
#else
    (void)a;
#endif
}

static inline void amx_rows_end(const amx_rows_t *a) {
#ifdef HS_AMX
    if (a->on) amx_end();
#else
    (void)a;
#endif
}

/* A work item of the experts: its rows split once for all its strips, the tiles on. */
static inline int amx_item(amx_rows_t *a, const int16_t *base, const int *tok, int cnt, int K,
                           int a8) {
    const int rc = amx_rows_split(a, base, tok, cnt, K, a8);
    amx_rows_begin(a);
    return rc;
}

static inline void amx_item_end(amx_rows_t *a) {
    amx_rows_end(a);
    amx_rows_free(a);
}

/* The strip's panel for the tiles a's rows meet (AMX's B tiles, the byte tiles' with their
 * corrections: K * 16 bytes and 64 per KBLOCK, or the int16 tiles'); room for K * 16 int16. */
static inline void strip_pack(const amx_rows_t *a, const int8_t *const q[4], int K, int16_t *panel) {
#ifdef HS_AMX
    if (a->on) {
        amx_pack(q, K, (int8_t *)panel);
        return;
    }
#endif
#ifdef HS_AVX512
    if (a->a8) {
        amx_pack(q, K, (int8_t *)panel);
        gemm_panel8_corr((int8_t *)panel, K);
        return;
    }
#endif
    (void)a;
    static const int8_t zero[64];
    gemm_pack_n(q, K, panel, zero);
}

/* gemm_strip for pairs p0 .. p0 + n - 1 of the item (p0: a multiple of GEMM_NT, the callers'
 * blocks of 96). */
static inline void strip_sums(const amx_rows_t *a, const int16_t *panel, int K, int p0, int n,
                              int32_t *isum, float *out, const char *next) {
#ifdef HS_AMX
    if (a->on) {
        amx_strip((const int8_t *)panel, K, a->hi + (size_t)p0 * K,
                  a->lo ? a->lo + (size_t)p0 * K : NULL, n, isum, out);
        return;
    }
#endif
    /* the byte tiles pack 4 inputs a word, the int16 ones 2; each call its own copy (a8 a
     * constant: a run-time one left the W8A8 layer ~4% slower) */
    if (a->a8) gemm_strip(panel, K, a->xp + (size_t)p0 * (K / 4), n, isum, out, 1, next);
    else gemm_strip(panel, K, a->xp + (size_t)p0 * (K / 2), n, isum, out, 0, next);
}

#endif
