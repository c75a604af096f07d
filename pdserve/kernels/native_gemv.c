/* A few tokens times a group-quantized weight matrix, on x86-64 with AVX-512: pdserve's decode steps.
 * Compiled and loaded by native_gemv.py; the layouts are quant_cpu's:
 * - int4: two values a byte. Each run of 32 columns is 16 bytes, byte j holding column j in its
 *   low nibble and column j + 16 in its high one (GGUF's Q4_0/Q4_1 block order);
 * - int8: one value a byte;
 * - scales and mins per group of 16 columns or of a multiple of 32, float32 or float16 bits;
 *   w = q * scale (+ min);
 * - float32 (bits 32): an unquantized matrix, its rows read as they are (no scales), so a float
 *   model's decode step takes the compiled step too;
 * - bf16 (bits BITS_BF16): an unquantized matrix whose values are bf16 (a bf16 checkpoint served
 *   in float32): its rows read as bf16 and widened exactly, half the bytes of float32's;
 * - MXFP4 (bits BITS_FP4, gpt-oss's experts as pdserve.kernels.mxfp4_cpu holds them): two e2m1
 *   codes a byte, byte j holding column 2j in its low nibble and 2j + 1 in its high one, and one
 *   E8M0 power of two a group of 32 (half 2); w = fp4(code) * 2^(e - 127). A code becomes its
 *   value by a 16-entry table lookup in a register; pd_gemv orders x's columns alike (each block's
 *   even columns, then its odd ones), so every path below runs on it as on GGUF's nibble order.
 * Each block of 32 columns is widened to float32 in vector registers. At one token (groups of a
 * power-of-two multiple of 32) its integers are dotted with x and scaled once; otherwise it is
 * dequantized as q * scale + min and multiply-added into every token's sums: up to 8 tokens (a
 * speculative verify step's k + 1 rows) in one pass, the block decoded once; past 8, a pair of rows
 * is dequantized once into a buffer and multiplied into the tokens 8 at a time (a verify step of
 * several requests), and float32 rows are taken four at a time into 6 tokens. The result is
 * x @ dequantized(w).T up to the order of the sums, as numba's kernel gives it, 1.4 to 2.6 times
 * as fast on SmolLM2's shapes (benchmarks/kernels/bench_native_gemv.py).
 */
#include "native_simd.h"
#include <stdint.h>
#include <stdlib.h>

#include "native_quant_blocks.h"

#define ROWS_PER_TASK 16
#define ROWS_PER_PASS 4   /* one token: rows sharing each load of x, eight independent multiply-add chains */
#define TOKENS_PER_PASS 8 /* more tokens: 2 rows x 8 tokens, 16 sums in registers */
/* Each row's bytes this far ahead are prefetched: the hardware prefetcher alone left SmolLM2's
 * 28 MB int8 LM head at 11 GB/s (2.7 ms); with this, 1.1 ms, about a one-thread copy's bandwidth. */
#define PREFETCH_BYTES 4096
/* ... and a bf16 matrix's rows (a bf16 checkpoint's) this far: a one-token step of SmolLM2's bf16
 * checkpoint waited on memory at 4096 (8.5 ms a step against 6.2-6.3 at 16 KiB, alternated in one
 * process, 2-core Zen 5 VM); 8 and 32 KiB in between and the same */
#define PREFETCH_BYTES_BF16 16384
/* task_many keeps two dequantized rows on the stack, 64 KiB at most: within L2, and well within a
 * thread's stack */
#define MAX_DECODED_COLS 8192

/* R rows from n times NT tokens from t0 (R, NT constants once inlined); x holds rows of cols floats,
 * out rows of nrows. Each block's decoded rows feed every token: at NT tokens the decoding is paid
 * once for NT * 2 multiply-adds a row. */
