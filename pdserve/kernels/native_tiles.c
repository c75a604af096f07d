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
#include <immintrin.h>
#include <stdint.h>

#include "native_quant_blocks.h"

/* columns 32c .. 32c + 31 of a row as q * scale, then + min: two roundings, as quant_cpu's numba
 * kernel and transformers' float32 dequantization round (decode32 fuses them into one) */
static inline __attribute__((always_inline)) void dequant32(const uint8_t *qrow, int bits, int c, const void *sc,
                                                            const void *mn, int half, int has_min, int group,
                                                            long srow, __m512 *w0, __m512 *w1) {
    __m512 a, b;
    widen32(qrow, bits, c, &a, &b);
    long g0 = srow + (c * 32) / group, g1 = srow + (c * 32 + 16) / group;
    *w0 = _mm512_mul_ps(a, _mm512_set1_ps(scale_at(sc, half, g0)));
    *w1 = _mm512_mul_ps(b, _mm512_set1_ps(scale_at(sc, half, g1)));
    if (has_min) {
        __asm__("" : "+v"(*w0), "+v"(*w1)); /* keeps the compiler from contracting into a fused multiply-add */
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
