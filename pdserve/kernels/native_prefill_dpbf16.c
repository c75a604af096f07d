/* native_prefill_amx.c's bf16 causal prefill attention on CPUs with AVX-512 BF16 and no AMX (Zen 4
 * and 5): its two products in vdpbf16ps, 16 float32 sums of bf16 pairs an instruction, from the same
 * packed keys and values (native_prefill_bf16.h). Queries and probabilities rounded to bf16, keys
 * and values as they are (a bf16 KV cache's rows, exact), float32 sums; native_prefill.py picks it
 * where the step's products are bf16 or int8 already, as it picks AMX's.
 *
 * Why: the float32 kernel (native_prefill.c) ran at about 280 GFLOP/s on the 2-core Zen 5 VM, a
 * 2,400-token prompt's attention 0.7 s of its 1.25 s prefill; vdpbf16ps issues as often as an FMA
 * and does twice its work (477 GFLOP/s a core measured, against about 240 for FMAs).
 *
 * Per work item (as AMX's): the item's queries rounded to bf16, then
 *   S = Q K^T, SCORE_ROWS rows x 32 keys in registers, a query's dimension pair broadcast against
 *   a key tile's row (that pair of 16 keys),
 *   each row's softmax over the keys its query sees, divided by its sum, then rounded to bf16,
 *   O = P V, OUT_ROWS rows x 64 dimensions in registers, a row's probability pair broadcast
 *   against a value tile's row (those two keys' 16 dimensions), stored straight into out.
 */
#include "native_prefill_bf16.h"

#if defined(__AVX512BF16__)

#define SCORE_ROWS 8 /* query rows a score pass: 8 x 2 accumulators */
#define OUT_ROWS 4   /* probability rows an output pass: 4 x 4 accumulators (64 dimensions) */

static inline __m512bh pair_of(const uint32_t *words, long i) {
    return (__m512bh)_mm512_set1_epi32((int)words[i]);
}

/* s[r][0 : ld] = Q_r . K^T for SCORE_ROWS rows at qb (D words a row); kb's pair chunks `chunks`
 * tiles apart */
static void score_rows(const uint16_t *qb, int D, const uint32_t *kb, int chunks, int ld, float *s) {
    const uint32_t *q = (const uint32_t *)qb; /* row r's dimension pair w: q[r * D / 2 + w] */
    for (int kc = 0; kc < ld / 16; kc += 2) {
        __m512 acc[SCORE_ROWS][2];
        for (int r = 0; r < SCORE_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int pc = 0; pc < D / 32; pc++) {
            const uint32_t *k0 = kb + ((long)pc * chunks + kc) * 256, *k1 = k0 + 256;
            for (int p = 0; p < 16; p++) {
                __m512bh b0 = (__m512bh)_mm512_loadu_si512(k0 + 16 * p), b1 = (__m512bh)_mm512_loadu_si512(k1 + 16 * p);
                for (int r = 0; r < SCORE_ROWS; r++) {
                    __m512bh a = pair_of(q, (long)r * (D / 2) + 16 * pc + p);
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
                }
            }
        }
        for (int r = 0; r < SCORE_ROWS; r++) {
            _mm512_storeu_ps(s + (long)r * ld + 16 * kc, acc[r][0]);
            _mm512_storeu_ps(s + (long)r * ld + 16 * kc + 16, acc[r][1]);
        }
    }
}

/* os[r] (NULL: a padding row) = P_r V over keys [0, seen) for OUT_ROWS rows of probabilities at pb
 * (ld words a row, zero past each row's keys) */
static void out_rows(const uint16_t *pb, int ld, const uint32_t *vb, int D, int seen, float *const *os) {
    const uint32_t *p = (const uint32_t *)pb; /* row r's key pair w: p[r * ld / 2 + w] */
    const int dcs = D / 16, kps = (seen + 31) / 32;
    for (int d0 = 0; d0 < dcs; d0 += 4) { /* 64 dimensions a pass (D is a multiple of 64) */
        __m512 acc[OUT_ROWS][4];
        for (int r = 0; r < OUT_ROWS; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
        for (int kp = 0; kp < kps; kp++)
            for (int j = 0; j < 16; j++) {
                const uint32_t *b = vb + ((long)kp * dcs + d0) * 256 + 16 * j;
                __m512bh v0 = (__m512bh)_mm512_loadu_si512(b), v1 = (__m512bh)_mm512_loadu_si512(b + 256);
                __m512bh v2 = (__m512bh)_mm512_loadu_si512(b + 512), v3 = (__m512bh)_mm512_loadu_si512(b + 768);
                for (int r = 0; r < OUT_ROWS; r++) {
                    __m512bh a = pair_of(p, (long)r * (ld / 2) + 16 * kp + j);
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, v0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, v1);
                    acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, v2);
                    acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, v3);
                }
            }
        for (int r = 0; r < OUT_ROWS; r++)
            if (os[r])
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(os[r] + 16 * (d0 + c), acc[r][c]);
    }
}