static inline __attribute__((always_inline)) void tile(const float *x, int cols, const uint8_t *q, int bits,
                                                       const void *sc, const void *mn, int half, int has_min,
                                                       int group, float *out, int nrows, int n, int t0,
                                                       const int R, const int NT) {
    long qstride = row_bytes(bits, cols), sstride = cols / group;
    __m512 acc[ROWS_PER_PASS][TOKENS_PER_PASS][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
    for (int c = 0; c < cols / 32; c++) {
        __m512 w[ROWS_PER_PASS][2];
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char *)(q + (n + r) * qstride) + c * block_bytes(bits) +
                             (bits == BITS_BF16 ? PREFETCH_BYTES_BF16 : PREFETCH_BYTES), _MM_HINT_T0);
            decode32(q + (n + r) * qstride, bits, c, sc, mn, half, has_min, group, (n + r) * sstride, &w[r][0], &w[r][1]);
        }
        for (int t = 0; t < NT; t++) {
            const float *xt = x + (long)(t0 + t) * cols + c * 32;
            __m512 x0 = _mm512_loadu_ps(xt), x1 = _mm512_loadu_ps(xt + 16);
            for (int r = 0; r < R; r++) {
                if (NT == 1) { /* two chains a row: with one token, R rows give 2R independent sums */
                    acc[r][t][0] = _mm512_fmadd_ps(w[r][0], x0, acc[r][t][0]);
                    acc[r][t][1] = _mm512_fmadd_ps(w[r][1], x1, acc[r][t][1]);
                } else {
                    acc[r][t][0] = _mm512_fmadd_ps(w[r][1], x1, _mm512_fmadd_ps(w[r][0], x0, acc[r][t][0]));
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++)
            out[(long)(t0 + t) * nrows + n + r] =
                _mm512_reduce_add_ps(NT == 1 ? _mm512_add_ps(acc[r][t][0], acc[r][t][1]) : acc[r][t][0]);
}

/* One token, a group a power-of-two multiple of 32 columns (so a block has one scale): each block's integers are
 * dotted with x first and scaled once, q . x * scale, and the mins come in at the end as
 * sum_g min_g * X_g, X_g the sum of x over group g (as llama.cpp multiplies Q4_1). 1.4 times as fast
 * as dequantizing each block first. R rows from n; HALF and BITS constants once inlined. */
static inline __attribute__((always_inline)) void rows_one(const float *x, const float *xg, int cols,
                                                           const uint8_t *q, const void *sc, const void *mn,
                                                           int has_min, int group, float *out, int n,
                                                           const int R, const int HALF, const int BITS) {
    long qstride = row_bytes(BITS, cols), groups = cols / group;
    int shift = __builtin_ctz(group / 32);
    __m512 acc[ROWS_PER_PASS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int c = 0; c < cols / 32; c++) {
        __m512 x0 = _mm512_loadu_ps(x + c * 32), x1 = _mm512_loadu_ps(x + c * 32 + 16);
        for (int r = 0; r < R; r++) {
            const uint8_t *qrow = q + (n + r) * qstride;
            _mm_prefetch((const char *)qrow + c * block_bytes(BITS) + PREFETCH_BYTES, _MM_HINT_T0);
            __m512 a, b;
            widen32(qrow, BITS, c, &a, &b);
            __m512 dot = _mm512_fmadd_ps(b, x1, _mm512_mul_ps(a, x0));
            float scale = scale_at(sc, HALF, (n + r) * groups + (c >> shift));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(scale), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float sum = _mm512_reduce_add_ps(acc[r]);
        if (has_min)
            for (int g = 0; g < groups; g++) sum += scale_at(mn, HALF, (n + r) * groups + g) * xg[g];
        out[n + r] = sum;
    }
}

#define ROWS_ONE(HALF, BITS)                                                                          \
    do {                                                                                              \
        for (; n + ROWS_PER_PASS <= end; n += ROWS_PER_PASS)                                          \
            rows_one(x, xg, cols, q, sc, mn, has_min, group, out, n, ROWS_PER_PASS, HALF, BITS);      \
        for (; n < end; n++) rows_one(x, xg, cols, q, sc, mn, has_min, group, out, n, 1, HALF, BITS); \
    } while (0)

/* rows [n, end) of one token, a group a power-of-two multiple of 32 */
static void task_one(const float *x, const float *xg, int cols, const uint8_t *q, int bits, const void *sc,
                     const void *mn, int half, int has_min, int group, float *out, int n, int end) {
    if (bits == BITS_FP4) ROWS_ONE(2, BITS_FP4);
    else if (half && bits == 4) ROWS_ONE(1, 4);
    else if (half) ROWS_ONE(1, 8);
    else if (bits == 4) ROWS_ONE(0, 4);
    else ROWS_ONE(0, 8);
}

#define TILE(R, NT, n, t) tile(x, cols, q, bits, sc, mn, half, has_min, group, out, nrows, n, t, R, NT)

/* R rows already dequantized into w [R][cols] (see task_many), times NT tokens from t0: the same
 * sums as tile's, the rows read from L1 instead of decoded again for each pass over the tokens */
static inline __attribute__((always_inline)) void tile_decoded(const float *w, const float *x, int cols, float *out,
                                                               int nrows, int n, int t0, const int R, const int NT) {
    __m512 acc[2][TOKENS_PER_PASS];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();
    for (int c = 0; c < cols; c += 32) {
        __m512 w0[2], w1[2];
        for (int r = 0; r < R; r++) {
            w0[r] = _mm512_loadu_ps(w + (long)r * cols + c);
            w1[r] = _mm512_loadu_ps(w + (long)r * cols + c + 16);
        }
        for (int t = 0; t < NT; t++) {
            const float *xt = x + (long)(t0 + t) * cols + c;
            __m512 x0 = _mm512_loadu_ps(xt), x1 = _mm512_loadu_ps(xt + 16);
            for (int r = 0; r < R; r++)
                acc[r][t] = _mm512_fmadd_ps(w1[r], x1, _mm512_fmadd_ps(w0[r], x0, acc[r][t]));
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) out[(long)(t0 + t) * nrows + n + r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* Four float32 rows of w [4][cols] times NT <= 6 tokens from t0: 24 sums in registers, each 16
 * columns of the four rows loaded once for the NT tokens (2.4 multiply-adds a load, where
 * tile_decoded's 2 x 8 makes 1.6). Each sum runs over the columns in the same order as
 * tile_decoded's, so the results are the same to the bit. */
static inline __attribute__((always_inline)) void tile_rows4(const float *w, const float *x, int cols, float *out,
                                                             int nrows, int n, int t0, const int NT) {
    __m512 acc[4][6];
    for (int r = 0; r < 4; r++)
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();
    for (int c = 0; c < cols; c += 16) {
        __m512 w0 = _mm512_loadu_ps(w + c), w1 = _mm512_loadu_ps(w + cols + c);
        __m512 w2 = _mm512_loadu_ps(w + 2L * cols + c), w3 = _mm512_loadu_ps(w + 3L * cols + c);
        for (int t = 0; t < NT; t++) {
            __m512 xt = _mm512_loadu_ps(x + (long)(t0 + t) * cols + c);
            acc[0][t] = _mm512_fmadd_ps(w0, xt, acc[0][t]);
            acc[1][t] = _mm512_fmadd_ps(w1, xt, acc[1][t]);
            acc[2][t] = _mm512_fmadd_ps(w2, xt, acc[2][t]);
            acc[3][t] = _mm512_fmadd_ps(w3, xt, acc[3][t]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int t = 0; t < NT; t++) out[(long)(t0 + t) * nrows + n + r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* float32 rows [n, end) in fours (the rest through task_many) for more than TOKENS_PER_PASS tokens */
static int float_rows4(const float *x, int tokens, int cols, const float *w, float *out, int nrows, int n, int end) {
    for (; n + 4 <= end; n += 4)
        for (int t = 0; t < tokens; t += 6) {
            const float *wr = w + (long)n * cols;
            switch (tokens - t < 6 ? tokens - t : 6) {
            case 1: tile_rows4(wr, x, cols, out, nrows, n, t, 1); break;
            case 2: tile_rows4(wr, x, cols, out, nrows, n, t, 2); break;
            case 3: tile_rows4(wr, x, cols, out, nrows, n, t, 3); break;
            case 4: tile_rows4(wr, x, cols, out, nrows, n, t, 4); break;
            case 5: tile_rows4(wr, x, cols, out, nrows, n, t, 5); break;
            default: tile_rows4(wr, x, cols, out, nrows, n, t, 6);
            }
        }
    return n;
}

/* A pass over nt <= TOKENS_PER_PASS tokens with nt a constant, so its sums stay in registers */
#define BY_TOKENS(CALL, nt)            \
    switch (nt) {                      \
    case 1: CALL(1); break;            \
    case 2: CALL(2); break;            \
    case 3: CALL(3); break;            \
    case 4: CALL(4); break;            \
    case 5: CALL(5); break;            \
    case 6: CALL(6); break;            \
    case 7: CALL(7); break;            \
    default: CALL(TOKENS_PER_PASS);    \
    }

/* rows [n, end) for every token, up to TOKENS_PER_PASS of them (a verify step's k + 1 rows, a few
 * requests): one pass, each block decoded once */
static inline __attribute__((always_inline)) void task_few(const float *x, int tokens, int cols, const uint8_t *q, int bits, const void *sc,
                     const void *mn, int half, int has_min, int group, float *out, int nrows, int n, int end) {
#define PAIR(NT) TILE(2, NT, n, 0)
#define SINGLE(NT) TILE(1, NT, n, 0)
    for (; n + 2 <= end; n += 2) BY_TOKENS(PAIR, tokens);
    for (; n < end; n++) BY_TOKENS(SINGLE, tokens);
#undef PAIR
#undef SINGLE
}

/* rows [n, end) for more tokens: each pair of rows dequantized once into a buffer (as decode32
 * gives them; float32 rows are read where they are), then multiplied into the tokens
 * TOKENS_PER_PASS at a time */
static inline __attribute__((always_inline)) void task_many(const float *x, int tokens, int cols, const uint8_t *q, int bits, const void *sc,
                      const void *mn, int half, int has_min, int group, float *out, int nrows, int n, int end) {
    float buffer[bits == 32 ? 1 : 2 * cols];
    long qstride = row_bytes(bits, cols), sstride = cols / group;
    if (bits == 32) n = float_rows4(x, tokens, cols, (const float *)q, out, nrows, n, end);
    for (; n < end; n += 2) {
        int rows = end - n >= 2 ? 2 : 1;
        const float *w = bits == 32 ? (const float *)(q + n * qstride) : buffer;
        for (int r = 0; r < rows && bits != 32; r++)
            for (int c = 0; c < cols / 32; c++) {
                __m512 w0, w1;
                decode32(q + (n + r) * qstride, bits, c, sc, mn, half, has_min, group, (n + r) * sstride, &w0, &w1);
                _mm512_storeu_ps(buffer + (long)r * cols + c * 32, w0);
                _mm512_storeu_ps(buffer + (long)r * cols + c * 32 + 16, w1);
            }
        for (int t = 0; t < tokens; t += TOKENS_PER_PASS) {
            int nt = tokens - t < TOKENS_PER_PASS ? tokens - t : TOKENS_PER_PASS;
#define PAIR(NT) tile_decoded(w, x, cols, out, nrows, n, t, 2, NT)
#define SINGLE(NT) tile_decoded(w, x, cols, out, nrows, n, t, 1, NT)
            if (rows == 2) BY_TOKENS(PAIR, nt) else BY_TOKENS(SINGLE, nt)
#undef PAIR
#undef SINGLE
        }
    }
}

/* rows [n, end) for every token; inlined into task and task_fp4, below */
static inline __attribute__((always_inline)) void task_any(const float *x, int tokens, int cols, const uint8_t *q, int bits, const void *sc, const void *mn,
                 int half, int has_min, int group, float *out, int nrows, int n, int end) {
    if (tokens == 1) {
        for (; n + ROWS_PER_PASS <= end; n += ROWS_PER_PASS) TILE(ROWS_PER_PASS, 1, n, 0);
        for (; n < end; n++) TILE(1, 1, n, 0);
    } else if (tokens <= TOKENS_PER_PASS) {
        task_few(x, tokens, cols, q, bits, sc, mn, half, has_min, group, out, nrows, n, end);
    } else if (cols <= MAX_DECODED_COLS) {
        task_many(x, tokens, cols, q, bits, sc, mn, half, has_min, group, out, nrows, n, end);
    } else { /* rows too wide for task_many's buffer: decoded again for each pass */
        for (; n < end; n++)
            for (int t = 0; t < tokens; t += TOKENS_PER_PASS) {
                int nt = tokens - t < TOKENS_PER_PASS ? tokens - t : TOKENS_PER_PASS;
#define SINGLE(NT) TILE(1, NT, n, t)
                BY_TOKENS(SINGLE, nt)
#undef SINGLE
            }
    }
}

/* task_any for the integer and float32 layouts: the assumption lets the compiler drop MXFP4's
 * branches from the inlined loops (with them, 8 tokens of SmolLM2's Q4_1 rows took 13-18% longer) */
static void task(const float *x, int tokens, int cols, const uint8_t *q, int bits, const void *sc, const void *mn,
                 int half, int has_min, int group, float *out, int nrows, int n, int end) {
    if (bits == BITS_FP4 || half == 2) __builtin_unreachable();
    task_any(x, tokens, cols, q, bits, sc, mn, half, has_min, group, out, nrows, n, end);
}

/* task_any for MXFP4, its layout constant */
static void task_fp4(const float *x, int tokens, int cols, const uint8_t *q, const void *sc, float *out, int nrows,
                     int n, int end) {
    task_any(x, tokens, cols, q, BITS_FP4, sc, NULL, 2, 0, 32, out, nrows, n, end);
}

/* x [tokens, cols] float32 @ w.T -> out [tokens, nrows]. Returns 0, or -1 for a shape it does not take
 * (columns not a multiple of 32, a group neither 16 nor a multiple of 32): the caller then uses
 * numba's kernel. */
static int gemv(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out, int threads);

/* x's columns in MXFP4's nibble order: each block of 32 as its 16 even columns, then its 16 odd ones */
static void fp4_order(const float *x, long values, float *xo) {
    for (long c = 0; c < values; c += 32)
        for (int j = 0; j < 16; j++) {
            xo[c + j] = x[c + 2 * j];
            xo[c + 16 + j] = x[c + 2 * j + 1];
        }
}

int pd_gemv(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
            const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out, int threads) {
    if (cols % 32 || (group != 16 && group % 32) || (bits != 4 && bits != 8 && bits != 32 && bits != BITS_BF16 &&
                                                  bits != BITS_FP4))
        return -1;
    if ((bits == BITS_FP4) != (half == 2) || (bits == BITS_FP4 && (group != 32 || has_min))) return -1;
    if (bits != BITS_FP4)
        return gemv(x, tokens, cols, q, nrows, bits, scales, mins, half, has_min, group, pack, out, threads);
    float *xo = malloc(sizeof(float) * tokens * cols);
    if (!xo) return -2;
    fp4_order(x, (long)tokens * cols, xo);
    int rc = gemv(xo, tokens, cols, q, nrows, bits, scales, mins, half, has_min, group, NULL, out, threads);
    free(xo);
    return rc;
}

static int gemv(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out, int threads) {
    if (pd_gemv_int8(x, tokens, cols, q, nrows, bits, scales, mins, half, has_min, group, pack, out, threads)) return 0;
    if (pd_gemv_bf16(x, tokens, cols, q, nrows, bits, scales, mins, half, has_min, group, pack, out, threads)) return 0;
    if (pd_gemv_panels(x, tokens, cols, q, nrows, bits, scales, mins, half, has_min, group, out, threads)) return 0;
    /* the one-token path finds a block's group by a shift: group / 32 a power of two */
    int one = tokens == 1 && bits != 32 && bits != BITS_BF16 && group % 32 == 0 && ((group / 32) & (group / 32 - 1)) == 0, groups = cols / group;
    float xg[one && has_min ? groups : 1]; /* the one-token path's sums of x over each group */
    for (int g = 0; one && has_min && g < groups; g++) {
        xg[g] = 0.f;
        for (int k = g * group; k < (g + 1) * group; k++) xg[g] += x[k];
    }
    int tasks = (nrows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tasks; t++) {
        int n = t * ROWS_PER_TASK, end = n + ROWS_PER_TASK < nrows ? n + ROWS_PER_TASK : nrows;
        if (one) task_one(x, xg, cols, q, bits, scales, mins, half, has_min, group, out, n, end);
        else if (bits == BITS_FP4) task_fp4(x, tokens, cols, q, scales, out, nrows, n, end);
        else task(x, tokens, cols, q, bits, scales, mins, half, has_min, group, out, nrows, n, end);
    }
    return 0;
}
