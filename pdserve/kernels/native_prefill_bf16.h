/* What native_prefill_amx.c (AMX tiles) and native_prefill_bf16.c (AVX-512 BF16 dot products)
 * share: the bf16 causal prefill attention's work items, its packing of each (sequence, KV head)'s
 * keys and values into bf16 pair tiles, its softmax, and the parallel region that runs them. Each
 * kernel brings its two products (scores and outputs) as an item function.
 *
 * The packed layouts are AMX's B tiles, and they are vdpbf16ps's B operands as they are: a key
 * tile's row p holds dimension pair p of 16 keys (one 32-bit word a key), a value tile's row j the
 * pair of keys 2j, 2j + 1 for 16 dimensions (one word a dimension). A query's (or a probability
 * row's) pair broadcast to 16 words is the other operand.
 */
#pragma once
#include "native_simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_bf16.h"
#include "native_exp.h"

#if defined(__AVX512BF16__)

#define QB 32        /* queries per work item, as native_prefill.c */
#define KEYS_STEP 32 /* keys a row's scores and probabilities are padded to (AMX: an A tile's) */

typedef struct {
    const float *q, *k, *v;
    float *out;
    long q_stride, k_stride, v_stride;
    int heads, kv_heads, group, D;
    float scale;
    /* a cached prefix's keys and values: a bf16 paged cache [blocks][block_size][kv_heads][D]
     * (blocks block_stride words apart), each sequence's block table max_blocks entries long */
    const uint16_t *k_cache, *v_cache;
    const int32_t *tables, *prefix; /* prefix NULL: no sequence has one */
    int block_size, max_blocks;
    long block_stride;
} bf16_args;

typedef struct {
    int seq, start, kh, q0, q1; /* sequence seq's first row of the step, its KV head, queries [q0, q1) */
    int prefix;                 /* its cached keys: query i sees keys up to prefix + i */
    int chunks;                 /* its keys in 16s, padded to 32s: kb's stride between pair chunks */
    long kb, vb;                /* words into the packed keys and values of (sequence, KV head) */
} bf16_item;

typedef struct {
    int seq, start, len, kh, n0, n1; /* keys [n0, n1) of (sequence, KV head) to pack, multiples of 32 */
    int chunks;
    long kb, vb;
} pack_job;

typedef struct { /* one thread's buffers, sized for the step's longest item */
    uint16_t *qb, *pb;    /* A rows: queries [rows][D], probabilities [rows][ld] (bf16) */
    float *s;             /* scores [rows][ld] float32 */
} bf16_buffers;

/* 32 floats -> 32 bf16 (nearest even) at out */
static inline void round32(const float *x, uint16_t *out) {
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x)));
}

/* Where one (sequence, KV head)'s keys or values are: the first `prefix` in the paged cache, the
 * rest in the step's float32 rows (a bf16 cache's values: rounding them is exact) */
typedef struct {
    const float *rows;
    long stride;
    const uint16_t *cache; /* the cache plane at this KV head */
    const int32_t *table;
    int prefix;
} kv_source;

static kv_source source_of(const bf16_args *a, const pack_job *j, int values) {
    int prefix = a->prefix ? a->prefix[j->seq] : 0;
    const float *rows = values ? a->v + (long)j->start * a->v_stride : a->k + (long)j->start * a->k_stride;
    const uint16_t *cache = values ? a->v_cache : a->k_cache;
    return (kv_source){rows + (long)j->kh * a->D, values ? a->v_stride : a->k_stride,
                       prefix ? cache + (long)j->kh * a->D : NULL, prefix ? a->tables + (long)j->seq * a->max_blocks : NULL,
                       prefix};
}

/* dimensions [d0, d0 + 16) of key n in bf16 */
static inline __m256i words16(const bf16_args *a, const kv_source *src, int n, int d0) {
    if (n < src->prefix) {
        long slot = (long)src->table[n / a->block_size] * a->block_stride + (long)(n % a->block_size) * a->kv_heads * a->D;
        return _mm256_loadu_si256((const __m256i *)(src->cache + slot + d0));
    }
    return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src->rows + (long)(n - src->prefix) * src->stride + d0));
}

static inline __m512i join(__m256i low, __m256i high) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

/* kb[pc][kc] (tile: row p = pair p of dimension chunk pc, word n = key 16 kc + n) for the chunks
 * of keys [n0, n1), zero past `keys`: each 16-key chunk's rows in bf16, a 16 x 16 word transpose */
static void key_tiles(const bf16_args *a, const kv_source *src, int keys, int n0, int n1, int chunks, uint32_t *kb) {
    for (int kc = n0 / 16; kc < n1 / 16; kc++)
        for (int pc = 0; pc < a->D / 32; pc++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                int n = 16 * kc + i;
                r[i] = n < keys ? join(words16(a, src, n, 32 * pc), words16(a, src, n, 32 * pc + 16)) : _mm512_setzero_si512();
            }
            transpose16(r);
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(kb + ((long)pc * chunks + kc) * 256 + 16 * p, r[p]);
        }
}

