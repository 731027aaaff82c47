/* Kernel weight layouts built at load from a file's blocks (hetserve.moe.native_layout).
 *
 * hetserve_q4k_quads(N, B, raw, gate_up, out): one q4_K matrix as the GGUF stores it (raw: N rows
 * of B super-blocks of 144 bytes: d, dmin fp16, the 12-byte 6-bit scales and minimums, 128
 * bytes of nibbles) -> the expert kernel's quad layout (native/moe_q4k.h), byte for byte what
 * quant/layout.py's q4k_quads builds with torch (tests/moe/test_q4k_layout.py compares them):
 * per quad of rows and super-block 576 bytes (the 4 rows' d, their dmin, the 32 scale/minimum
 * low nibbles by place 16 g + 4 r + i, the high 2 bits of the scales then of the minimums, 512
 * bytes of nibbles: byte 128 k + 64 g + 16 r + 4 i + t holds column 128 g + 32 i + 4 k + t in
 * its low nibble and that column + 16 in its high one), quads 2u and 2u + 1 interleaved by
 * 64-byte line, an odd last quad as it is. gate_up != 0: the matrix's rows are the gate's then
 * the up projection's (N / 2 each) and are taken 8 gate rows, 8 up rows, ... (the kernel's unit).
 * The torch version spent ~5 s of a 1 GB Q4_K_M file's 9 s load on this reshuffle.
 * Returns 0, or -1 when N is not a multiple of 4 (16 with gate_up).
 *
 * hetserve_mxfp4_split(nthreads, n, raw, blocks, scales): n GGML MXFP4 blocks (17 bytes: the
 * e8m0 scale, then elements 0-15 in the low nibbles of 16 bytes and 16-31 in the high ones) ->
 * gpt-oss's layout (quant/packed.py Mxfp4Rows): blocks [n][16] with elements 2j and 2j + 1 in
 * byte j's low and high nibble, scales [n]. The same codes and scales, moved; numpy / torch
 * managed ~0.2 GB/s on the 17-byte stride (a 12 GB gpt-oss-20b file's load).
 *
 * hetserve_unit_tiles(nthreads, N, C, rows, chunk, gate_up, src, dst): one expert's byte matrix
 * src [N][C] -> dst [N / rows][C / chunk][rows][chunk] (moe/native_layout.py stacked_quads: the
 * MXFP4 and int4 tiles, the quads), each unit of `rows` rows streamed `chunk` bytes of each row
 * at a time; gate_up != 0: the rows are the gate's then the up projection's (N / 2 each), taken
 * a unit of gate rows, then one of up rows. torch's strided copy ran at ~0.35 GB/s there.
 * Returns 0, or -1 when N is not a multiple of rows (2 rows with gate_up) or C of chunk.
 *
 * hetserve_kq_lanes(nthreads, fmt, n, src, dst): n super-blocks of a q6_K, q5_K, q3_K, q2_K or
 * IQ4_XS matrix (IQ4_NL: n groups of 8 blocks, 144 bytes) as the file stores them -> the row
 * kernels' order (quant/lane_order.py builds the same bytes with torch, and the tests compare
 * them): each block's codes decoded by column, permuted as the activations are (moe_kq.h,
 * kq_act_perm) and encoded back in the format's bit layout (the IQ4 types: in 64-position
 * chunks, IQ4_NL's 8 d first). torch managed 0.05-0.3 GB/s. Returns 0, or -1 for another fmt. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe_kq.h"
#include "pool.h"

#define Q4K_BLOCK 144
#define QUAD_BLOCK 576

/* The 6-bit scale and minimum of sub-block j from the 12 packed bytes (llama.cpp's layout). */
static inline void lay_six(const uint8_t *q, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Row r's nibble of column col of one super-block: column 64 c + l sits in byte 32 c + l % 32,
 * low nibble for l < 32. */
static inline uint8_t q4k_code(const uint8_t *qs, int col) {
    const int c = col >> 6, l = col & 63;
    const uint8_t byte = qs[32 * c + (l & 31)];
    return l < 32 ? byte & 15 : byte >> 4;
}

/* One super-block of 4 rows (their 144-byte blocks) -> its 576 bytes of the quad layout. */
static void quad_block(const uint8_t *const rows[4], uint8_t *f) {
    uint8_t sc[4][8], mn[4][8];
    for (int r = 0; r < 4; r++) {
        memcpy(f + 2 * r, rows[r], 2);         /* d */
        memcpy(f + 8 + 2 * r, rows[r] + 2, 2); /* dmin */
        for (int j = 0; j < 8; j++) lay_six(rows[r] + 4, j, &sc[r][j], &mn[r][j]);
    }
    memset(f + 48, 0, 16);
    for (int g = 0; g < 2; g++)
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < 4; i++) {
                const int p = 16 * g + 4 * r + i, j = 4 * g + i;
                f[16 + p] = (uint8_t)((sc[r][j] & 15) | ((mn[r][j] & 15) << 4));
                f[48 + p % 8] |= (uint8_t)((sc[r][j] >> 4) << (2 * (p / 8)));
                f[56 + p % 8] |= (uint8_t)((mn[r][j] >> 4) << (2 * (p / 8)));
            }
    for (int k = 0; k < 4; k++)
        for (int g = 0; g < 2; g++)
            for (int r = 0; r < 4; r++) {
                const uint8_t *qs = rows[r] + 16;
                for (int i = 0; i < 4; i++)
                    for (int t = 0; t < 4; t++) {
                        const int col = 128 * g + 32 * i + 4 * k + t;
                        f[64 + 128 * k + 64 * g + 16 * r + 4 * i + t] =
                            (uint8_t)(q4k_code(qs, col) | (q4k_code(qs, col + 16) << 4));
                    }
            }
}

