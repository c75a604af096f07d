/* The Python layers' per-row ops over many rows (a prefill step's), on every thread of torch's
 * pool: the residual add + RMSNorm and rotate-half RoPE of numba_fused.py, which run on one thread
 * (about 4 ms a layer for 2,048 tokens of SmolLM2, an eighth of a bf16 prefill, while torch's
 * second thread waited). RoPE as pd_rope computes it (native_decode.c), the norms' sums of squares
 * in 16 lanes (another order than numba's and pd_add_norm's), so numba_fused takes them only under
 * bf16 products (not exact by design); float32 keeps numba's values. So does the MLP's SiLU(gate) * up. */
#include "native_simd.h"
#include <math.h>
#include <stdint.h>

#include "native_decode.h"
#include "native_exp.h"

/* the sum of x[c]^2 over a row whose cols are a multiple of 16, in 16 lanes then _mm512_reduce_add_ps:
 * norm_row's order, which pd_add_norm takes too under bf16 products */
float pd_squares16(const float *x, int cols) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < cols; c += 16) {
        __m512 v = _mm512_loadu_ps(x + c);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* one row: sr = xr + the delta (float32 dr, or bf16 dh widened, exactly; else xr), o = w * RMSNorm(sr).
 * The sum of squares runs in 16 lanes where cols allows: one element after another it was a chain
 * of cols dependent FMAs, 2,300 cycles a 576-wide row, most of a 2,048-token prefill's norm time
 * once its rows went out in bf16 (layers/bf16_rows.py) */
static inline void norm_row(const float *xr, const float *dr, const uint16_t *dh, float *sr, const float *w, float eps,
                            int cols, float *o) {
    float ss = 0.f;
    if (cols % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < cols; c += 16) {
            __m512 v = _mm512_loadu_ps(xr + c);
            if (dr) v = _mm512_add_ps(v, _mm512_loadu_ps(dr + c));
            else if (dh) v = _mm512_add_ps(v, pd_bf16x16(dh + c));
            _mm512_storeu_ps(sr + c, v);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
    } else
        for (int c = 0; c < cols; c++) {
            float v = dr ? xr[c] + dr[c] : dh ? xr[c] + from_bf16_bits(dh[c]) : xr[c];
            sr[c] = v;
            ss += v * v;
        }
    float inv = 1.0f / sqrtf(ss / (float)cols + eps);
    for (int c = 0; c < cols; c++) o[c] = w[c] * (sr[c] * inv);
}

/* summed = x + delta (delta float32, or delta_bf16: a bf16 product's result, widened exactly; else
 * summed is x), out = w * RMSNorm(summed), per row. out_bf16 instead of out: the normed rows
 * rounded to bf16 as pd_round_bf16 rounds them, for the bf16 products that take them next
 * (layers/bf16_rows.py: the rounding pass over them and the float32 rows it read are gone); -1
 * where that cannot be done here (no AVX-512 BF16, or cols not a multiple of 32). */
int pd_norm_rows(const float *x, const float *delta, const uint16_t *delta_bf16, float *summed, const float *w,
                 float eps, int tokens, int cols, float *out, uint16_t *out_bf16, int threads) {
#ifndef __AVX512BF16__
    if (out_bf16) return -1;
#endif
    if (out_bf16 && cols % 32) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tokens; t++) {
        long at = (long)t * cols;
        float row[out_bf16 ? cols : 1];
        float *o = out_bf16 ? row : out + at;
        norm_row(x + at, delta ? delta + at : NULL, delta_bf16 ? delta_bf16 + at : NULL, summed + at, w, eps, cols, o);
#ifdef __AVX512BF16__
        for (int c = 0; out_bf16 && c < cols; c += 32)
            _mm512_storeu_si512(out_bf16 + at + c,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(o + c + 16), _mm512_loadu_ps(o + c)));
#endif
    }
    return 0;
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

/* out [tokens][width] float32 = qkv [tokens][width] bf16 widened (exactly), then q's heads and k's
 * rotated as pd_rope_rows rotates them (width = (q_heads + 2 k_heads) dim: q, k, v of a token in a
 * row). One pass, a token's row in L1 between the two: the widening and RoPE had been two passes
 * over [tokens, width] float32 (6% of a 2,048-token bf16 prefill of SmolLM2, layers/bf16_rows.py). */
