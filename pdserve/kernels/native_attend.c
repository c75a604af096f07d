/* Paged decode attention on CPU: every sequence's query heads over its context in the paged KV
 * cache, softmax(q k^T * scale) v, for the compiled decode step (native_decode.c) and for the
 * Python layers' decode rows (native_paged.c). Built into the same library as native_gemv.c.
 */
#include "native_simd.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native_decode.h"
#include "native_exp.h"

/* A bf16 KV cache (m->kv_bf16) holds each element's upper 16 bits: widened exactly on reading */
static inline float kv_at(const pd_model *m, const float *plane, long at) {
    if (!m->kv_bf16) return plane[at];
    uint32_t u = (uint32_t)((const uint16_t *)plane)[at] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 16 elements of a cache row from element `at`, as float32 (BF: the cache holds bf16) */
static inline __attribute__((always_inline)) __m512 kv16(const float *plane, long at, const int BF) {
    if (!BF) return _mm512_loadu_ps(plane + at);
    return pd_bf16x16((const uint16_t *)plane + at);
}

/* s[i] = e^(s[i] - peak) / sum over i, for i < length; a sink (non-NULL) is one more logit in
 * the peak and the sum, whose share goes to no value (gpt-oss, as numba_ops) */
void pd_softmax(float *s, long length, const float *sink) {
    float peak = s[0], total = 0.f;
    long i = 0;
    if (length >= 16) { /* the peak in vectors: a maximum is the same in any order */
        __m512 top = _mm512_loadu_ps(s);
        for (i = 16; i + 16 <= length; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + i));
        peak = _mm512_reduce_max_ps(top);
    }
    for (; i < length; i++) peak = s[i] > peak ? s[i] : peak;
    if (sink) peak = *sink > peak ? *sink : peak;
    for (i = 0; i + 16 <= length; i += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(peak)));
        _mm512_storeu_ps(s + i, e);
        total += _mm512_reduce_add_ps(e);
    }
    for (; i < length; i++) {
        s[i] = expf(s[i] - peak);
        total += s[i];
    }
    if (sink) total += expf(*sink - peak);
    /* divided, not multiplied by 1 / total: each quotient as the scalar division gives it */
    for (i = 0; i + 16 <= length; i += 16)
        _mm512_storeu_ps(s + i, _mm512_div_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(total)));
    for (; i < length; i++) s[i] /= total;
}

/* Sixteen keys' dot vectors (each lane a partial sum over head_dim) reduced to one vector of their
 * sums, in _mm512_reduce_add_ps's association (lanes j + j+8, then + 4, + 2, + 1), so each score
 * equals the one-key reduction's bit for bit: 15 shuffle-and-add steps of 3 instructions for the
 * 16 keys, where one key's reduction took 8. dots[s] holds key 4 (s % 4) + s / 4 (key_slot): the
 * 4 x 4 transpose the last two steps leave, so that lane i of the result is key i. On the 2-core
 * AMX Xeon VM, SmolLM2's shape over bf16 caches: 32 x 256 keys in cache 0.48 -> 0.32 ms a layer,
 * 128 x 256 from memory 2.23 -> 2.12 ms (with the vectorised softmax). Tried, not kept: one item
 * per sequence over all its KV heads (a slot's heads read in one visit): no faster (2.08-2.18 ms);
 * the pool in 2 MiB pages: 1.81 ms, see host_memory.py for why not. */
static inline int key_slot(int key) { return 4 * (key % 4) + key / 4; }