/* One work item: rows r = g * nq + i (query head g of the group, query q0 + i) */
static void attend_item(const bf16_args *a, const bf16_item *w, const uint32_t *packed, bf16_buffers *buf) {
    const int keys = w->prefix + w->q1, ld = (keys + KEYS_STEP - 1) / KEYS_STEP * KEYS_STEP;
    const int rows = a->group * (w->q1 - w->q0), padded = (rows + 15) / 16 * 16, D = a->D;
    round_queries(a, w, rows, padded, buf->qb);
    for (int r0 = 0; r0 < padded; r0 += SCORE_ROWS)
        score_rows(buf->qb + (long)r0 * D, D, packed + w->kb, w->chunks, ld, buf->s + (long)r0 * ld);
    softmax_rows(a, w, rows, padded, ld, buf);
    for (int r0 = 0; r0 < padded; r0 += OUT_ROWS) {
        float *os[OUT_ROWS];
        int seen = output_rows(a, w, rows, r0, OUT_ROWS, os);
        if (seen) out_rows(buf->pb + (long)r0 * ld, ld, packed + w->vb, D, seen, os);
    }
}

/* pd_prefill_attention's contract (native_prefill.c) in vdpbf16ps; -1 for a shape it does not take */
int pd_prefill_attention_dpbf16(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                                long v_stride, const int32_t *starts, const int32_t *lens, int seqs, int heads,
                                int kv_heads, int D, float scale, float *out, int threads) {
    if (D % 64 || heads % kv_heads || seqs <= 0) return -1;
    bf16_args a = {q, k, v, out, q_stride, k_stride, v_stride, heads, kv_heads, heads / kv_heads, D, scale,
                   NULL, NULL, NULL, NULL, 1, 0, 0};
    return attend_all(&a, starts, lens, seqs, threads, attend_item, NULL, NULL);
}

/* pd_prefill_attention_amx_paged's contract (native_prefill_amx.c) in vdpbf16ps: prompts after a
 * prefix in a bf16 paged cache too */
int pd_prefill_attention_dpbf16_paged(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                                      long v_stride, const int32_t *starts, const int32_t *lens, const int32_t *prefix,
                                      int seqs, int heads, int kv_heads, int D, float scale, const uint16_t *k_cache,
                                      const uint16_t *v_cache, int block_size, long block_stride, const int32_t *tables,
                                      int max_blocks, float *out, int threads) {
    if (D % 64 || heads % kv_heads || seqs <= 0 || block_size <= 0) return -1;
    bf16_args a = {q, k, v, out, q_stride, k_stride, v_stride, heads, kv_heads, heads / kv_heads, D, scale,
                   k_cache, v_cache, tables, prefix, block_size, max_blocks, block_stride};
    return attend_all(&a, starts, lens, seqs, threads, attend_item, NULL, NULL);
}
#else
int pd_prefill_attention_dpbf16(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                                long v_stride, const int32_t *starts, const int32_t *lens, int seqs, int heads,
                                int kv_heads, int D, float scale, float *out, int threads) {
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)starts, (void)lens, (void)seqs;
    (void)heads, (void)kv_heads, (void)D, (void)scale, (void)out, (void)threads;
    return -1;
}

int pd_prefill_attention_dpbf16_paged(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                                      long v_stride, const int32_t *starts, const int32_t *lens, const int32_t *prefix,
                                      int seqs, int heads, int kv_heads, int D, float scale, const uint16_t *k_cache,
                                      const uint16_t *v_cache, int block_size, long block_stride, const int32_t *tables,
                                      int max_blocks, float *out, int threads) {
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)starts, (void)lens, (void)prefix;
    (void)seqs, (void)heads, (void)kv_heads, (void)D, (void)scale, (void)k_cache, (void)v_cache, (void)block_size;
    (void)block_stride, (void)tables, (void)max_blocks, (void)out, (void)threads;
    return -1;
}
#endif
