/* What the int8 products' two kernels share (native_gemv_int8.c with VNNI, native_gemv_int8_amx.c
 * with AMX's int8 tiles): x's side quantized per token and block of 32 columns, and the layout of a
 * matrix's int8 pack. Both kernels read the same pack and compute the same integer dot products
 * and the same float32 sums a block, so either gives the same bits. */
#ifndef PD_INT8_H
#define PD_INT8_H
#include "native_amx.h"
#include "native_simd.h"
#include <stdint.h>

#ifdef __AVX512VNNI__
/* x's side of the products, by token: codes [tokens][cols] (signed bytes); dx, xs (the sum of the
 * block's rounded values, dx * sum(c)) and xc (-128 * sum(c), for 8-bit weights) [tokens][blocks] */
typedef struct {
    int8_t *codes;
    float *dx, *xs;
    int32_t *xc;
    int blocks;
} x_side;

/* token t's codes, scales and sums (Q8_0's rule) */
static inline void quantize_token(const float *x, int cols, int t, const x_side *xq) {
    for (int blk = 0; blk < xq->blocks; blk++) {
        const float *row = x + (long)t * cols + blk * 32;
        long at = (long)t * xq->blocks + blk;
        __m512 a = _mm512_loadu_ps(row), b = _mm512_loadu_ps(row + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
        _mm_storeu_si128((__m128i *)(xq->codes + (long)t * cols + blk * 32), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(xq->codes + (long)t * cols + blk * 32 + 16), _mm512_cvtepi32_epi8(qb));
        int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        xq->dx[at] = amax / 127.f;
        xq->xs[at] = xq->dx[at] * (float)sum;
        xq->xc[at] = -128 * sum;
    }
}

/* Lane i of a task's vectors holds row 4 (i % 4) + i / 4 of its 16: the order a 4 x 4 transpose
 * of dwords leaves them in (transpose16x4). The order is its own inverse: un-permuting the sums
 * uses the same indices. */
static inline __m512i lane_rows(void) { return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15); }

/* A matrix's int8 pack (pd_int8_pack): for each task of 16 rows, its codes in those vectors, a
 * 4-bit block's nibbles not yet split (4 vectors a block; 8-bit codes: 8, offset by 128), then
 * its blocks' scales and mins in lane order, in the checkpoint's float16 or float32 (so a decode
 * step reads as many bytes as before); each task 64-byte aligned. Made once per matrix: every
 * call had gathered the 16 rows' blocks and transposed them and their scales, once per 192 tokens
 * (perf, a 32-request decode step of SmolLM2: a third of the int8 products' time). */
typedef struct {
    long task_bytes, code_bytes, scale_bytes; /* scale_bytes: a task's scales (and as many mins) */
    int half, has_min;
} int8_pack;

static inline int8_pack pack_layout(int cols, int bits, int half, int has_min) {
    int blocks = cols / 32;
    long code_bytes = (long)blocks * (bits == 8 ? 8 : 4) * 64, scale_bytes = (long)blocks * 16 * (half ? 2 : 4);
    long bytes = code_bytes + scale_bytes * (has_min ? 2 : 1);
    int8_pack p = {(bytes + 63) / 64 * 64, code_bytes, scale_bytes, half, has_min};
    return p;
}

/* 16 lane-ordered scales (or mins) of block blk of a task, as float32 */
static inline __m512 pack_scales16(const int8_pack *p, const uint8_t *task, int mins, int blk) {
    const uint8_t *at = task + p->code_bytes + (mins ? p->scale_bytes : 0);
    return p->half ? _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)at + blk))
                   : _mm512_load_ps((const float *)at + 16 * blk);
}

/* AMX's int8 tiles (native_gemv_int8_amx.c): whether a call of `tokens` tokens takes them (the CPU
 * has them, the process was granted them, tokens at or past pd_int8_amx_min_tokens); the tile
 * configuration a thread loads before its tasks and releases after; a task's tokens [c0, c1) as
 * task_tokens computes them, with `staging` (64-byte aligned, 512 bytes a block) for its codes */
int pd_int8_amx_takes(int tokens);
void pd_int8_amx_configure(void);
void pd_int8_amx_release(void);
void pd_int8_amx_task(const int8_pack *p, const uint8_t *task, const x_side *xq, int cols, int eight, int c0, int c1,
                      float *out, int nrows, int n, uint8_t *staging);
#endif
#endif