static inline __attribute__((always_inline)) __m512 reduce16(const __m512 dots[16]) {
    __m512 a[8], b[4], c[2];
    for (int p = 0; p < 8; p++) /* j + j+8: slots 2p, 2p+1 in the halves */
        a[p] = _mm512_add_ps(_mm512_shuffle_f32x4(dots[2 * p], dots[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(dots[2 * p], dots[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; p++) /* j + j+4: slots 4p .. 4p+3 in the quarters */
        b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; p++) /* j + j+2 */
        c[p] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * p], b[2 * p + 1], 0x44), _mm512_shuffle_ps(b[2 * p], b[2 * p + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD)); /* j + j+1 */
}

/* The K and V rows of a sequence's keys are read from memory once a step, and each 16-token block
 * lies wherever the pool put it, so the hardware prefetcher loses the stream at every block
 * boundary. Two software prefetches run ahead of the K pass: K and V rows KV_FAR keys ahead into
 * L2, and K rows KV_NEAR keys ahead into L1; the V pass after the softmax takes V's rows from L2
 * (an item's V is 12-48 KB at 200 keys) with its own L1 prefetch. Into L1 alone at 12 keys, K and V
 * together, a thread kept too few lines in flight: 30 layers of SmolLM2 over 32 bf16 contexts of
 * 224 tokens took 10.7-14.3 ms (11-15 GB/s, a 2-thread streaming read: 26 GB/s); with the L2
 * prefetch 32 keys ahead, 7.1-7.6 ms (21-23 GB/s), alternated in one process; 24 and 48 keys
 * within 5% of 32, 96 slower; float32 caches the same (1.4-1.6x). */
#define KV_NEAR 8
#define KV_FAR 32

static inline __attribute__((always_inline)) void kv_prefetch(const float *plane, long at, const int D16, const int BF,
                                                              const int L2) {
    const char *row = BF ? (const char *)((const uint16_t *)plane + at) : (const char *)(plane + at);
    for (int line = 0; line < D16 * (BF ? 32 : 64); line += 64)
        L2 ? _mm_prefetch(row + line, _MM_HINT_T1) : _mm_prefetch(row + line, _MM_HINT_T0);
}

/* A position's cache row, stepped key by key (three cursors a pass: no division a key) */
typedef struct {
    const int32_t *table;
    long block, slot, base, row, last; /* base: kh's offset in a row; last: the sequence's last block */
} kv_cursor;

static inline kv_cursor kv_cursor_at(const pd_model *m, const int32_t *table, long t, long end, int kh) {
    kv_cursor c = {table, t / m->block_size, t % m->block_size, kh * m->s_head, 0, (end - 1) / m->block_size};
    if (c.block <= c.last) c.row = table[c.block] * m->s_block + c.slot * m->s_slot + c.base;
    return c;
}

static inline void kv_cursor_next(const pd_model *m, kv_cursor *c) {
    if (++c->slot < m->block_size) {
        c->row += m->s_slot;
        return;
    }
    c->slot = 0;
    if (++c->block <= c->last) c->row = c->table[c->block] * m->s_block + c->base;
}

/* the cursor's row of `plane` (and of `also`, or NULL) prefetched into L2 or L1, the cursor moved on */
static inline __attribute__((always_inline)) void prefetch_ahead(const pd_model *m, const float *plane, kv_cursor *c,
                                                                  const float *also, const int D16, const int BF,
                                                                  const int L2) {
    kv_prefetch(plane, c->row, D16, BF, L2);
    if (also) kv_prefetch(also, c->row, D16, BF, L2);
    kv_cursor_next(m, c);
}

#define MAX_NG 4  /* query heads an item holds in registers */
#define MAX_D16 16 /* head_dim / 16 held in registers: up to 256 (one head at a time there) */

/* Query heads g0 .. g0 + NG - 1 of KV head kh's group, of sequence b, over its context:
 * softmax(q k^T * scale) v, as numba_ops._decode_kernel, with head_dim = 16 * D16. NG and D16 are
 * constants once inlined, so the queries and the sums stay in registers: each key and value row
 * is loaded once for the NG heads. scores holds NG x max_len floats. */
static inline __attribute__((always_inline)) void attend_regs(const pd_model *m, const pd_layer *L,
                                                              const float *q, const float *sinks, int kh, const int32_t *table,
                                                              long first, long length, float *scores,
                                                              int max_len, float *out, const int NG,
                                                              const int D16, const int BF) {
    __m512 qs[MAX_NG][MAX_D16], acc[MAX_NG][MAX_D16];
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < D16; c++) {
            qs[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D16 * 16 + c * 16), _mm512_set1_ps(m->scale));
            acc[g][c] = _mm512_setzero_ps();
        }
    kv_cursor at = kv_cursor_at(m, table, first, first + length, kh), near = at, far = at;
    for (long i = 0; i < length && i < KV_FAR; i++) prefetch_ahead(m, L->k_cache, &far, L->v_cache, D16, BF, 1);
    for (long i = 0; i < length && i < KV_NEAR; i++) prefetch_ahead(m, L->k_cache, &near, NULL, D16, BF, 0);
    __m512 dots[MAX_NG][16];
    for (long i = 0; i < length; i++, kv_cursor_next(m, &at)) {
        if (i + KV_FAR < length) prefetch_ahead(m, L->k_cache, &far, L->v_cache, D16, BF, 1);
        if (i + KV_NEAR < length) prefetch_ahead(m, L->k_cache, &near, NULL, D16, BF, 0);
        __m512 k[MAX_D16];
        for (int c = 0; c < D16; c++) k[c] = kv16(L->k_cache, at.row + c * 16, BF);
        long first16 = i & ~15L; /* keys in whole sixteens reduce together; the rest one by one */
        for (int g = 0; g < NG; g++) {
            __m512 dot = _mm512_mul_ps(qs[g][0], k[0]);
            for (int c = 1; c < D16; c++) dot = _mm512_fmadd_ps(qs[g][c], k[c], dot);
            if (first16 + 16 > length) scores[g * max_len + i] = _mm512_reduce_add_ps(dot);
            else dots[g][key_slot((int)(i - first16))] = dot;
        }
        if ((i & 15) == 15 && first16 + 16 <= length)
            for (int g = 0; g < NG; g++) _mm512_storeu_ps(scores + g * max_len + first16, reduce16(dots[g]));
    }
    for (int g = 0; g < NG; g++) pd_softmax(scores + (long)g * max_len, length, sinks ? sinks + g : NULL);
    at = near = kv_cursor_at(m, table, first, first + length, kh);
    for (long i = 0; i < length && i < KV_NEAR; i++) prefetch_ahead(m, L->v_cache, &near, NULL, D16, BF, 0);
    for (long i = 0; i < length; i++, kv_cursor_next(m, &at)) {
        if (i + KV_NEAR < length) prefetch_ahead(m, L->v_cache, &near, NULL, D16, BF, 0);
        for (int c = 0; c < D16; c++) {
            __m512 v = kv16(L->v_cache, at.row + c * 16, BF);
            for (int g = 0; g < NG; g++)
                acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * max_len + i]), v, acc[g][c]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < D16; c++) _mm512_storeu_ps(out + g * D16 * 16 + c * 16, acc[g][c]);
}

