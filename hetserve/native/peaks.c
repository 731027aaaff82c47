/* The CPU's arithmetic peaks, measured: what `hetserve bench prefill` reads every row against.
 *
 * hetserve_peak(kind, nthreads, iters) runs `iters` iterations of a loop of independent
 * multiply-accumulate chains on each of nthreads threads (pool.c, one item per thread) and
 * returns the seconds taken; each iteration does hetserve_peak_ops(kind) operations per thread
 * (a multiply-add counts as 2). Twelve accumulators per loop: at 2 issues per cycle and a
 * latency of 3-5 cycles, 12 chains keep every multiply pipe busy on Zen 3, Zen 4/5 and Intel
 * cores alike. The kinds, by the instruction that does the work in hetserve's kernels:
 *   0  fp32 FMA (vfmadd231ps; 512-bit where the build is AVX-512)
 *   1  int16 x int16 -> int32 (vpmaddwd + vpaddd): the decode kernels' int8-weight arithmetic
 *   2  int8 dot products, u8 x s8 -> int32: vpdpbusd (AVX-512 VNNI) or, on AVX2,
 *      vpmaddubsw + vpmaddwd (by ones) + vpaddd
 *   3  bf16 pairs -> fp32 (vdpbf16ps, AVX512-BF16 builds only)
 * Returns -1 for a kind this build cannot run. The inputs come from memory the compiler cannot
 * see through, and each product takes its chain's accumulator as one factor (a product of
 * loop-invariant inputs would be hoisted out of the loop), so every instruction is executed;
 * the sums are stored to a sink. */
#include <immintrin.h>
#include <stdint.h>
#include <time.h>

#include "pool.h"
#include "simd.h"

#define CHAINS 12
/* The chains as twelve named variables: an array of accumulators, even pinned, was kept in
 * memory by GCC 12 (a store and a reload around every multiply-add: ~3x below the peak). */
#define REP12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

static volatile float sink_f;
static volatile int sink_i;

typedef struct {
    int kind;
    long iters;
    const void *seed; /* 64 bytes of inputs */
} peak_t;

#ifdef HS_AVX512
#define VW 16 /* fp32 lanes per vector */
typedef __m512 vf_t;
typedef __m512i vi_t;
#define LOADF(p) _mm512_loadu_ps(p)
#define LOADI(p) _mm512_loadu_si512(p)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define ADDF(a, b) _mm512_add_ps(a, b)
#define ADDI(a, b) _mm512_add_epi32(a, b)
#define MADD16(a, b) _mm512_madd_epi16(a, b)
#define SUMF(v) _mm512_reduce_add_ps(v)
#define SUMI(v) _mm512_reduce_add_epi32(v)
#else
#define VW 8
typedef __m256 vf_t;
typedef __m256i vi_t;
#define LOADF(p) _mm256_loadu_ps(p)
#define LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define ADDF(a, b) _mm256_add_ps(a, b)
#define ADDI(a, b) _mm256_add_epi32(a, b)
#define MADD16(a, b) _mm256_madd_epi16(a, b)
#define SUMF(v) hs_hsum(v)
#define SUMI(v) _mm256_extract_epi32(v, 0)
#endif

#define DECL_F(c) vf_t f##c = x;
#define DECL_I(c) vi_t i##c = a;
#define SUM_F(c) s = ADDF(s, f##c);
#define SUM_I(c) t = ADDI(t, i##c);

static void fma_chains(long iters, const float *seed) {
    const vf_t x = LOADF(seed), y = LOADF(seed);
    REP12(DECL_F)
    for (long i = 0; i < iters; i++) {
#define STEP(c) f##c = FMA(x, y, f##c); HS_PIN(f##c);
        REP12(STEP)
#undef STEP
    }
    vf_t s = x;
    REP12(SUM_F)
    sink_f = SUMF(s);
}

/* Each product takes its chain's accumulator as a factor: products of the loop-invariant
 * inputs alone would be hoisted out of the loop. */
static void madd16_chains(long iters, const void *seed) {
    const vi_t a = LOADI(seed), b = LOADI(seed);
    REP12(DECL_I)
    for (long i = 0; i < iters; i++) {
#define STEP(c) i##c = ADDI(i##c, MADD16(i##c, b)); HS_PIN(i##c);
        REP12(STEP)
#undef STEP
    }
    vi_t t = a;
    REP12(SUM_I)
    sink_i = SUMI(t);
}

static void dot8_chains(long iters, const void *seed) {
    const vi_t a = LOADI(seed), b = LOADI(seed);
    REP12(DECL_I)
    for (long i = 0; i < iters; i++) {
#ifdef HS_AVX512
#define STEP(c) i##c = _mm512_dpbusd_epi32(i##c, a, b); HS_PIN(i##c);
#else
        const __m256i ones = _mm256_set1_epi16(1);
#define STEP(c) i##c = ADDI(i##c, _mm256_madd_epi16(_mm256_maddubs_epi16(i##c, b), ones)); \
    HS_PIN(i##c);
#endif
        REP12(STEP)
#undef STEP
    }
    vi_t t = a;
    REP12(SUM_I)
    sink_i = SUMI(t);
}

#if defined(HS_AVX512) && defined(__AVX512BF16__)
static void bf16_chains(long iters, const void *seed) {
    const __m512bh p = (__m512bh)_mm512_loadu_si512(seed);
    const vf_t x = LOADF(seed);
    REP12(DECL_F)
    for (long i = 0; i < iters; i++) {
#define STEP(c) f##c = _mm512_dpbf16_ps(f##c, p, p); HS_PIN(f##c);
        REP12(STEP)
#undef STEP
    }
    vf_t s = x;
    REP12(SUM_F)
    sink_f = SUMF(s);
}
#endif

/* Operations per iteration and thread of kind (a multiply-add is 2), or -1: not in this build. */
long hetserve_peak_ops(int kind) {
    const long lanes32 = VW; /* 32-bit lanes per vector */
    switch (kind) {
    case 0: return CHAINS * lanes32 * 2;
    case 1: return CHAINS * lanes32 * 2 * 2; /* 2 int16 products per 32-bit lane */
    case 2: return CHAINS * lanes32 * 4 * 2; /* 4 int8 products per 32-bit lane */
#if defined(HS_AVX512) && defined(__AVX512BF16__)
    case 3: return CHAINS * lanes32 * 2 * 2; /* 2 bf16 products per fp32 lane */
#endif
    default: return -1;
    }
}

static void peak_item(void *ctx, int item) {
    (void)item;
    const peak_t *p = (const peak_t *)ctx;
    switch (p->kind) {
    case 0: fma_chains(p->iters, (const float *)p->seed); break;
    case 1: madd16_chains(p->iters, p->seed); break;
    case 2: dot8_chains(p->iters, p->seed); break;
#if defined(HS_AVX512) && defined(__AVX512BF16__)
    case 3: bf16_chains(p->iters, p->seed); break;
#endif
    default: break;
    }
}

double hetserve_peak(int kind, int nthreads, long iters) {
    if (hetserve_peak_ops(kind) < 0 || iters < 1) return -1.0;
    /* small values: no overflow of the int32 sums, no fp32 growth to infinity */
    static const float seed[16] = {1e-7f, 2e-7f, 3e-7f, 4e-7f, 1e-7f, 2e-7f, 3e-7f, 4e-7f,
                                   1e-7f, 2e-7f, 3e-7f, 4e-7f, 1e-7f, 2e-7f, 3e-7f, 4e-7f};
    peak_t p = {kind, iters, seed};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    hs_parallel_for(nthreads, nthreads < 1 ? 1 : nthreads, peak_item, &p);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}