typedef struct {
    int N, B, gate_up, pairs;
    const uint8_t *raw;
    uint8_t *out;
} q4k_job;

/* Source row of output row o: with gate_up, 8 gate rows then 8 up rows per unit of 16. */
static inline int src_row(const q4k_job *j, int o) {
    if (!j->gate_up) return o;
    const int u = o / 16, w = o % 16;
    return w < 8 ? 8 * u + w : j->N / 2 + 8 * u + (w - 8);
}

/* Quad qd: every super-block into its place (a pair's two quads interleave by 64-byte line). */
static void q4k_quad(void *ctx, int qd) {
    q4k_job *j = (q4k_job *)ctx;
    const size_t row_bytes = (size_t)j->B * Q4K_BLOCK, quad_bytes = (size_t)j->B * QUAD_BLOCK;
    uint8_t f[QUAD_BLOCK];
    for (int b = 0; b < j->B; b++) {
        const uint8_t *rows[4];
        for (int r = 0; r < 4; r++)
            rows[r] = j->raw + (size_t)src_row(j, 4 * qd + r) * row_bytes + (size_t)b * Q4K_BLOCK;
        quad_block(rows, f);
        if (qd < 2 * j->pairs) { /* line L of quad 2u + s -> pair u's line L, half s */
            uint8_t *pair = j->out + (size_t)(qd / 2) * 2 * quad_bytes;
            for (int l = 0; l < QUAD_BLOCK / 64; l++)
                memcpy(pair + ((size_t)b * (QUAD_BLOCK / 64) + l) * 128 + (qd % 2) * 64, f + 64 * l,
                       64);
        } else {
            memcpy(j->out + (size_t)qd * quad_bytes + (size_t)b * QUAD_BLOCK, f, QUAD_BLOCK);
        }
    }
}

int hetserve_q4k_quads(int nthreads, int N, int B, const uint8_t *raw, int gate_up, uint8_t *out) {
    if (N % (gate_up ? 16 : 4) != 0 || N <= 0 || B <= 0) return -1;
    q4k_job j = {N, B, gate_up, N / 8, raw, out};
    hs_parallel_for(nthreads, N / 4, q4k_quad, &j);
    return 0;
}

typedef struct {
    long n, per;
    const uint8_t *raw;
    uint8_t *blocks, *scales;
} mxfp4_job;

static void mxfp4_part(void *ctx, int part) {
    const mxfp4_job *j = (const mxfp4_job *)ctx;
    const long b0 = part * j->per, b1 = b0 + j->per < j->n ? b0 + j->per : j->n;
    for (long b = b0; b < b1; b++) {
        const uint8_t *src = j->raw + 17 * b, *qs = src + 1;
        uint8_t *dst = j->blocks + 16 * b;
        j->scales[b] = src[0];
        for (int k = 0; k < 8; k++) { /* elements 2k, 2k + 1 and 16 + 2k, 17 + 2k */
            const uint8_t e = qs[2 * k], o = qs[2 * k + 1];
            dst[k] = (uint8_t)((e & 15) | (o << 4));
            dst[8 + k] = (uint8_t)((e >> 4) | (o & 0xF0));
        }
    }
}

