/* bf16 products on AMX tiles (Sapphire Rapids and later) for the decode steps of 9 to 256
 * requests under cpu_gemm_dtype bfloat16: native_gemv_bf16.c's work, with its dot products moved
 * from vdpbf16ps to the tile unit.
 *
 * Why: on a Xeon with AMX, vdpbf16ps issues on one port (16 bf16 pairs a cycle, what two float32
 * FMAs give), so the AVX-512 BF16 kernel ran a 32-request SmolLM2 step no faster than float32
 * (75 against 73 ms). One TDPBF16PS multiplies 16 x 32 by 32 x 16 in about 16 cycles: 32 times
 * the pairs of a vdpbf16ps.
 *
 * Each task dequantizes 32 weight rows to bf16 (pd_dequant_bf16, the same values as the AVX-512
 * kernel), row-major, and they load straight as two A tiles per 32 columns (16 rows x 32 columns);
 * x goes once a call into pairs (pd_x_pairs: word [p][t] holds columns 2p and 2p + 1 of token t),
 * whose rows load as B tiles. Four C tiles hold 32 rows x 32 tokens of float32 sums over all
 * columns, then go to out turned (rows_into_out): each tile loaded serves two products.
 *
 * Unquantized rows need no dequantization: pd_bf16_tiles_pack lays their bf16 values out once as B
 * tiles (16 rows of 16 words, word [p][n] holding columns 2p and 2p + 1 of weight row n), x then
 * rounded row-major as A tiles (tiles_into_out); the pack has as many bytes as the bf16 rows. The
 * per-call copy and transpose had been 31% of a 32-request step of the bf16 SmolLM2.
 */
#include "native_simd.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_amx.h"
#include "native_bf16.h"
#include "native_quant_blocks.h"

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_ROWS 32    /* weight rows a task: two B tiles' columns */
#define AMX_TOKENS 32  /* tokens a pass: two A tiles' rows */

static int amx_granted = 0;

