/* Causal attention of a prefill step's prompts on CPU (no window, no sinks), in float32, every
 * sequence in one call (native_prefill.py calls it): fresh prompts (pd_prefill_attention), and
 * chunks after a cached prefix (pd_prefill_attention_prefixed: the prefix's keys and values
 * gathered before the chunk's, each of its queries seeing the whole prefix).
 *
 * Why: torch's CPU flash attention, called once per sequence, ran a 160-token prompt's 9 heads in
 * about 0.5 ms a layer: a fifth of a bf16 prefill's time on SmolLM2. Its GQA path repeats K and V
 * per query head, and each call pays its own set-up and parallel region.
 *
 * Work items are (sequence, KV head, block of QB queries). An item's rows are its KV head's
 * `group` query heads times its queries: they share every K and V row they read. Per item:
 *   kt = K[0 : end]^T (keys up to the block's last query, the prefix's first; D x keys,
 *   zero-padded to 32 keys),
 *   S = (Q kt) * scale, 8 rows x 32 keys at a time in registers,
 *   each row's exact softmax over the keys its query sees (its own position and before),
 *   O = P V, 4 rows x 64 columns at a time, then / the row's sum.
 * Sums run in another order than torch's kernel (as between any two float32 kernels).
 */
#include "native_simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_exp.h"

#define QB 32          /* queries per work item */
#define KEY_STEP 32    /* keys per score tile: two vectors */
#define SCORE_ROWS 8   /* query rows per score tile */
#define OUT_ROWS 4     /* query rows per output tile */
#define OUT_COLS 64    /* columns per output tile: four vectors */

typedef struct {
    const float *q, *k, *v;
    float *out;
    long q_stride, k_stride, v_stride; /* floats from one token's row to the next ([heads, D] within) */
    int heads, kv_heads, group, D;
    float scale;
} prefill_args;

typedef struct {
    int start, len, kh, q0, q1; /* rows [start, start + len) of the step; queries [q0, q1) of them */
    int kv_start, prefix;       /* its keys: rows [kv_start, kv_start + prefix + len) of k and v */
} work_item;

/* the 16 x 16 floats at rows[i] (i < 16) transposed into out + i * ld: three rounds of shuffles */
static void transpose16(const float *const *rows, float *out, long ld) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(rows[i]);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    /* r[4j + c] holds, in its 128-bit lane L, column 4L + c of rows 4j .. 4j + 3: gather each
     * column's four row groups */
    for (int c = 0; c < 4; c++) {
        __m512 a = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
        __m512 e = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88), f = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
        __m512 l0 = _mm512_shuffle_f32x4(a, e, 0x88), l2 = _mm512_shuffle_f32x4(a, e, 0xDD);
        __m512 l1 = _mm512_shuffle_f32x4(b, f, 0x88), l3 = _mm512_shuffle_f32x4(b, f, 0xDD);
        _mm512_storeu_ps(out + (long)c * ld, l0);
        _mm512_storeu_ps(out + (long)(c + 4) * ld, l1);
        _mm512_storeu_ps(out + (long)(c + 8) * ld, l2);
        _mm512_storeu_ps(out + (long)(c + 12) * ld, l3);
    }
}

/* kt[d * ld + n] = K[n][d] for keys n < keys, zero past them up to ld (a multiple of 16) */
static void transpose_keys(const prefill_args *a, const float *k, int keys, int ld, float *kt,
                           const float *zero_row) {
    const float *rows[16];
    for (int n0 = 0; n0 < ld; n0 += 16) {
        for (int i = 0; i < 16; i++) rows[i] = n0 + i < keys ? k + (long)(n0 + i) * a->k_stride : zero_row;
        for (int d0 = 0; d0 < a->D; d0 += 16) {
            const float *cols[16];
            for (int i = 0; i < 16; i++) cols[i] = rows[i] == zero_row ? zero_row : rows[i] + d0;
            transpose16(cols, kt + (long)d0 * ld + n0, ld);
        }
    }
}

/* s[r][0 : ld] = scale * q_r . kt for SCORE_ROWS rows (their pointers in qs) */
static void score_tile(const float *const *qs, const float *kt, int D, int ld, float scale, float *s) {
    for (int n0 = 0; n0 < ld; n0 += KEY_STEP) {
        __m512 acc[SCORE_ROWS][2];
        for (int r = 0; r < SCORE_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            __m512 k0 = _mm512_loadu_ps(kt + (long)d * ld + n0), k1 = _mm512_loadu_ps(kt + (long)d * ld + n0 + 16);
            for (int r = 0; r < SCORE_ROWS; r++) {
                __m512 qv = _mm512_set1_ps(qs[r][d]);
                acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
            }
        }
        __m512 sc = _mm512_set1_ps(scale);
        for (int r = 0; r < SCORE_ROWS; r++) {
            _mm512_storeu_ps(s + (long)r * ld + n0, _mm512_mul_ps(acc[r][0], sc));
            _mm512_storeu_ps(s + (long)r * ld + n0 + 16, _mm512_mul_ps(acc[r][1], sc));
        }
    }
}