/* vb[kp][dc] (tile: row j = keys 32 kp + 2j and + 2j + 1 interleaved, word d = dimension 16 dc + d)
 * for keys [n0, n1), zero past `keys` (a zero probability times a zero value: no NaN) */
static void value_tiles(const bf16_args *a, const kv_source *src, int keys, int n0, int n1, uint32_t *vb) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int dcs = a->D / 16;
    for (int kp = n0 / 32; kp < n1 / 32; kp++)
        for (int j = 0; j < 16; j++) {
            int n = 32 * kp + 2 * j;
            for (int dc = 0; dc < dcs; dc++) {
                __m256i e = n < keys ? words16(a, src, n, 16 * dc) : _mm256_setzero_si256();
                __m256i o = n + 1 < keys ? words16(a, src, n + 1, 16 * dc) : _mm256_setzero_si256();
                _mm512_storeu_si512(vb + ((long)kp * dcs + dc) * 256 + 16 * j, _mm512_permutexvar_epi16(interleave, join(e, o)));
            }
        }
}

/* p[0 : ld] = softmax(s[0 : seen] * scale) rounded to bf16, 0 past seen (s is overwritten) */
static void softmax_bf16(float *s, int seen, int ld, float scale, uint16_t *p) {
    __m512 most = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
    for (int n = 0; n < seen; n += 16) {
        __mmask16 m = seen - n >= 16 ? 0xFFFF : (__mmask16)((1u << (seen - n)) - 1);
        most = _mm512_mask_max_ps(most, m, most, _mm512_loadu_ps(s + n));
    }
    /* scale > 0: the peak of the scaled scores is the scaled peak */
    __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(most) * scale), total = _mm512_setzero_ps();
    int n = 0;
    for (; n < seen; n += 16) {
        __mmask16 m = seen - n >= 16 ? 0xFFFF : (__mmask16)((1u << (seen - n)) - 1);
        __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + n), sc, top)));
        _mm512_storeu_ps(s + n, e);
        total = _mm512_add_ps(total, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(p + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + i), inv)));
    for (; n < ld; n += 16) _mm256_storeu_si256((__m256i *)(p + n), _mm256_setzero_si256());
}

/* (sequence, KV head)'s packed keys and values: where they start in the packed buffer (words) */
typedef struct {
    int chunks;
    long kb, vb;
} packing;

#define PACK_KEYS 64 /* keys a packing job */

/* The packing jobs and the work items (the last query blocks, with the most keys, first, as
 * native_prefill.c); *words: the packed buffer's size; *most_keys: a sequence's most keys. NULL
 * when out of memory. */
static bf16_item *plan(const bf16_args *a, const int32_t *starts, const int32_t *lens, int seqs, int *count,
                      pack_job **jobs, int *job_count, long *words, int *most_keys) {
    int items = 0, njobs = 0, kv = a->kv_heads, longest = 0;
    *most_keys = 0;
    for (int i = 0; i < seqs; i++) {
        int keys = (a->prefix ? a->prefix[i] : 0) + lens[i];
        items += kv * ((lens[i] + QB - 1) / QB);
        njobs += kv * ((keys + PACK_KEYS - 1) / PACK_KEYS);
        longest = lens[i] > longest ? lens[i] : longest;
        *most_keys = keys > *most_keys ? keys : *most_keys;
    }
    bf16_item *work = malloc(sizeof(bf16_item) * (items ? items : 1));
    packing *at = malloc(sizeof(packing) * (size_t)seqs * kv);
    *jobs = malloc(sizeof(pack_job) * (njobs ? njobs : 1));
    if (!work || !at || !*jobs) {
        free(work), free(at), free(*jobs);
        return NULL;
    }
    long used = 0;
    int n = 0;
    for (int i = 0; i < seqs; i++) {
        int keys = (a->prefix ? a->prefix[i] : 0) + lens[i], ld = (keys + KEYS_STEP - 1) / KEYS_STEP * KEYS_STEP;
        for (int kh = 0; kh < kv; kh++) {
            packing *p = at + (long)i * kv + kh;
            *p = (packing){ld / 16, used, used + (long)a->D * ld / 2};
            used += (long)a->D * ld;
            for (int n0 = 0; n0 < ld; n0 += PACK_KEYS)
                (*jobs)[n++] = (pack_job){i, starts[i], keys, kh, n0, n0 + PACK_KEYS < ld ? n0 + PACK_KEYS : ld,
                                          p->chunks, p->kb, p->vb};
        }
    }
    *job_count = n;
    n = 0;
    for (int q1 = (longest + QB - 1) / QB * QB; q1 > 0; q1 -= QB)
        for (int i = 0; i < seqs; i++) {
            if (q1 - QB >= lens[i]) continue;
            for (int kh = 0; kh < kv; kh++) {
                packing *p = at + (long)i * kv + kh;
                work[n++] = (bf16_item){i, starts[i], kh, q1 - QB, q1 < lens[i] ? q1 : lens[i],
                                       a->prefix ? a->prefix[i] : 0, p->chunks, p->kb, p->vb};
            }
        }
    free(at);
    *count = n;
    *words = used;
    return work;
}