int hetserve_mxfp4_split(int nthreads, long n, const uint8_t *raw, uint8_t *blocks,
                         uint8_t *scales) {
    if (n < 0) return -1;
    const long per = 1L << 16; /* blocks a work item: 1.1 MB of the file */
    mxfp4_job j = {n, per, raw, blocks, scales};
    hs_parallel_for(nthreads, (int)((n + per - 1) / per), mxfp4_part, &j);
    return 0;
}

typedef struct {
    int N, rows, chunk, gate_up;
    long C;
    const uint8_t *src;
    uint8_t *dst;
} tiles_job;

static void unit_tile(void *ctx, int u) {
    const tiles_job *j = (const tiles_job *)ctx;
    const long pieces = j->C / j->chunk;
    uint8_t *out = j->dst + (size_t)u * j->rows * j->C;
    for (int r = 0; r < j->rows; r++) {
        const long row = j->gate_up ? (long)(u % 2) * (j->N / 2) + (long)(u / 2) * j->rows + r
                                    : (long)u * j->rows + r;
        const uint8_t *in = j->src + (size_t)row * j->C;
        uint8_t *o = out + (size_t)r * j->chunk;
        if (j->chunk == 4)
            for (long c = 0; c < pieces; c++) memcpy(o + (size_t)c * j->rows * 4, in + 4 * c, 4);
        else
            for (long c = 0; c < pieces; c++)
                memcpy(o + (size_t)c * j->rows * j->chunk, in + (size_t)c * j->chunk, j->chunk);
    }
}

int hetserve_unit_tiles(int nthreads, int N, long C, int rows, int chunk, int gate_up,
                        const uint8_t *src, uint8_t *dst) {
    if (rows <= 0 || chunk <= 0 || N % (gate_up ? 2 * rows : rows) || C % chunk) return -1;
    tiles_job j = {N, rows, chunk, gate_up, C, src, dst};
    hs_parallel_for(nthreads, N / rows, unit_tile, &j);
    return 0;
}

/* One super-block's codes by column (natural order) <-> its bytes in the file's layout. */
static void kl_decode(int fmt, const uint8_t *b, uint8_t *c) {
    switch (fmt) {
    case F_Q6K:
        for (int n = 0; n < 2; n++)
            for (int i = 0; i < 4; i++)
                for (int l = 0; l < 32; l++)
                    c[128 * n + 32 * i + l] =
                        (uint8_t)(((b[64 * n + 32 * (i & 1) + l] >> (4 * (i >> 1))) & 15) |
                                  (((b[128 + 32 * n + l] >> (2 * i)) & 3) << 4));
        break;
    case F_Q5K:
        for (int cc = 0; cc < 4; cc++)
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < 32; l++)
                    c[64 * cc + 32 * h + l] = (uint8_t)(((b[48 + 32 * cc + l] >> (4 * h)) & 15) |
                                                        (((b[16 + l] >> (2 * cc + h)) & 1) << 4));
        break;
    case F_Q3K:
    case F_Q2K: {
        const uint8_t *qs = b + (fmt == F_Q3K ? 32 : 16);
        for (int n = 0; n < 2; n++)
            for (int i = 0; i < 4; i++)
                for (int l = 0; l < 32; l++) {
                    uint8_t v = (uint8_t)((qs[32 * n + l] >> (2 * i)) & 3);
                    if (fmt == F_Q3K) v = (uint8_t)(v | (((b[l] >> (4 * n + i)) & 1) << 2));
                    c[128 * n + 32 * i + l] = v;
                }
        break;
    }
    default: /* IQ4_XS, IQ4_NL: byte l of 32-column block j holds 32 j + l, 32 j + 16 + l */
        for (int j = 0; j < 8; j++) {
            const uint8_t *p = fmt == F_IQ4XS ? b + 8 + 16 * j : b + 18 * j + 2;
            const __m128i q = _mm_loadu_si128((const __m128i *)p), nib = _mm_set1_epi8(15);
            _mm_storeu_si128((__m128i *)(c + 32 * j), _mm_and_si128(q, nib));
            _mm_storeu_si128((__m128i *)(c + 32 * j + 16),
                             _mm_and_si128(_mm_srli_epi16(q, 4), nib));
        }
    }
}