void pd_amx_request(void) {
    if (!amx_granted) amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int pd_amx_granted(void) { return amx_granted; }

/* buffer [32][cols] bf16 (row-major) -> b [cols / 32][2 tiles][16 pairs][16 rows] words: tile j
 * holds rows 16j .. 16j + 15 */
static void to_b_tiles(const uint16_t *buffer, int cols, uint32_t *b) {
    for (int c = 0; c < cols / 32; c++)
        for (int j = 0; j < 2; j++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(buffer + (long)(16 * j + i) * cols + 32 * c);
            transpose16(r);
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(b + (long)c * 512 + 256 * j + 16 * p, r[p]);
        }
}

/* A pass's four C tiles (AMX_TOKENS = AMX_ROWS = 32: 32 x 32 sums) into sums [32][32], C tile
 * 2i + j = A tile i by B tile j over every column, then stored at sums[16i][16j]: the A tiles from
 * a (the second a_half bytes on, where A1), the B tiles from b (the second b_half on, where B1), each
 * moving a_step / b_step bytes a 32-column step, their rows a_stride / b_stride bytes apart. A
 * tile 1 or B tile 1 is left out where the pass has only 16 tokens (A1, B1 0). */
static inline __attribute__((always_inline)) void pass_sums(const char *a, long a_half, long a_step, long a_stride,
                                                            int A1, const char *b, long b_half, long b_step,
                                                            long b_stride, int B1, int steps,
                                                            float (*sums)[32]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < steps; c++) {
        _tile_loadd(4, a + c * a_step, a_stride);
        _tile_loadd(6, b + c * b_step, b_stride);
        _tile_dpbf16ps(0, 4, 6);
        if (A1) {
            _tile_loadd(5, a + c * a_step + a_half, a_stride);
            _tile_dpbf16ps(2, 5, 6);
        }
        if (B1) {
            _tile_loadd(7, b + c * b_step + b_half, b_stride);
            _tile_dpbf16ps(1, 4, 7);
            if (A1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, &sums[0][0], sizeof(float) * 32);
    if (B1) _tile_stored(1, &sums[0][16], sizeof(float) * 32);
    if (A1) _tile_stored(2, &sums[16][0], sizeof(float) * 32);
    if (A1 && B1) _tile_stored(3, &sums[16][16], sizeof(float) * 32);
}

/* out[t][n .. n + rows) for every token, x's rows (xb) as A tiles and the pack's B tiles b: a
 * pass's sums [tokens][rows] */
static void tiles_into_out(const uint16_t *xb, int cols, const uint32_t *b, int tokens, int padded, float *out,
                           int nrows, int n, int rows) {
    float sums[AMX_TOKENS][AMX_ROWS] __attribute__((aligned(64)));
    __mmask16 low = (__mmask16)((1u << (rows < 16 ? rows : 16)) - 1);
    __mmask16 high = (__mmask16)(rows > 16 ? (1u << (rows - 16)) - 1 : 0);
    for (int t0 = 0; t0 < padded; t0 += AMX_TOKENS) {
        int two = padded - t0 >= 32;
        pass_sums((const char *)(xb + (long)t0 * cols), (long)16 * cols * 2, 64, (long)cols * 2, two,
                  (const char *)b, 1024, 2048, 64, 1, cols / 32, sums);
        for (int t = t0; t < t0 + (two ? 32 : 16) && t < tokens; t++) {
            _mm512_mask_storeu_ps(out + (long)t * nrows + n, low, _mm512_load_ps(&sums[t - t0][0]));
            if (high) _mm512_mask_storeu_ps(out + (long)t * nrows + n + 16, high, _mm512_load_ps(&sums[t - t0][16]));
        }
    }
}

/* sums [32 rows][32 tokens] of a pass (weight rows by tokens from t0) -> out [token][n + row], each
 * 16 x 16 quarter turned in registers */
static void sums_into_out(float (*sums)[AMX_TOKENS], int t0, int tokens, float *out, int nrows, int n, int rows) {
    for (int i = 0; i < 2 && 16 * i < rows; i++) {
        int left = rows - 16 * i;
        __mmask16 mask = (__mmask16)(left >= 16 ? 0xFFFF : (1u << left) - 1);
        for (int j = 0; j < 2 && t0 + 16 * j < tokens; j++) {
            __m512i r[16];
            for (int k = 0; k < 16; k++) r[k] = _mm512_load_si512(&sums[16 * i + k][16 * j]);
            transpose16(r);
            for (int k = 0; k < 16 && t0 + 16 * j + k < tokens; k++)
                _mm512_mask_storeu_ps(out + (long)(t0 + 16 * j + k) * nrows + n + 16 * i, mask, (__m512)r[k]);
        }
    }
}

/* out[t][n .. n + rows) for every token, the weight rows as A tiles straight from buffer [32][cols]
 * (bf16, row-major: an A tile's row is 32 columns of a weight row) and x's pairs xp as B tiles
 * ([cols / 2][padded]: a B tile's row is one column pair of 16 tokens). The same products in the
 * same order as tiles_into_out with the operands' roles swapped, so the same sums, bit for bit,
 * with no transpose of the weights: to_b_tiles was 5% of a 128-request step of the default GGUF,
 * the sums' turn costs a sixteenth of it. A pass's sums: [rows][tokens]. */
static void rows_into_out(const uint16_t *buffer, int cols, const uint32_t *xp, int tokens, int padded, float *out,
                          int nrows, int n, int rows) {
    float sums[AMX_ROWS][AMX_TOKENS] __attribute__((aligned(64)));
    for (int t0 = 0; t0 < padded; t0 += AMX_TOKENS) {
        pass_sums((const char *)buffer, (long)16 * cols * 2, 64, (long)cols * 2, 1,
                  (const char *)(xp + t0), 64, (long)16 * padded * 4, (long)padded * 4, padded - t0 >= 32,
                  cols / 32, sums);
        sums_into_out(sums, t0, tokens, out, nrows, n, rows);
    }
}

/* x [tokens, cols] float32 -> xb [padded][cols] bf16 (nearest even; rows past tokens zero) */
static void x_bf16(const float *x, int tokens, int cols, int padded, uint16_t *xb) {
#pragma omp for schedule(static)
    for (int t = 0; t < padded; t++) {
        for (int c = 0; c < cols; c += 32) {
            __m512i v = t < tokens ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + (long)t * cols + c + 16),
                                                                   _mm512_loadu_ps(x + (long)t * cols + c))
                                   : _mm512_setzero_si512();
            _mm512_storeu_si512(xb + (long)t * cols + c, v);
        }
    }
}