void pd_widen_rope_rows(const uint16_t *qkv, int tokens, int q_heads, int k_heads, int dim, const float *cos,
                        const float *sin, float *out, int threads) {
    long width = (long)(q_heads + 2 * k_heads) * dim;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tokens; t++) {
        float *o = out + t * width;
        pd_widen_row(qkv + t * width, width, o);
        pd_rope(o, q_heads, dim, cos + (long)t * dim, sin + (long)t * dim);
        pd_rope(o + (long)q_heads * dim, k_heads, dim, cos + (long)t * dim, sin + (long)t * dim);
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

/* A bf16 KV cache's store of a step's keys and values (fp8_kv.NarrowKVOps): each token's row of
 * `width` floats (rows k_stride / v_stride apart) rounded to bf16 into its slot (slots < 0 skipped;
 * a slot's heads contiguous, blocks block_stride words apart), and the rounded values widened into
 * k_seen / v_seen [tokens][width]: what a prefill's attention must see, the cache's own values
 * (to_bf16_bits, as the compiled decode step stores them).
 * One pass in every thread of torch's pool, where torch's conversions and index_put took four
 * passes of about 0.5 ms each per layer of a 2,048-token prefill of SmolLM2. */
void pd_store_kv_bf16(const float *k, long k_stride, const float *v, long v_stride, int tokens, int width,
                      const int64_t *slots, int block_size, long block_stride, uint16_t *k_cache, uint16_t *v_cache,
                      float *k_seen, float *v_seen, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tokens; t++) {
        long slot = slots[t], at = slot / block_size * block_stride + slot % block_size * (long)width;
        const float *kr = k + t * k_stride, *vr = v + t * v_stride;
        float *ks = k_seen + (long)t * width, *vs = v_seen + (long)t * width;
        uint16_t kb[width], vb[width];
        for (int c = 0; c < width; c++) kb[c] = to_bf16_bits(kr[c]), vb[c] = to_bf16_bits(vr[c]);
        for (int c = 0; c < width; c++) ks[c] = from_bf16_bits(kb[c]), vs[c] = from_bf16_bits(vb[c]);
        if (slot < 0) continue;
        __builtin_memcpy(k_cache + at, kb, sizeof(uint16_t) * width);
        __builtin_memcpy(v_cache + at, vb, sizeof(uint16_t) * width);
    }
}

/* out[r] = the index of row r's first largest value (torch's max(dim=-1).indices on CPU): greedy
 * sampling's tokens, on every thread of torch's pool. torch's reduction took 3.0 ms for 128 rows of
 * SmolLM2's 49,152 logits on the 2-core AMX Xeon, 3% of a 128-request decode step. Each lane keeps
 * its largest value and that value's first index (a later equal value does not replace it), then
 * the lanes' largest with the smallest index among equals: the row's first maximum. -1 where a row
 * holds a NaN (torch's max returns the NaN's index; the caller leaves those rows to torch). With
 * AVX2 only, -1 for every row: torch's reduction. */
#if PD_AVX512
static long argmax_row(const float *x, long cols) {
    long c = 0, best_at = 0;
    float best = x[0];
    if (cols >= 16) {
        __m512 top = _mm512_loadu_ps(x);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = at;
        __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
        for (c = 16; c + 16 <= cols; c += 16) {
            __m512 v = _mm512_loadu_ps(x + c);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
            __mmask16 above = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            top = _mm512_mask_mov_ps(top, above, v);
            at = _mm512_mask_mov_epi32(at, above, idx);
        }
        if (nan) return -1;
        best = _mm512_reduce_max_ps(top);
        __mmask16 peak = _mm512_cmp_ps_mask(top, _mm512_set1_ps(best), _CMP_EQ_OQ);
        best_at = _mm512_mask_reduce_min_epi32(peak, at);
    }
    for (; c < cols; c++) {
        if (x[c] != x[c]) return -1;
        if (x[c] > best) best = x[c], best_at = c;
    }
    return best != best ? -1 : best_at;
}

/* out[r] for rows [0, rows) of x (row r at x + r * stride); 0, or -1 if any row holds a NaN */
int pd_argmax_rows(const float *x, long rows, long cols, long stride, int64_t *out, int threads) {
    int nan = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : nan) if (rows > 1)
    for (long r = 0; r < rows; r++) {
        out[r] = argmax_row(x + r * stride, cols);
        nan |= out[r] < 0;
    }
    return nan ? -1 : 0;
}
#else
int pd_argmax_rows(const float *x, long rows, long cols, long stride, int64_t *out, int threads) { return -1; }
#endif
