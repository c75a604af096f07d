/* One token times a group-quantized weight matrix, on x86-64 with AVX-512: pdserve's decode step at
 * concurrency 1. Compiled and loaded by native_gemv.py; the layouts are quant_cpu's:
 * - int4: two values a byte. Each run of 32 columns is 16 bytes, byte j holding column j in its
 *   low nibble and column j + 16 in its high one (GGUF's Q4_0/Q4_1 block order);
 * - int8: one value a byte;
 * - scales and mins per group of 16 columns or of a power-of-two multiple of 32, float32 or float16
 *   bits; w = q * scale (+ min).
 * Each block of 32 columns is widened to float32 and dequantized as q * scale + min, in vector
 * registers, then multiply-added into the row's sum: the result is x @ dequantized(w).T up to the
 * order of the sums, as numba's kernel gives it, 1.6 to 2.5 times as fast on SmolLM2's shapes
 * (benchmarks/bench_native_gemv.py).
 */
#include <immintrin.h>
#include <stdint.h>

#define ROWS_PER_TASK 16
#define ROWS_PER_PASS 4 /* rows sharing each load of x: eight independent multiply-add chains */
/* Each row's bytes this far ahead are prefetched: the hardware prefetcher alone left SmolLM2's
 * 28 MB int8 LM head at 11 GB/s (2.7 ms); with this, 1.1 ms, about a one-thread copy's bandwidth. */
#define PREFETCH_BYTES 4096

static inline float scale_at(const void *s, int half, long idx) {
    return half ? _cvtsh_ss(((const uint16_t *)s)[idx]) : ((const float *)s)[idx];
}

/* columns 32c .. 32c + 31 of a row, dequantized into two vectors of 16 */
static inline __attribute__((always_inline)) void decode32(const uint8_t *qrow, int bits, int c, const void *sc,
                                                           const void *mn, int half, int has_min, int group,
                                                           long srow, __m512 *w0, __m512 *w1) {
    __m512 a, b;
    if (bits == 4) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qrow + c * 16)));
        a = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
        b = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    } else {
        a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qrow + c * 32))));
        b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qrow + c * 32 + 16))));
    }
    long g0 = srow + (c * 32) / group, g1 = srow + (c * 32 + 16) / group;
    __m512 s0 = _mm512_set1_ps(scale_at(sc, half, g0)), s1 = _mm512_set1_ps(scale_at(sc, half, g1));
    if (has_min) {
        *w0 = _mm512_fmadd_ps(a, s0, _mm512_set1_ps(scale_at(mn, half, g0)));
        *w1 = _mm512_fmadd_ps(b, s1, _mm512_set1_ps(scale_at(mn, half, g1)));
    } else {
        *w0 = _mm512_mul_ps(a, s0);
        *w1 = _mm512_mul_ps(b, s1);
    }
}

/* out[n .. n + R) for R rows (R a constant once inlined) */
static inline __attribute__((always_inline)) void rows(const float *x, int cols, const uint8_t *q, int bits,
                                                       const void *sc, const void *mn, int half, int has_min,
                                                       int group, float *out, int n, const int R) {
    long qstride = bits == 4 ? cols / 2 : cols, sstride = cols / group;
    __m512 acc[ROWS_PER_PASS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int c = 0; c < cols / 32; c++) {
        for (int r = 0; r < R; r++)
            _mm_prefetch((const char *)(q + (n + r) * qstride) + c * (bits == 4 ? 16 : 32) + PREFETCH_BYTES, _MM_HINT_T0);
        __m512 x0 = _mm512_loadu_ps(x + c * 32), x1 = _mm512_loadu_ps(x + c * 32 + 16);
        for (int r = 0; r < R; r++) {
            __m512 w0, w1;
            decode32(q + (n + r) * qstride, bits, c, sc, mn, half, has_min, group, (n + r) * sstride, &w0, &w1);
            acc[r][0] = _mm512_fmadd_ps(w0, x0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w1, x1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) out[n + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

/* x [cols] float32 @ w.T -> out [nrows]. Returns 0, or -1 for a shape it does not take (columns not
 * a multiple of 32, a group neither 16 nor a multiple of 32): the caller then uses numba's kernel. */
int pd_gemv_one_token(const float *x, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                      const void *mins, int half, int has_min, int group, float *out, int threads) {
    if (cols % 32 || (group != 16 && group % 32) || (bits != 4 && bits != 8)) return -1;
    int tasks = (nrows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tasks; t++) {
        int n = t * ROWS_PER_TASK, end = n + ROWS_PER_TASK < nrows ? n + ROWS_PER_TASK : nrows;
        for (; n + ROWS_PER_PASS <= end; n += ROWS_PER_PASS)
            rows(x, cols, q, bits, scales, mins, half, has_min, group, out, n, ROWS_PER_PASS);
        for (; n < end; n++) rows(x, cols, q, bits, scales, mins, half, has_min, group, out, n, 1);
    }
    return 0;
}
