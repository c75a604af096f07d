/* Dequantized tiles of weight rows for the many-token products (pdserve.kernels.dequant_tiles):
 * rows [start, end) of an int4 or int8 matrix (quant_cpu's layouts) into a float32 or bf16 buffer,
 * which torch's BLAS then multiplies.
 *
 * Why in C: numba's threading layer loads a second libgomp (its pool links libgomp.so.1.0.0 by
 * that name, torch's is another copy), so numba's dequantization and torch's product took turns
 * with two thread pools, each spinning while the other ran: on 2 cores, 20% of a prefill's samples
 * were in libgomp's spin loops (perf, SmolLM2 Q4_1, 32 prompts of 160 tokens). This library binds
 * torch's libgomp (it is loaded first, with the same soname), so both run in one pool.
 */
#include "native_simd.h"
#include <stdint.h>

#include "native_quant_blocks.h"

/* columns 32c .. 32c + 31 of a row as q * scale, then + min: two roundings, as quant_cpu's numba
 * kernel and transformers' float32 dequantization round (decode32 fuses them into one) */
static inline __attribute__((always_inline)) void dequant32(const uint8_t *qrow, int bits, int c, const void *sc,
                                                            const void *mn, int half, int has_min, int group,
                                                            long srow, __m512 *w0, __m512 *w1) {
    __m512 a, b;
    widen32(qrow, bits, c, &a, &b);
    long g0 = srow + group_of(c * 32, group), g1 = srow + group_of(c * 32 + 16, group);
    *w0 = _mm512_mul_ps(a, _mm512_set1_ps(scale_at(sc, half, g0)));
    *w1 = _mm512_mul_ps(b, _mm512_set1_ps(scale_at(sc, half, g1)));
    if (has_min) {
        PD_OPAQUE(*w0); PD_OPAQUE(*w1); /* keeps the compiler from contracting into a fused multiply-add */
        *w0 = _mm512_add_ps(*w0, _mm512_set1_ps(scale_at(mn, half, g0)));
        *w1 = _mm512_add_ps(*w1, _mm512_set1_ps(scale_at(mn, half, g1)));
    }
}

/* out [end - start, cols] = rows [start, end) dequantized: float32, or bf16 (nearest even, as
 * torch's float-to-bf16 conversion) where bf16 is set. Returns 0, or -1 for a layout or shape it
 * does not take (the caller then dequantizes with numba). */
int pd_dequant_rows(const uint8_t *q, int cols, int bits, const void *scales, const void *mins, int half,
                    int has_min, int group, int start, int end, void *out, int bf16, int threads) {
    if (cols % 32 || (group != 16 && group % 32) || (bits != 4 && bits != 8) || half == 2) return -1;
#ifndef __AVX512BF16__
    if (bf16) return -1;
#endif
    long qstride = row_bytes(bits, cols), sstride = cols / group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = start; n < end; n++)
        for (int c = 0; c < cols / 32; c++) {
            __m512 w0, w1;
            dequant32(q + n * qstride, bits, c, scales, mins, half, has_min, group, n * sstride, &w0, &w1);
            long at = (long)(n - start) * cols + c * 32;
#ifdef __AVX512BF16__
            if (bf16) {
                _mm512_storeu_si512((uint16_t *)out + at, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
                continue;
            }
#endif
            _mm512_storeu_ps((float *)out + at, w0);
            _mm512_storeu_ps((float *)out + at + 16, w1);
        }
    return 0;
}

/* The bf16 tile product's conversions (dequant_tiles: x rounded to bf16 before the product, its bf16
 * result widened into the float32 output's columns), in torch's thread pool with AVX-512: torch's
 * own conversion kernels (AVX2 in this build, each its own parallel region) were 15% of a bf16
 * prefill's samples. Both are torch's values (nearest even; widening is exact), but for denormal
 * inputs, which vcvtne2ps2bf16 flushes to zero as the compiled step's bf16 products do. */

/* out [rows, cols] bf16 = x [rows, cols] float32 rounded, both contiguous; -1 without AVX-512 BF16 */
int pd_round_bf16(const float *x, long rows, long cols, uint16_t *out, int threads) {
#ifdef __AVX512BF16__
    long n = rows * cols, vectors = n / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long i = 0; i < vectors; i++)
        _mm512_storeu_si512(out + 32 * i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 32 * i + 16),
                                                                     _mm512_loadu_ps(x + 32 * i)));
    for (long i = vectors * 32; i < n; i++) {
        uint32_t bits;
        __builtin_memcpy(&bits, x + i, 4);
        out[i] = (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16); /* nearest even (finite values) */
    }
    return 0;
#else
    return -1;
#endif
}

/* out[r][0 : cols] (row stride out_ld floats) = src[r][0 : cols] (bf16, row stride cols), exactly */
void pd_widen_bf16(const uint16_t *src, long rows, long cols, float *out, long out_ld, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < rows; r++) pd_widen_row(src + r * cols, cols, out + r * out_ld);
}