long pd_bf16_tiles_bytes(int nrows, int cols) {
    return cols % 32 ? -1 : (long)(nrows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS * cols * 2;
}

/* bf16 rows [nrows][cols] -> pack: per task of 32 rows (the last zero-padded), to_b_tiles' layout */
int pd_bf16_tiles_pack(const uint16_t *rows, int nrows, int cols, uint8_t *pack, int threads) {
    if (cols % 32) return -1;
    int tasks = (nrows + AMX_ROWS - 1) / AMX_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tasks; t++) {
        uint16_t buffer[AMX_ROWS * cols];
        int n = t * AMX_ROWS, count = n + AMX_ROWS < nrows ? AMX_ROWS : nrows - n;
        memset(buffer, 0, sizeof(buffer));
        memcpy(buffer, rows + (long)n * cols, sizeof(uint16_t) * (size_t)count * cols);
        to_b_tiles(buffer, cols, (uint32_t *)(pack + (long)t * AMX_ROWS * cols * 2));
    }
    return 0;
}

int pd_gemv_amx(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out, int threads) {
    if (!amx_granted || cols % 32) return 0;
    if (bits != BITS_BF16 && bits != 32) pack = NULL; /* (an int8 pack is the int8 products'; float32 rows'
                                                         pack holds them rounded, as pd_dequant_bf16 does) */
    int padded = (tokens + 15) / 16 * 16, tasks = (nrows + AMX_ROWS - 1) / AMX_ROWS;
    /* x as A tiles (xb: rows of bf16) beside a pack's B tiles, as B tiles (pairs) beside dequantized rows */
    void *xs = malloc(sizeof(uint16_t) * (size_t)cols * padded);
    if (!xs) return 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t buffer[AMX_ROWS * cols];
        load_full_tiles(); /* tiles 0-3: C, 4-5: A, 6-7: B */
        /* the x loop's end is the barrier before the products */
        pack ? x_bf16(x, tokens, cols, padded, xs) : pd_x_pairs(x, tokens, cols, padded, xs);
#pragma omp for schedule(static)
        for (int t = 0; t < tasks; t++) {
            int n = t * AMX_ROWS, rows = n + AMX_ROWS < nrows ? AMX_ROWS : nrows - n;
            if (pack) {
                tiles_into_out(xs, cols, (const uint32_t *)(pack + (long)t * AMX_ROWS * cols * 2), tokens, padded, out,
                               nrows, n, rows);
                continue;
            }
            if (rows < AMX_ROWS) memset(buffer, 0, sizeof(uint16_t) * AMX_ROWS * cols); /* the last rows' sums: 0 */
            pd_dequant_bf16(cols, q, bits, scales, mins, half, has_min, group, n, n + rows, buffer);
            rows_into_out(buffer, cols, xs, tokens, padded, out, nrows, n, rows);
        }
        _tile_release();
    }
    free(xs);
    return 1;
}
#else
void pd_amx_request(void) {}

int pd_amx_granted(void) { return 0; }

long pd_bf16_tiles_bytes(int nrows, int cols) { return -1; } /* no AMX in this build: no pack */

int pd_bf16_tiles_pack(const uint16_t *rows, int nrows, int cols, uint8_t *pack, int threads) { return -1; }

int pd_gemv_amx(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out, int threads) {
    return 0; /* no AMX in this build: the caller's AVX-512 products */
}
#endif
