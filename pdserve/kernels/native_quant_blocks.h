/* The quantized layouts' blocks of 32 columns, widened and dequantized in AVX-512 registers:
 * shared by native_gemv.c (the products) and native_tiles.c (dequantized tiles for BLAS). The
 * layouts are described at the top of native_gemv.c. */
#ifndef PD_QUANT_BLOCKS_H
#define PD_QUANT_BLOCKS_H
#include "native_simd.h"
#include <stdint.h>

#define BITS_FP4 3 /* MXFP4 codes: 4 bits a column, looked up rather than widened */
#define BITS_BF16 16 /* unquantized bf16 rows: widened exactly (a shift), no scales */

/* e2m1's 16 values by code: sign bit 8, then 0, 0.5, 1, 1.5, 2, 3, 4, 6 */
static const float FP4_VALUES[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                     -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

/* 2^(e - 127) from an E8M0 byte, as mxfp4_cpu's table gives it (2^-127 a subnormal, 255 NaN) */
static inline float e8m0(uint8_t e) {
    union { uint32_t u; float f; } v = {e == 255 ? 0x7fc00000u : e ? (uint32_t)e << 23 : 0x00400000u};
    return v.f;
}

/* a group's scale: float32 (half 0), float16 bits (half 1) or an E8M0 byte (half 2) */
static inline __attribute__((always_inline)) float scale_at(const void *s, int half, long idx) {
    if (half == 2) return e8m0(((const uint8_t *)s)[idx]);
    return half ? _cvtsh_ss(((const uint16_t *)s)[idx]) : ((const float *)s)[idx];
}

/* the group of column col: a shift for the usual group sizes, where an integer division a half
 * block (as written plainly before) made a Q8_0 row's dequantization a third slower: the default
 * GGUF's LM head into bf16 on one thread took 7.8 ms with them, 5.5 without (pd_dequant_bf16, the
 * whole matrix in one call, medians of 3 runs of 15, builds alternated) */
static inline __attribute__((always_inline)) long group_of(int col, int group) {
    if (group == 32) return col >> 5;
    if (group == 16) return col >> 4;
    return col / group;
}

/* bytes of a block of 32 columns, and of a row of cols columns: two values a byte, one, or a
 * float32 each */
static inline int block_bytes(int bits) { return bits == BITS_FP4 ? 16 : 4 * bits; }
static inline long row_bytes(int bits, int cols) { return (long)cols / 32 * block_bytes(bits); }

/* columns 32c .. 32c + 31 of a row as float32 integers, in two vectors of 16 */
static inline __attribute__((always_inline)) void widen32(const uint8_t *qrow, int bits, int c, __m512 *a, __m512 *b) {
    if (bits == 4 || bits == BITS_FP4) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qrow + c * 16)));
        __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(v, 4);
        if (bits == BITS_FP4) {
            __m512 table = _mm512_loadu_ps(FP4_VALUES);
            *a = _mm512_permutexvar_ps(lo, table);
            *b = _mm512_permutexvar_ps(hi, table);
        } else {
            *a = _mm512_cvtepi32_ps(lo);
            *b = _mm512_cvtepi32_ps(hi);
        }
    } else {
        *a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qrow + c * 32))));
        *b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qrow + c * 32 + 16))));
    }
}

/* columns 32c .. 32c + 31 of a row, dequantized into two vectors of 16 */
static inline __attribute__((always_inline)) void decode32(const uint8_t *qrow, int bits, int c, const void *sc,
                                                           const void *mn, int half, int has_min, int group,
                                                           long srow, __m512 *w0, __m512 *w1) {
    if (bits == BITS_BF16) { /* bf16 -> float32 is exact: the top half of the float's bits */
        const uint16_t *row = (const uint16_t *)qrow + c * 32;
        *w0 = pd_bf16x16(row);
        *w1 = pd_bf16x16(row + 16);
        return;
    }
    if (bits == 32) {
        const float *row = (const float *)qrow + c * 32;
        *w0 = _mm512_loadu_ps(row);
        *w1 = _mm512_loadu_ps(row + 16);
        return;
    }
    __m512 a, b;
    widen32(qrow, bits, c, &a, &b);
    long g0 = srow + group_of(c * 32, group), g1 = srow + group_of(c * 32 + 16, group);
    __m512 s0 = _mm512_set1_ps(scale_at(sc, half, g0)), s1 = _mm512_set1_ps(scale_at(sc, half, g1));
    if (has_min) {
        *w0 = _mm512_fmadd_ps(a, s0, _mm512_set1_ps(scale_at(mn, half, g0)));
        *w1 = _mm512_fmadd_ps(b, s1, _mm512_set1_ps(scale_at(mn, half, g1)));
    } else {
        *w0 = _mm512_mul_ps(a, s0);
        *w1 = _mm512_mul_ps(b, s1);
    }
}

/* native_gemv_bf16.c: x @ w.T in bf16 products past 8 tokens when pd_set_bf16 is on (bf16 rows'
 * AMX tiles read from pack, a pd_bf16_tiles_pack, where given); returns 1 if it ran, 0 if the shape
 * or the setting leaves it to the float32 kernels */
int pd_gemv_bf16(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                 const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out, int threads);

/* native_gemv_int8.c: the same in int8 products (VNNI) for 4- and 8-bit codes from
 * pd_int8_min_tokens tokens when pd_set_int8 is on, read from the matrix's pack (pd_int8_pack)
 * where pack is not NULL; 1 if it ran, else 0 */
int pd_gemv_int8(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                 const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out, int threads);

/* native_gemv_panels.c: on AVX2 without AVX-512, from pd_panels_min_tokens tokens, a GEMM
 * micro-kernel over dequantized panels of rows; 1 if it ran, else 0 */
int pd_gemv_panels(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                   const void *mins, int half, int has_min, int group, float *out, int threads);

#endif