/* s[0 : ld] := e^(s - peak) over the first `seen` keys, 0 past them; returns their sum */
static float softmax_row(float *s, int seen, int ld) {
    __m512 most = _mm512_set1_ps(-INFINITY);
    int n = 0;
    for (; n + 16 <= seen; n += 16) most = _mm512_max_ps(most, _mm512_loadu_ps(s + n));
    if (n < seen) most = _mm512_mask_max_ps(most, (__mmask16)((1u << (seen - n)) - 1), most, _mm512_loadu_ps(s + n));
    __m512 total = _mm512_setzero_ps(), top = _mm512_set1_ps(_mm512_reduce_max_ps(most));
    n = 0;
    for (; n + 16 <= seen; n += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + n), top));
        _mm512_storeu_ps(s + n, e);
        total = _mm512_add_ps(total, e);
    }
    if (n < seen) {
        __mmask16 m = (__mmask16)((1u << (seen - n)) - 1);
        __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + n), top)));
        _mm512_storeu_ps(s + n, e);
        total = _mm512_add_ps(total, e);
        n += 16;
    }
    if (n < ld) memset(s + n, 0, sizeof(float) * (ld - n));
    return _mm512_reduce_add_ps(total);
}

/* out rows (pointers in os) = (p_r V[0 : keys]) / sums[r] for OUT_ROWS rows, columns [c0, c0 + 64) */
static void output_tile(const float *p, int ld, const float *v, long v_stride, int keys, int c0,
                        const float *sums, float *const *os) {
    __m512 acc[OUT_ROWS][4];
    for (int r = 0; r < OUT_ROWS; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int n = 0; n < keys; n++) {
        const float *row = v + n * v_stride + c0;
        __m512 v0 = _mm512_loadu_ps(row), v1 = _mm512_loadu_ps(row + 16);
        __m512 v2 = _mm512_loadu_ps(row + 32), v3 = _mm512_loadu_ps(row + 48);
        for (int r = 0; r < OUT_ROWS; r++) {
            __m512 pr = _mm512_set1_ps(p[(long)r * ld + n]);
            acc[r][0] = _mm512_fmadd_ps(pr, v0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(pr, v1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(pr, v2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(pr, v3, acc[r][3]);
        }
    }
    for (int r = 0; r < OUT_ROWS; r++) {
        if (!os[r]) continue;
        __m512 inv = _mm512_set1_ps(1.0f / sums[r]);
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(os[r] + c0 + 16 * c, _mm512_mul_ps(acc[r][c], inv));
    }
}

/* One work item; kt, s, sums hold at least D x ld, rows x ld and rows floats, zero_row D zeros */
static void attend_item(const prefill_args *a, const work_item *w, float *kt, float *s, float *sums,
                        const float *zero_row) {
    const int keys = w->prefix + w->q1, ld = (keys + KEY_STEP - 1) / KEY_STEP * KEY_STEP, nq = w->q1 - w->q0;
    const int rows = a->group * nq, padded = (rows + SCORE_ROWS - 1) / SCORE_ROWS * SCORE_ROWS;
    const int seen0 = w->prefix + w->q0 + 1; /* keys the item's first query sees */
    transpose_keys(a, a->k + (long)w->kv_start * a->k_stride + (long)w->kh * a->D, keys, ld, kt, zero_row);
    const float *qs[SCORE_ROWS];
    float *os[OUT_ROWS];
    for (int r0 = 0; r0 < padded; r0 += SCORE_ROWS) {
        for (int r = 0; r < SCORE_ROWS; r++) {  /* row r0 + r: query head g, query i of the block */
            int row = r0 + r, g = row / nq, i = row % nq;
            qs[r] = row < rows ? a->q + (long)(w->start + w->q0 + i) * a->q_stride + (long)(w->kh * a->group + g) * a->D
                               : zero_row;
        }
        score_tile(qs, kt, a->D, ld, a->scale, s + (long)r0 * ld);
    }
    for (int row = 0; row < rows; row++) sums[row] = softmax_row(s + (long)row * ld, seen0 + row % nq, ld);
    for (int row = rows; row < padded; row++) {
        memset(s + (long)row * ld, 0, sizeof(float) * ld);
        sums[row] = 1.f;
    }
    const float *v = a->v + (long)w->kv_start * a->v_stride + (long)w->kh * a->D;
    for (int r0 = 0; r0 < padded; r0 += OUT_ROWS) {
        int seen = 0; /* keys any of the tile's rows sees: past its own, a row's p is 0 */
        for (int r = 0; r < OUT_ROWS; r++) {
            int row = r0 + r, g = row / nq, i = row % nq;
            os[r] = row < rows ? a->out + ((long)(w->start + w->q0 + i) * a->heads + w->kh * a->group + g) * a->D
                               : NULL; /* out is contiguous */
            if (row < rows && seen0 + i > seen) seen = seen0 + i;
        }
        for (int c0 = 0; c0 < a->D; c0 += OUT_COLS)
            output_tile(s + (long)r0 * ld, ld, v, a->v_stride, seen, c0, sums + r0, os);
    }
}

/* the most keys first, so the dynamic schedule ends evenly */
static int more_keys_first(const void *x, const void *y) {
    const work_item *a = x, *b = y;
    return (b->prefix + b->q1) - (a->prefix + a->q1);
}

/* Every item of the sequences (kv_starts and prefixes NULL: fresh, keys at their query rows) */
static int attend_all(const prefill_args *a, const int32_t *starts, const int32_t *kv_starts,
                      const int32_t *prefixes, const int32_t *lens, int seqs, int threads) {
    int items = 0, longest = 0;
    for (int i = 0; i < seqs; i++) {
        int keys = lens[i] + (prefixes ? prefixes[i] : 0);
        items += a->kv_heads * ((lens[i] + QB - 1) / QB);
        longest = keys > longest ? keys : longest;
    }
    work_item *work = malloc(sizeof(work_item) * (items ? items : 1));
    if (!work) return -2;
    int n = 0;
    for (int i = 0; i < seqs; i++)
        for (int q0 = 0; q0 < lens[i]; q0 += QB)
            for (int kh = 0; kh < a->kv_heads; kh++)
                work[n++] = (work_item){starts[i], lens[i], kh, q0, q0 + QB < lens[i] ? q0 + QB : lens[i],
                                        kv_starts ? kv_starts[i] : starts[i], prefixes ? prefixes[i] : 0};
    qsort(work, n, sizeof(work_item), more_keys_first);
    const int D = a->D, ld_max = (longest + KEY_STEP - 1) / KEY_STEP * KEY_STEP;
    const int rows_max = (a->group * QB + SCORE_ROWS - 1) / SCORE_ROWS * SCORE_ROWS;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *kt = malloc(sizeof(float) * ((long)D * ld_max + (long)rows_max * ld_max + rows_max + D));
        if (!kt) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int j = 0; j < n; j++) {
            if (!kt) continue;
            float *s = kt + (long)D * ld_max, *sums = s + (long)rows_max * ld_max, *zero_row = sums + rows_max;
            memset(zero_row, 0, sizeof(float) * D);
            attend_item(a, &work[j], kt, s, sums, zero_row);
        }
        free(kt);
    }
    free(work);
    return failed ? -2 : 0;
}

/* q [T, heads, D], k and v [T, kv_heads, D] float32, packed by token (a token's row q_stride,
 * k_stride, v_stride floats after the one before; heads and D contiguous within); sequence i's rows
 * start at starts[i] and number lens[i]; out [T, heads, D] (contiguous) gets those sequences' rows.
 * D must be a multiple of 64. Returns 0, -1 for a shape it does not take, -2 when out of memory. */
int pd_prefill_attention(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                         long v_stride, const int32_t *starts, const int32_t *lens, int seqs, int heads,
                         int kv_heads, int D, float scale, float *out, int threads) {
    if (D % OUT_COLS || heads % kv_heads || seqs <= 0) return -1;
    prefill_args a = {q, k, v, out, q_stride, k_stride, v_stride, heads, kv_heads, heads / kv_heads, D, scale};
    return attend_all(&a, starts, NULL, NULL, lens, seqs, threads);
}

/* The same for chunks after a cached prefix: sequence i's queries are q's rows [starts[i],
 * starts[i] + lens[i]) at positions prefixes[i] onward; its keys and values are k's and v's rows
 * [kv_starts[i], kv_starts[i] + prefixes[i] + lens[i]), the prefix's first. */
int pd_prefill_attention_prefixed(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                                  long v_stride, const int32_t *starts, const int32_t *kv_starts,
                                  const int32_t *prefixes, const int32_t *lens, int seqs, int heads, int kv_heads,
                                  int D, float scale, float *out, int threads) {
    if (D % OUT_COLS || heads % kv_heads || seqs <= 0) return -1;
    prefill_args a = {q, k, v, out, q_stride, k_stride, v_stride, heads, kv_heads, heads / kv_heads, D, scale};
    return attend_all(&a, starts, kv_starts, prefixes, lens, seqs, threads);
}
