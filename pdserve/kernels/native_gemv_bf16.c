/* bf16 products for more than 8 tokens (pd_set_bf16: the engine's cpu_gemm_dtype bfloat16), for
 * the integer layouts and float32 rows of native_gemv.c: the decode steps of 9 to 256 requests.
 *
 * Each task's 16 weight rows are dequantized (or read) once, rounded to bf16 (nearest even) into a
 * row-major buffer. x is laid out once per call as bf16 pairs by token: word [p][t] holds x[t][2p]
 * and x[t][2p + 1], so one vector holds a column pair of 16 tokens. vdpbf16ps then multiplies a
 * weight row's pair, broadcast, into 16 tokens' float32 sums at once: 8 rows x up to 3 vectors of
 * tokens stay in registers, each x vector loaded once for 8 rows and each weight pair for 48
 * tokens, with no horizontal sums.
 * The values multiplied are those of torch's bf16 matmul over the same operands; the float32 sums
 * run over the columns in order, pair by pair.
 */
#include "native_simd.h"
#include <stdint.h>
#include <stdlib.h>

#include "native_bf16.h"
#include "native_quant_blocks.h"

#define BF16_ROWS 16     /* rows dequantized a task */
#define BF16_PASS_ROWS 8 /* rows a register pass holds */
#define BF16_MAX_BLOCKS 3 /* vectors of 16 tokens a pass holds: 8 x 3 sums, 3 x, 1 broadcast */

static int bf16_many = 0;

void pd_set_bf16(int on) {
    bf16_many = on;
    if (on) pd_amx_request();
}

int pd_bf16_on(void) { return bf16_many; }

#ifdef __AVX512BF16__
/* x [tokens, cols] float32 -> xp [cols / 2][padded] 32-bit words, each a pair of bf16: token t's
 * columns 2p and 2p + 1 (tokens past `tokens` are zero). Item i is 16 tokens by 16 column pairs,
 * rounded as rows and turned into columns in registers (word by word, the stores were a sixth of
 * a 128-request step, on one thread while the other waited). Called inside a parallel region; also
 * native_gemv_amx.c's B tiles of x. */
void pd_x_pairs(const float *x, int tokens, int cols, int padded, uint32_t *xp) {
    int pair_groups = cols / 32, items = padded / 16 * pair_groups;
#pragma omp for schedule(static)
    for (int i = 0; i < items; i++) {
        int t0 = i / pair_groups * 16, c = i % pair_groups * 32;
        __m512i r[16];
        for (int j = 0; j < 16; j++) {
            const float *row = x + (long)(t0 + j) * cols + c;
            r[j] = t0 + j < tokens ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row))
                                   : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_storeu_si512(xp + (long)(c / 2 + j) * padded + t0, r[j]);
    }
}

/* sums of R rows (w's first R) by NB vectors of 16 tokens from t0, into sums[(r0 + r) * padded + t]
 * (R and NB constants once inlined) */
static inline __attribute__((always_inline)) void pass_bf16(const uint32_t *w, const uint32_t *xp, int cols, int padded,
                                                            int t0, float *sums, int r0, const char *ahead,
                                                            const int R, const int NB) {
    __m512 acc[BF16_PASS_ROWS][BF16_MAX_BLOCKS];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();
    long half = cols / 2;
    for (long p = 0; p < half; p++) {
        _mm_prefetch(ahead + 64 * p, _MM_HINT_T0); /* a pass's iterations span the next 16 rows' lines */
        __m512bh xv[BF16_MAX_BLOCKS];
        for (int b = 0; b < NB; b++) xv[b] = (__m512bh)_mm512_loadu_si512(xp + p * padded + t0 + 16 * b);
        for (int r = 0; r < R; r++) {
            __m512bh wp = (__m512bh)_mm512_set1_epi32((int)w[r * half + p]);
            for (int b = 0; b < NB; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wp, xv[b]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(sums + (long)(r0 + r) * padded + t0 + 16 * b, acc[r][b]);
}

#define PASS(R, NB) pass_bf16(w, xp, cols, padded, t0, sums, r, ahead, R, NB)
#define BY_BLOCKS(R)                 \
    switch (nb) {                    \
    case 1: PASS(R, 1); break;       \
    case 2: PASS(R, 2); break;       \
    default: PASS(R, 3);             \
    }

/* rows first_row .. first_row + rows - 1 (dequantized in rows_w) into every token. The sums gather
 * in a task-local [16 rows][padded] block, a register's 16 tokens a store, and go out a token's 16
 * columns (one cache line) at a time, 16 tokens turned in registers: stored lane by lane into
 * out's rows, a matrix whose row length is a multiple of 4 KiB (SmolLM2's gate_up and LM head) put
 * every token's line in the same cache set, and the step ran slower; gathered lane by lane into a
 * [tokens][16] block, the scalar stores were a sixth of the products. */
static void rows_bf16(const uint32_t *rows_w, int rows, const uint32_t *xp, int cols, int padded, int tokens,
                      float *out, int nrows, int first_row, const char *ahead) {
    float *sums = __builtin_alloca(sizeof(float) * BF16_ROWS * padded);
    for (int t0 = 0; t0 < tokens; t0 += 16 * BF16_MAX_BLOCKS) {
        int left = (tokens - t0 + 15) / 16, nb = left < BF16_MAX_BLOCKS ? left : BF16_MAX_BLOCKS;
        for (int r = 0; r < rows; r += BF16_PASS_ROWS) {
            const uint32_t *w = rows_w + (long)r * cols / 2;
            switch (rows - r < BF16_PASS_ROWS ? rows - r : BF16_PASS_ROWS) {
            case 1: BY_BLOCKS(1) break;
            case 2: BY_BLOCKS(2) break;
            case 3: BY_BLOCKS(3) break;
            case 4: BY_BLOCKS(4) break;
            case 5: BY_BLOCKS(5) break;
            case 6: BY_BLOCKS(6) break;
            case 7: BY_BLOCKS(7) break;
            default: BY_BLOCKS(8)
            }
        }
    }
    __mmask16 keep = rows >= 16 ? 0xffff : (__mmask16)((1u << rows) - 1);
    for (int t0 = 0; t0 < tokens; t0 += 16) {
        __m512i by_row[16];
        for (int r = 0; r < 16; r++)
            by_row[r] = r < rows ? _mm512_loadu_si512(sums + (long)r * padded + t0) : _mm512_setzero_si512();
        transpose16(by_row); /* by_row[j]: token t0 + j's 16 rows */
        for (int j = 0; j < 16 && t0 + j < tokens; j++)
            _mm512_mask_storeu_ps(out + (long)(t0 + j) * nrows + first_row, keep, (__m512)by_row[j]);
    }
}

/* 32 columns of a 4-bit row whose 32 share one scale (and min): the block's 16 possible values
 * dequantized as decode32 does each column (q * scale [+ min], then rounded to bf16), then each
 * column's nibble picks its value (vpermw). Bit for bit decode32's columns, in about half the
 * instructions: the widening and per-column arithmetic were a third of a 32-request step's
 * products. */
static inline void lut32_bf16(const uint8_t *qrow, int c, const void *sc, const void *mn, int half, int has_min,
                              long g, uint16_t *dst) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 s = _mm512_set1_ps(scale_at(sc, half, g));
    __m512 values = has_min ? _mm512_fmadd_ps(codes, s, _mm512_set1_ps(scale_at(mn, half, g))) : _mm512_mul_ps(codes, s);
    __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));
    __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qrow + c * 16)));
    __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi16(15)), hi = _mm256_srli_epi16(bytes, 4);
    __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(idx, table));
}

