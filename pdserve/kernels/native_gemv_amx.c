/* bf16 products on AMX tiles (Sapphire Rapids and later) for the decode steps of 9 to 256
 * requests under cpu_gemm_dtype bfloat16: native_gemv_bf16.c's work, with its dot products moved
 * from vdpbf16ps to the tile unit.
 *
 * Why: on a Xeon with AMX, vdpbf16ps issues on one port (16 bf16 pairs a cycle, what two float32
 * FMAs give), so the AVX-512 BF16 kernel ran a 32-request SmolLM2 step no faster than float32
 * (75 against 73 ms). One TDPBF16PS multiplies 16 x 32 by 32 x 16 in about 16 cycles: 32 times
 * the pairs of a vdpbf16ps.
 *
 * Each task dequantizes 16 weight rows to bf16 (pd_dequant_bf16, the same values as the AVX-512
 * kernel) and lays them out as B tiles: per 32 columns, 16 rows of 16 words, word [p][n] holding
 * columns 2p and 2p + 1 of weight row n (a 16 x 16 transpose of words). x is rounded to bf16 once
 * a call, row-major, so each A tile (16 tokens x 32 columns) loads straight from it. Four C tiles
 * hold 64 tokens x 16 rows of float32 sums over all columns, then go to out.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_bf16.h"

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_ROWS 16    /* weight rows a task: one B tile's columns */
#define AMX_TOKENS 64  /* tokens a pass: four C tiles */

static int amx_granted = 0;

void pd_amx_request(void) {
    if (!amx_granted) amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* palette 1; tiles 0-3: C (16 x 16 float32), 4: B, 5-7: A (16 rows of 64 bytes each) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) {
        config.rows[i] = 16;
        config.colsb[i] = 64;
    }
    _tile_loadconfig(&config);
}

/* buffer [16][cols] bf16 (row-major) -> b [cols / 32][16 pairs][16 rows] words */
static void to_b_tiles(const uint16_t *buffer, int cols, uint32_t *b) {
    for (int c = 0; c < cols / 32; c++) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(buffer + (long)i * cols + 32 * c);
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_storeu_si512(b + (long)c * 256 + 16 * j, r[j]);
    }
}

#define A_TIMES_B(i, a)                                                                         \
    do {                                                                                        \
        _tile_loadd(a, xb + (long)(t0 + 16 * (i)) * cols + 32 * c, cols * 2);                  \
        _tile_dpbf16ps(i, a, 4);                                                                \
    } while (0)

/* out[t][n .. n + rows) for every token, from the B tiles b (sums staged a pass at a time) */
static void tiles_into_out(const uint16_t *xb, int cols, const uint32_t *b, int tokens, int padded, float *out,
                           int nrows, int n, int rows) {
    float sums[AMX_TOKENS][16] __attribute__((aligned(64)));
    for (int t0 = 0; t0 < padded; t0 += AMX_TOKENS) {
        int nt = (padded - t0) / 16 < 4 ? (padded - t0) / 16 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int c = 0; c < cols / 32; c++) {
            _tile_loadd(4, b + (long)c * 256, 64);
            A_TIMES_B(0, 5);
            if (nt > 1) A_TIMES_B(1, 6);
            if (nt > 2) A_TIMES_B(2, 7);
            if (nt > 3) A_TIMES_B(3, 5);
        }
        _tile_stored(0, sums[0], 64);
        if (nt > 1) _tile_stored(1, sums[16], 64);
        if (nt > 2) _tile_stored(2, sums[32], 64);
        if (nt > 3) _tile_stored(3, sums[48], 64);
        __mmask16 keep = (__mmask16)((1u << rows) - 1);
        for (int t = t0; t < t0 + 16 * nt && t < tokens; t++)
            _mm512_mask_storeu_ps(out + (long)t * nrows + n, keep, _mm512_load_ps(sums[t - t0]));
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

int pd_gemv_amx(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                const void *mins, int half, int has_min, int group, float *out, int threads) {
    if (!amx_granted || cols % 32) return 0;
    int padded = (tokens + 15) / 16 * 16, tasks = (nrows + AMX_ROWS - 1) / AMX_ROWS;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)cols * padded);
    if (!xb) return 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t buffer[AMX_ROWS * cols];
        uint32_t b[AMX_ROWS * cols / 2] __attribute__((aligned(64)));
        configure_tiles();
        x_bf16(x, tokens, cols, padded, xb); /* its loop's end is the barrier before the products */
#pragma omp for schedule(static)
        for (int t = 0; t < tasks; t++) {
            int n = t * AMX_ROWS, rows = n + AMX_ROWS < nrows ? AMX_ROWS : nrows - n;
            if (rows < AMX_ROWS) memset(buffer, 0, sizeof(uint16_t) * AMX_ROWS * cols); /* the last rows' sums: 0 */
            pd_dequant_bf16(cols, q, bits, scales, mins, half, has_min, group, n, n + rows, buffer);
            to_b_tiles(buffer, cols, b);
            tiles_into_out(xb, cols, b, tokens, padded, out, nrows, n, rows);
        }
        _tile_release();
    }
    free(xb);
    return 1;
}
#else
void pd_amx_request(void) {}

int pd_gemv_amx(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                const void *mins, int half, int has_min, int group, float *out, int threads) {
    return 0; /* no AMX in this build: the caller's AVX-512 products */
}
#endif