static void pack(const bf16_args *a, const pack_job *j, uint32_t *packed) {
    kv_source keys = source_of(a, j, 0), values = source_of(a, j, 1);
    key_tiles(a, &keys, j->len, j->n0, j->n1, j->chunks, packed + j->kb);
    value_tiles(a, &values, j->len, j->n0, j->n1, packed + j->vb);
}

static int alloc_buffers(bf16_buffers *b, int D, int ld, int rows) {
    b->qb = malloc(sizeof(uint16_t) * (size_t)rows * D);
    b->pb = malloc(sizeof(uint16_t) * (size_t)rows * ld);
    b->s = malloc(sizeof(float) * (size_t)rows * ld);
    return b->qb && b->pb && b->s;
}

static void free_buffers(bf16_buffers *b) {
    free(b->qb);
    free(b->pb);
    free(b->s);
}


/* row r = g * nq + i of a work item (query head g of the group, query q0 + i) as bf16 into qb,
 * rows from `rows` to `padded` zero */
static void round_queries(const bf16_args *a, const bf16_item *w, int rows, int padded, uint16_t *qb) {
    const int nq = w->q1 - w->q0, D = a->D;
    for (int row = 0; row < padded; row++) {
        uint16_t *qr = qb + (long)row * D;
        if (row >= rows) {
            memset(qr, 0, sizeof(uint16_t) * D);
            continue;
        }
        const float *q = a->q + (long)(w->start + w->q0 + row % nq) * a->q_stride + (long)(w->kh * a->group + row / nq) * D;
        for (int d = 0; d < D; d += 32) round32(q + d, qr + d);
    }
}

/* each row's probabilities from its scores (buf->s) into buf->pb, padding rows zero */
static void softmax_rows(const bf16_args *a, const bf16_item *w, int rows, int padded, int ld, bf16_buffers *buf) {
    const int nq = w->q1 - w->q0;
    for (int row = 0; row < padded; row++) {
        uint16_t *p = buf->pb + (long)row * ld;
        if (row < rows) softmax_bf16(buf->s + (long)row * ld, w->prefix + w->q0 + row % nq + 1, ld, a->scale, p);
        else memset(p, 0, sizeof(uint16_t) * ld);
    }
}

/* os[r] = where rows [r0, r0 + count) of the item write (NULL: a padding row); returns the keys any
 * of them sees (past its own, a row's probability is 0) */
static int output_rows(const bf16_args *a, const bf16_item *w, int rows, int r0, int count, float **os) {
    const int nq = w->q1 - w->q0;
    int seen = 0;
    for (int r = 0; r < count; r++) {
        int row = r0 + r, g = row / nq, i = row % nq;
        os[r] = row < rows ? a->out + ((long)(w->start + w->q0 + i) * a->heads + w->kh * a->group + g) * a->D : NULL;
        if (row < rows && w->prefix + w->q0 + i + 1 > seen) seen = w->prefix + w->q0 + i + 1;
    }
    return seen;
}

typedef void (*item_fn)(const bf16_args *a, const bf16_item *w, const uint32_t *packed, bf16_buffers *buf);

/* Every item of the step in one parallel region: each (sequence, KV head)'s keys and values
 * packed once, then the work items by `attend`; `begin` and `end` (or NULL) set up and release a
 * thread's state around its items (AMX's tile configuration) */
static int attend_all(const bf16_args *a, const int32_t *starts, const int32_t *lens, int seqs, int threads,
                      item_fn attend, void (*begin)(void), void (*end)(void)) {
    int n = 0, njobs = 0, most_keys = 0, failed = 0;
    long words = 0;
    pack_job *jobs = NULL;
    bf16_item *work = plan(a, starts, lens, seqs, &n, &jobs, &njobs, &words, &most_keys);
    uint32_t *packed = work ? aligned_alloc(64, sizeof(uint32_t) * (size_t)(words ? words : 16)) : NULL;
    if (!packed) {
        free(work), free(jobs);
        return -2;
    }
    const int ld_max = (most_keys + KEYS_STEP - 1) / KEYS_STEP * KEYS_STEP, rows_max = (a->group * QB + 15) / 16 * 16;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 4)
        for (int j = 0; j < njobs; j++) pack(a, &jobs[j], packed);
        bf16_buffers buf;
        int ok = alloc_buffers(&buf, a->D, ld_max, rows_max);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        if (begin) begin();
#pragma omp for schedule(dynamic, 1)
        for (int j = 0; j < n; j++)
            if (ok) attend(a, &work[j], packed, &buf);
        if (end) end();
        free_buffers(&buf);
    }
    free(work), free(jobs), free(packed);
    return failed ? -2 : 0;
}
#endif