/* The same for any head_dim and group, with the queries and sums in memory. */
static void attend_any(const pd_model *m, const pd_layer *L, const float *q, const float *sinks, int kh, int ng, const int32_t *table,
                       long first, long length, float *scores, int max_len, float *out) {
    int D = m->head_dim;
    float qs[ng * D], acc[ng * D];
    for (int i = 0; i < ng * D; i++) qs[i] = q[i] * m->scale;
    for (long i = 0; i < length; i++) {
        long key = pd_cache_row(m, table, first + i, kh);
        for (int g = 0; g < ng; g++) {
            float dot = 0.f;
            if (m->kv_bf16)
                for (int d = 0; d < D; d++) dot += qs[g * D + d] * kv_at(m, L->k_cache, key + d);
            else {
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; d++) dot += qs[g * D + d] * L->k_cache[key + d];
            }
            scores[g * max_len + i] = dot;
        }
    }
    for (int g = 0; g < ng; g++) pd_softmax(scores + (long)g * max_len, length, sinks ? sinks + g : NULL);
    memset(acc, 0, sizeof(acc));
    for (long i = 0; i < length; i++) {
        long value = pd_cache_row(m, table, first + i, kh);
        for (int g = 0; g < ng; g++) {
            float w = scores[(long)g * max_len + i];
            if (m->kv_bf16)
                for (int d = 0; d < D; d++) acc[g * D + d] += w * kv_at(m, L->v_cache, value + d);
            else {
#pragma omp simd
                for (int d = 0; d < D; d++) acc[g * D + d] += w * L->v_cache[value + d];
            }
        }
    }
    memcpy(out, acc, sizeof(acc));
}

#define ATTEND_REGS(NG, D16)                                                                          \
    (m->kv_bf16 ? attend_regs(m, L, q, sinks, kh, table, first, length, scores, max_len, o, NG, D16, 1) \
                : attend_regs(m, L, q, sinks, kh, table, first, length, scores, max_len, o, NG, D16, 0))

/* Query heads g0 .. g0 + ng - 1 of KV head kh's group, of sequence b (a window's keys only). Head
 * sizes 64, 128 and 256 take the group in register-sized parts (4 or 3 heads of 64, 2 of 128, 1 of 256), each
 * part loading the keys and values once for its heads: a group of 2 (Qwen3-MoE's shape) or 8
 * (Qwen3-30B-A3B's) ran through attend_any, at a few times the cost. */
