/* The Python layers' per-row ops over many rows (a prefill step's), on every thread of torch's
 * pool: the residual add + RMSNorm and rotate-half RoPE of numba_fused.py, which run on one thread
 * (about 4 ms a layer for 2,048 tokens of SmolLM2, an eighth of a bf16 prefill, while torch's
 * second thread waited). Each row as pd_add_norm and pd_rope compute it (native_decode.c: sums in
 * another order than numba's), so numba_fused takes them only under bf16 products (not exact by
 * design); float32 keeps numba's values. So does the MLP's SiLU(gate) * up. */
#include "native_simd.h"
#include <math.h>
#include <stdint.h>

#include "native_decode.h"
#include "native_exp.h"

/* summed = x + delta (where delta is given; else summed is x), out = w * RMSNorm(summed), per row */
void pd_norm_rows(const float *x, const float *delta, float *summed, const float *w, float eps, int tokens,
                  int cols, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tokens; t++) {
        const float *xr = x + (long)t * cols;
        float *sr = summed + (long)t * cols, *o = out + (long)t * cols, ss = 0.f;
        for (int c = 0; c < cols; c++) {
            float v = delta ? xr[c] + delta[(long)t * cols + c] : xr[c];
            sr[c] = v;
            ss += v * v;
        }
        float inv = 1.0f / sqrtf(ss / (float)cols + eps);
        for (int c = 0; c < cols; c++) o[c] = w[c] * (sr[c] * inv);
    }
}

/* RoPE in place on q [tokens, q_heads, dim] and k [tokens, k_heads, dim] (token strides q_stride,
 * k_stride floats; heads contiguous), cos and sin [tokens, dim] */
void pd_rope_rows(float *q, long q_stride, int q_heads, float *k, long k_stride, int k_heads, int dim,
                  const float *cos, const float *sin, int tokens, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tokens; t++) {
        pd_rope(q + t * q_stride, q_heads, dim, cos + (long)t * dim, sin + (long)t * dim);
        pd_rope(k + t * k_stride, k_heads, dim, cos + (long)t * dim, sin + (long)t * dim);
    }
}

/* act [tokens, inter] = SiLU(gate) * up for gate_up [tokens, 2 inter] (gate first), float32, as
 * pd_gate_mul computes each row: one pass on every thread, where torch's SiLU and multiply took two
 * over a strided view (4.4% of an int8 prefill of 32 x 160 tokens, perf) */
void pd_silu_mul_rows(const float *gate_up, int tokens, int inter, float *act, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tokens; t++) pd_gate_mul(gate_up + (long)t * 2 * inter, 1, inter, 0, act + (long)t * inter);
}

/* act [tokens, inter] bf16 = SiLU(gate) * up, gate_up [tokens, 2 inter] bf16 (gate first): the MLP
 * between its bf16 products with no float32 pass over [tokens, inter] (layers/bf16_mlp.py); inter a
 * multiple of 16. SiLU as pd_gate_mul's, rounded to bf16 as the down product's input would be.
 * Returns -1 without AVX-512 BF16. */
int pd_silu_mul_bf16(const uint16_t *gate_up, int tokens, int inter, uint16_t *act, int threads) {
#ifdef __AVX512BF16__
    if (inter % 16) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tokens; t++) {
        const uint16_t *gate = gate_up + (long)t * 2 * inter, *up = gate + inter;
        uint16_t *a = act + (long)t * inter;
        for (int i = 0; i < inter; i += 16) {
            __m512 g = pd_bf16x16(gate + i);
            __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            _mm256_storeu_si256((__m256i *)(a + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, pd_bf16x16(up + i))));
        }
    }
    return 0;
#else
    return -1;
#endif
}
