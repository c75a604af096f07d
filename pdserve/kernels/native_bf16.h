/* What the bf16 products share (native_gemv_bf16.c: AVX-512 BF16 dot products; native_gemv_amx.c:
 * AMX tiles): the weights' dequantization to bf16 and a 16 x 16 transpose of 32-bit words. */
#pragma once
#include "native_amx.h"
#include "native_simd.h"
#include <stdint.h>

#if PD_AVX512 /* the kernels that call it are AVX-512 BF16's and AMX's */
/* r[i] (row i of a 16 x 16 matrix of 32-bit words) -> r[j] (column j), in registers: pairs of
 * rows interleaved by words, then by word pairs, then the 128-bit lanes of four rows' results */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], c[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* c[4k + g], lane L: column 4L + k of rows 4g .. 4g + 3 */
    for (int g = 0; g < 4; g++) {
        __m512i lo01 = t[4 * g], hi01 = t[4 * g + 1], lo23 = t[4 * g + 2], hi23 = t[4 * g + 3];
        c[g] = _mm512_unpacklo_epi64(lo01, lo23);
        c[4 + g] = _mm512_unpackhi_epi64(lo01, lo23);
        c[8 + g] = _mm512_unpacklo_epi64(hi01, hi23);
        c[12 + g] = _mm512_unpackhi_epi64(hi01, hi23);
    }
    for (int k = 0; k < 4; k++) {
        __m512i *q = c + 4 * k;
        __m512i u0 = _mm512_shuffle_i32x4(q[0], q[1], 0x44), u1 = _mm512_shuffle_i32x4(q[0], q[1], 0xEE);
        __m512i u2 = _mm512_shuffle_i32x4(q[2], q[3], 0x44), u3 = _mm512_shuffle_i32x4(q[2], q[3], 0xEE);
        r[k] = _mm512_shuffle_i32x4(u0, u2, 0x88);
        r[4 + k] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
        r[8 + k] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
    }
}
#endif

/* whether pd_set_bf16 turned the bf16 products on (native_gemv_bf16.c) */
int pd_bf16_on(void);

/* rows [n, end) of a matrix (native_gemv.c's layouts), dequantized and rounded to bf16 (nearest
 * even) into buffer [end - n][cols] */
void pd_dequant_bf16(int cols, const uint8_t *q, int bits, const void *sc, const void *mn, int half, int has_min,
                     int group, int n, int end, uint16_t *buffer);

/* out [tokens, nrows] = x [tokens, cols] @ w^T with bf16 operands on AMX tiles (B tiles from pack, a
 * pd_bf16_tiles_pack of bf16 rows, where given); 0 where this CPU, build or kernel has no AMX (the
 * caller then runs its own products) */
int pd_gemv_amx(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out, int threads);

/* x [tokens, cols] float32 -> xp [cols / 2][padded] words, each token t's columns 2p and 2p + 1 as a
 * pair of bf16 (tokens past `tokens` zero); a work-shared loop, called inside a parallel region */
void pd_x_pairs(const float *x, int tokens, int cols, int padded, uint32_t *xp);

/* the bytes of a pack of bf16 rows [nrows][cols] in AMX's B-tile layout (-1: none in this build) */
long pd_bf16_tiles_bytes(int nrows, int cols);
int pd_bf16_tiles_pack(const uint16_t *rows, int nrows, int cols, uint8_t *pack, int threads);