static void attend_one(const pd_model *m, const pd_layer *L, const float *qkv, long cols, int b, int kh, int g0,
                       int ng, const int32_t *table, int32_t end, float *scores, int max_len, float *out) {
    int D = m->head_dim, group = m->heads / m->kv_heads;
    long first = L->window > 0 && end > L->window ? end - L->window : 0, length = end - first;
    const float *q = qkv + (long)b * cols + ((long)kh * group + g0) * D;
    float *o = out + (long)b * m->heads * D + ((long)kh * group + g0) * D;
    const float *sinks = L->sinks ? L->sinks + (long)kh * group + g0 : NULL;
    int part = D == 64 ? (ng % 4 == 0 || ng > 4 ? 4 : ng) : D == 128 ? (ng > 1 ? 2 : 1) : D == 256 ? 1 : 0;
    if (part == 0) {
        attend_any(m, L, q, sinks, kh, ng, table, first, length, scores, max_len, o);
        return;
    }
    for (int g = 0; g < ng; g += part, q += part * D, o += part * D, scores += (long)part * max_len,
             sinks = sinks ? sinks + part : NULL) {
        int n = ng - g < part ? ng - g : part;
        if (D == 64 && n == 1) ATTEND_REGS(1, 4);
        else if (D == 64 && n == 2) ATTEND_REGS(2, 4);
        else if (D == 64 && n == 3) ATTEND_REGS(3, 4);
        else if (D == 64) ATTEND_REGS(4, 4);
        else if (D == 256) ATTEND_REGS(1, 16);
        else if (n == 1) ATTEND_REGS(1, 8);
        else ATTEND_REGS(2, 8);
    }
}

/* every sequence's attention, in parallel over sequences (each item all its KV heads in turn),
 * over (sequence, KV head) when the sequences are too few to share out, or over (sequence, query
 * head) when those are too few too (one request: SmolLM2 has 3 KV heads, 9 query heads); out
 * [tokens, heads * head_dim].
 * Why a sequence's heads in one item: a cache row holds all its KV heads (384 bytes at SmolLM2's
 * shape), and each head's pass reads 128 of them. As items of their own the heads of a sequence
 * ran on both cores at once, each core pulling the same blocks' lines; in turn on one core, the
 * later heads find them in its L2. 30 layers of SmolLM2 over bf16 contexts on the 2-core AMX Xeon,
 * alternated in one process, medians of 7: 128 x 224 tokens 44.5 -> 38.3 ms, 32 x 224 11.4 -> 9.3,
 * 8 x 224 2.4 -> 2.1, 128 x 1,024 202 -> 178; 4 x 1,024 5.9 -> 5.8 (left to the heads' items). */
static int sequence_items_from = 0; /* sequences from which items are whole sequences; 0: 4 a thread */

/* sets sequence_items_from (0: the default), returning what it was: benchmarks alternate it */
int pd_set_attend_sequence_items_from(int tokens) {
    int was = sequence_items_from;
    sequence_items_from = tokens;
    return was;
}

int pd_attend(const pd_model *m, const pd_layer *L, const float *qkv, long cols, int tokens, const int32_t *tables,
              int max_blocks, const int32_t *lens, float *out, int threads) {
    int from = sequence_items_from > 0 ? sequence_items_from : 4 * threads;
    int max_len = 1, group = m->heads / m->kv_heads, by_sequence = tokens >= from && tokens * m->kv_heads >= 4 * threads;
    int per = tokens * m->kv_heads >= 4 * threads ? group : 1, items = tokens * m->heads / per;
    for (int b = 0; b < tokens; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    float *scores = malloc(sizeof(float) * (size_t)tokens * m->heads * max_len);
    if (!scores) return -2;
    if (by_sequence) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int b = 0; b < tokens; b++)
            for (int kh = 0; kh < m->kv_heads; kh++)
                attend_one(m, L, qkv, cols, b, kh, 0, group, tables + (long)b * max_blocks, lens[b],
                           scores + ((size_t)b * m->kv_heads + kh) * group * max_len, max_len, out);
    } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int item = 0; item < items; item++) {
            int b = item / (m->heads / per), head = item % (m->heads / per) * per;
            attend_one(m, L, qkv, cols, b, head / group, head % group, per, tables + (long)b * max_blocks, lens[b],
                       scores + (size_t)item * per * max_len, max_len, out);
        }
    }
    free(scores);
    return 0;
}