static void kl_encode(int fmt, const uint8_t *b, const uint8_t *c, uint8_t *o) {
    switch (fmt) {
    case F_Q6K:
        for (int n = 0; n < 2; n++)
            for (int l = 0; l < 32; l++) {
                const uint8_t *v = c + 128 * n + l; /* v[32 i]: column 128 n + 32 i + l */
                o[64 * n + l] = (uint8_t)((v[0] & 15) | (v[64] & 15) << 4);
                o[64 * n + 32 + l] = (uint8_t)((v[32] & 15) | (v[96] & 15) << 4);
                o[128 + 32 * n + l] = (uint8_t)((v[0] >> 4) | (v[32] >> 4) << 2 |
                                                (v[64] >> 4) << 4 | (v[96] >> 4) << 6);
            }
        memcpy(o + 192, b + 192, 18);
        break;
    case F_Q5K:
        memcpy(o, b, 16);
        for (int l = 0; l < 32; l++) {
            unsigned h = 0;
            for (int cc = 0; cc < 4; cc++) {
                const uint8_t lo = c[64 * cc + l], hi = c[64 * cc + 32 + l];
                o[48 + 32 * cc + l] = (uint8_t)((lo & 15) | (hi & 15) << 4);
                h |= (unsigned)(lo >> 4) << (2 * cc) | (unsigned)(hi >> 4) << (2 * cc + 1);
            }
            o[16 + l] = (uint8_t)h;
        }
        break;
    case F_Q3K:
    case F_Q2K: {
        uint8_t *qs = o + (fmt == F_Q3K ? 32 : 16);
        if (fmt == F_Q3K) memcpy(o + 96, b + 96, 14);
        else memcpy(o, b, 16), memcpy(o + 80, b + 80, 4);
        for (int l = 0; l < 32; l++) {
            unsigned h = 0;
            for (int n = 0; n < 2; n++) {
                unsigned q = 0;
                for (int i = 0; i < 4; i++) {
                    const uint8_t v = c[128 * n + 32 * i + l];
                    q |= (unsigned)(v & 3) << (2 * i);
                    h |= (unsigned)(v >> 2) << (4 * n + i);
                }
                qs[32 * n + l] = (uint8_t)q;
            }
            if (fmt == F_Q3K) o[l] = (uint8_t)h;
        }
        break;
    }
    default: { /* the IQ4 types: byte l of chunk cc holds positions 64 cc + l, 64 cc + 32 + l */
        uint8_t *q = o + (fmt == F_IQ4XS ? 8 : 16);
        if (fmt == F_IQ4XS) memcpy(o, b, 8);
        else
            for (int j = 0; j < 8; j++) memcpy(o + 2 * j, b + 18 * j, 2);
        for (int cc = 0; cc < 4; cc++) { /* codes < 16: a 16-bit shift carries nothing across */
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(c + 64 * cc));
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(c + 64 * cc + 32));
            _mm256_storeu_si256((__m256i *)(q + 32 * cc),
                                _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));
        }
    }
    }
}

typedef struct {
    int fmt, bytes;
    long n, per;
    const uint8_t *src;
    uint8_t *dst;
} lanes_job;

static void lanes_part(void *ctx, int part) {
    const lanes_job *j = (const lanes_job *)ctx;
    const long b0 = (long)part * j->per, b1 = b0 + j->per < j->n ? b0 + j->per : j->n;
    uint8_t codes[Q4K_SB] __attribute__((aligned(32)));
    for (long i = b0; i < b1; i++) {
        const uint8_t *b = j->src + (size_t)i * j->bytes;
        kl_decode(j->fmt, b, codes);
        if (kq_act_perm(j->fmt) == KQ_PERM32) iq4_perm((int8_t *)codes);
        else kq_perm16((int8_t *)codes);
        kl_encode(j->fmt, b, codes, j->dst + (size_t)i * j->bytes);
    }
}

int hetserve_kq_lanes(int nthreads, int fmt, long n, const uint8_t *src, uint8_t *dst) {
    const int perm = kq_act_perm(fmt); /* the grid i-quants' plane order moves no codes */
    if (n < 0 || (perm != KQ_PERM32 && perm != KQ_PERM16) || fmt == F_Q4K) return -1;
    const int bytes = fmt == F_IQ4NL ? 144 : kq_bytes(fmt);
    const long per = 1L << 14;
    lanes_job j = {fmt, bytes, n, per, src, dst};
    hs_parallel_for(nthreads, (int)((n + per - 1) / per), lanes_part, &j);
    return 0;
}
