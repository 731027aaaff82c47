/* Small AVX2 helpers shared by hetserve's native kernels. */
#ifndef HETSERVE_SIMD_H
#define HETSERVE_SIMD_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* HS_AVX512: built for a CPU with AVX-512 BW/VL and VNNI (hetserve/native/__init__.py adds the
 * flags where the CPU has them): the hot microkernels then take 512-bit paths; every other
 * kernel, and every CPU without them, runs the AVX2 code. */
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HS_AVX512 1
#endif

/* HS_FP8_BF16: AVX-512 with BF16 and GFNI as well (Zen 4, Sapphire Rapids; the avx512bf16
 * build): the FP8 experts kernel moves each e4m3 byte's bits into a bf16 with GFNI affine ops
 * and multiplies them by vdpbf16ps with each activation split into two bf16 (moe_formats.h),
 * 1.1-1.7x the fp32 path's rate. Otherwise FP8 converts its weights to fp32. */
#if defined(HS_AVX512) && defined(__AVX512BF16__) && defined(__GFNI__)
#define HS_FP8_BF16 1
#else
#define HS_FP8_BF16 0
#endif

/* acc + the pair sums a[2i] b[2i] + a[2i+1] b[2i+1] of int16 lanes (vpmaddwd + vpaddd), in one
 * vpdpwssd where the CPU has AVX-512 VNNI (its 256-bit form, AVX512VL). The same residue
 * modulo 2^32 either way: vpdpwssd does not saturate, and no caller's pair reaches the one
 * product vpmaddwd wraps (-32768 x -32768 twice): the same bits. Half the vector uops of the
 * int8 quads' inner loop (the decode kernels at 2-3 tokens per expert), whose 4 x MB
 * accumulators are independent chains; where one accumulator per token carries the sum (the
 * K-quant kernels) vpdpwssd's latency sits on that chain, and q5_K ran ~10% slower with it at
 * one token, so those keep vpmaddwd + vpaddd. */
static inline __attribute__((always_inline)) __m256i hs_dpwssd(__m256i acc, __m256i a, __m256i b) {
#ifdef HS_AVX512
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* acc + the sums of 4 adjacent products a[4i..4i+3] b[4i..4i+3], a unsigned and b signed bytes,
 * for callers whose pairs of products fit int16 (vpmaddubsw saturates them otherwise): one
 * vpdpbusd with AVX-512 VNNI, else vpmaddubsw + vpmaddwd by ones + vpaddd. The same sums. */
static inline __attribute__((always_inline)) __m256i hs_dpbusd(__m256i acc, __m256i a, __m256i b) {
#ifdef HS_AVX512
    return _mm256_dpbusd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* Keeps v in one register from one loop iteration to the next (quad_i8g, the tiles' dot
 * helpers). GCC 12 gives some loops' accumulators a second register and copies them back every
 * iteration; this empty asm, which reads and writes v in place, keeps them in one (a one-token
 * MXFP4 layer ~1.05x faster). quad_i8's loop needs a run-time block length instead (i8_kstep). */
#ifdef __AVX512F__
#define HS_PIN(v) __asm__("" : "+v"(v)) /* "v": any of the 32 vector registers */
#else
#define HS_PIN(v) __asm__("" : "+x"(v))
#endif

static inline float hs_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* The sum of v's 8 int32 lanes (wrapping as int32 does). */
static inline int hs_hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* The largest of v's 8 lanes. */
static inline float hs_hmax(__m256 v) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    return _mm_cvtss_f32(m4);
}

/* max |x[k]| over k < n (n % 8 == 0), 8 lanes then across them. */
static inline float hs_absmax(const float *x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 vmax = _mm256_setzero_ps();
    for (int k = 0; k < n; k += 8)
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    return hs_hmax(vmax);
}

/* The horizontal sums of 8 vectors at once: lane i of the result is the sum of v[i]'s lanes.
 * 7 adds/hadds and 2 lane permutes, instead of ~5 instructions per vector one by one. */
static inline __m256 hs_hsum8(const __m256 v[8]) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* e^x, 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 Taylor polynomial of e^r
 * (truncation below 2e-7 relative, about 2 ulp in all) scaled by 2^n through the exponent
 * bits. x is clamped to [-87, 88]: results below 2^-125 become 0, above that stay finite;
 * NaN stays NaN. */
static inline __m256 hs_exp(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    /* operand order: maxps/minps return their second operand when one is NaN, so a NaN
     * input stays NaN (as torch's exp would) instead of being clamped to a number */
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lo, x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* ln2 in two parts so that n * ln2_hi is exact */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* 2^n in two halves: n can reach 127, where 2^n alone would be fine but n + 127 = 254 */
    __m256i e = _mm256_cvtps_epi32(n);
    __m256i e1 = _mm256_srai_epi32(e, 1), e2 = _mm256_sub_epi32(e, e1);
    const __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, bias), 23));
    return _mm256_andnot_ps(under, _mm256_mul_ps(_mm256_mul_ps(p, s1), s2));
}

/* 8 cache elements from element i of base: fp32 as is, fp16 widened (F16C, half == 1), int8
 * widened unscaled (half == 2). */
static inline __attribute__((always_inline)) __m256 hs_ld8(const void *base, size_t i, const int half) {
    if (half == 2) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)base + i));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
    return _mm256_loadu_ps((const float *)base + i);
}

static inline __attribute__((always_inline)) float hs_ld1(const void *base, size_t i, const int half) {
    if (half == 2) return (float)((const int8_t *)base)[i];
    return half ? _cvtsh_ss(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* The little-endian fp16 number at p (a GGUF block's d), widened. */
static inline float kq_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* silu(x) = x / (1 + e^-x), 8 lanes. */
static inline __m256 hs_silu(__m256 x) {
    __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), hs_exp(_mm256_sub_ps(_mm256_setzero_ps(), x)));
    return _mm256_div_ps(x, d);
}

/* In place: row i of the 8 x 8 block becomes its column i (32-bit elements, moves only). */
static inline __attribute__((always_inline)) void hs_tr8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

#endif