/* rows [n, end) of the matrix, dequantized and rounded to bf16, into buffer [end - n][cols] */
void pd_dequant_bf16(int cols, const uint8_t *q, int bits, const void *sc, const void *mn, int half, int has_min,
                         int group, int n, int end, uint16_t *buffer) {
    long qstride = row_bytes(bits, cols), sstride = cols / group;
    int by_table = bits == 4 && group % 32 == 0;
    for (int r = 0; r < end - n; r++) {
        const uint8_t *qrow = q + (n + r) * qstride;
        for (int c = 0; c < cols / 32; c++) {
            if (by_table) {
                lut32_bf16(qrow, c, sc, mn, half, has_min, (n + r) * sstride + group_of(c * 32, group), buffer + (long)r * cols + c * 32);
                continue;
            }
            __m512 w0, w1;
            decode32(qrow, bits, c, sc, mn, half, has_min, group, (n + r) * sstride, &w0, &w1);
            _mm512_storeu_si512(buffer + (long)r * cols + c * 32, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
        }
    }
}

/* rows [n, end) of the matrix, dequantized to bf16 into buffer (row-major), then into every token */
static void task_bf16(const uint32_t *xp, int tokens, int padded, int cols, const uint8_t *q, int bits, const void *sc,
                      const void *mn, int half, int has_min, int group, float *out, int nrows, int n, int end) {
    if (bits == BITS_BF16) { /* bf16 rows are the buffer's layout already: read in place (copying them
                              * through float32 was a fifth of a bf16 checkpoint's 32-request step) */
        /* the matrix's next 16 rows (the thread's next task, under the static schedule) are
         * fetched while these compute: eight rows' streams of broadcast pairs from memory stalled
         * the products */
        const uint8_t *rows = q + (long)n * row_bytes(bits, cols);
        const uint8_t *ahead = end + BF16_ROWS <= nrows ? rows + (long)BF16_ROWS * row_bytes(bits, cols) : rows;
        rows_bf16((const uint32_t *)rows, end - n, xp, cols, padded, tokens, out, nrows, n, (const char *)ahead);
        return;
    }
    uint16_t buffer[BF16_ROWS * cols];
    pd_dequant_bf16(cols, q, bits, sc, mn, half, has_min, group, n, end, buffer);
    rows_bf16((const uint32_t *)buffer, end - n, xp, cols, padded, tokens, out, nrows, n, (const char *)buffer);
}

int pd_gemv_bf16(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                 const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out, int threads) {
    if (!bf16_many || tokens <= 8 || (bits != 4 && bits != 8 && bits != 32 && bits != BITS_BF16) || cols > 8192) return 0;
    if (pd_gemv_amx(x, tokens, cols, q, nrows, bits, scales, mins, half, has_min, group, pack, out, threads)) return 1;
    int padded = (tokens + 15) / 16 * 16;
    uint32_t *xp = malloc(sizeof(uint32_t) * (size_t)(cols / 2) * padded);
    if (!xp) return 0;
    int tasks = (nrows + BF16_ROWS - 1) / BF16_ROWS;
#pragma omp parallel num_threads(threads)
    {
        pd_x_pairs(x, tokens, cols, padded, xp); /* its loop's end is the barrier before the products */
#pragma omp for schedule(static)
        for (int t = 0; t < tasks; t++) {
            int n = t * BF16_ROWS, end = n + BF16_ROWS < nrows ? n + BF16_ROWS : nrows;
            task_bf16(xp, tokens, padded, cols, q, bits, scales, mins, half, has_min, group, out, nrows, n, end);
        }
    }
    free(xp);
    return 1;
}
#else
int pd_gemv_bf16(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                 const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out, int threads) {
    return 0; /* no AVX-512 BF16 in this build: float32 */
}
#endif
