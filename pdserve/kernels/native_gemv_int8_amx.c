/* int8 products on AMX's int8 tiles (Sapphire Rapids and later): native_gemv_int8.c's products,
 * from the same pack and x's same codes, with each block's integer dot products moved from
 * vpdpbusd to one TDPBSUD.
 *
 * Why: vpdpbusd multiplies 64 byte pairs an instruction, so a 16-row task cost each token 8 of
 * them a block; one TDPBSUD multiplies 16 tokens' 32 codes by the task's 16 rows' 32 codes. The
 * pack's code vectors already are the B tile's rows (vector k: columns 4k .. 4k + 3 of each row,
 * four bytes a lane, rows in lane order), a 4-bit block's once its nibbles are split; x's codes
 * ([tokens][cols]) load as A tiles by their stride. The scales differ a block, so each block's
 * C tile (16 tokens x 16 rows of int32) goes back to registers and adds
 *     d * dx * sum(q * c) + min * dx * sum(c)
 * to each token's float32 sums with the instructions task_tokens uses, in its order: the integer
 * sums are exact, so both kernels give the same bits (tests/test_native_int8.py). */
#include "native_simd.h"
#include <stdint.h>

#include "native_amx.h"
#include "native_int8.h"

/* From here a pack's products take AMX's int8 tiles (two threads, SmolLM2's four layer matrices:
 * 0.27 against VNNI's 0.31 ms at 16 tokens, 0.42 against 0.52 at 32; VNNI faster at 8; a Xeon with
 * AMX, 2026-12-05; benchmarks/kernels/bench_int8_gemm.py); native_gemv.set_int8_amx_min_tokens */
int pd_int8_amx_min_tokens = 16;
long pd_int8_amx_calls = 0; /* threads' calls that took the tiles (the tests see them run) */

#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#define AMX_I8_TOKENS 16 /* an A tile's rows */

int pd_int8_amx_takes(int tokens) { return tokens >= pd_int8_amx_min_tokens && pd_amx_granted(); }

/* palette 1; tiles 0-1: A (16 tokens x 32 codes), 2-3: B (8 rows: 16 lanes x 4 codes), 4-7: C
 * (16 x 16 int32): four blocks in flight, so the tile unit works while earlier sums go out */
void pd_int8_amx_configure(void) {
    __atomic_fetch_add(&pd_int8_amx_calls, 1, __ATOMIC_RELAXED);
    tile_config config = tile_config_palette1();
    for (int i = 0; i < 2; i++) config.rows[i] = 16, config.colsb[i] = 32, config.rows[2 + i] = 8, config.colsb[2 + i] = 64;
    for (int i = 4; i < 8; i++) config.rows[i] = 16, config.colsb[i] = 64;
    load_tile_config(&config);
}

void pd_int8_amx_release(void) { _tile_release(); }

/* a 4-bit task's codes with the nibbles split, as B tiles: block blk's row k (columns 4k .. 4k + 3)
 * at staging + 512 blk + 64 k; byte j of a block holds column j low, j + 16 high */
static void split_nibbles(const uint8_t *task, int blocks, uint8_t *staging) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int blk = 0; blk < blocks; blk++)
        for (int k = 0; k < 4; k++) {
            __m512i v = _mm512_load_si512(task + (long)blk * 256 + 64 * k);
            _mm512_store_si512(staging + (long)blk * 512 + 64 * k, _mm512_and_si512(v, low));
            _mm512_store_si512(staging + (long)blk * 512 + 64 * (k + 4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
}

/* block blk's sums of 16 tokens from t0 (c: its C tile) into acc (task_tokens' arithmetic) */
static inline void block_into(const int8_pack *p, const uint8_t *task, const x_side *xq, int eight, int t0, int blk,
                              const int32_t (*c)[16], __m512 *acc) {
    __m512 dv = pack_scales16(p, task, 0, blk), mv = p->has_min ? pack_scales16(p, task, 1, blk) : _mm512_setzero_ps();
#pragma GCC unroll 16 /* the sums stay in registers */
    for (int t = 0; t < AMX_I8_TOKENS; t++) {
        long at = (long)(t0 + t) * xq->blocks + blk;
        __m512i ai = _mm512_load_si512(c[t]);
        if (eight) ai = _mm512_add_epi32(_mm512_set1_epi32(xq->xc[at]), ai);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai), _mm512_mul_ps(dv, _mm512_set1_ps(xq->dx[at])), acc[t]);
        acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xq->xs[at]), acc[t]);
    }
}

#define BLOCK_PRODUCT(A, B, C, blk)                                               \
    do {                                                                          \
        _tile_zero(C);                                                            \
        _tile_loadd(A, xq->codes + (long)t0 * cols + (blk) * 32, cols);           \
        _tile_loadd(B, codes + (long)(blk) * 512, 64);                            \
        _tile_dpbsud(C, A, B);                                                    \
    } while (0)

/* 16 tokens from t0 times the task's rows, four blocks at a time (C tiles 4-7), into acc */
static inline void tokens16(const int8_pack *p, const uint8_t *task, const uint8_t *codes, const x_side *xq, int cols,
                            int eight, int t0, __m512 *acc) {
    int32_t c[4][AMX_I8_TOKENS][16] __attribute__((aligned(64)));
    int blk = 0;
    for (; blk + 4 <= xq->blocks; blk += 4) {
        BLOCK_PRODUCT(0, 2, 4, blk);
        BLOCK_PRODUCT(1, 3, 5, blk + 1);
        BLOCK_PRODUCT(0, 2, 6, blk + 2);
        BLOCK_PRODUCT(1, 3, 7, blk + 3);
        _tile_stored(4, c[0], 64);
        _tile_stored(5, c[1], 64);
        _tile_stored(6, c[2], 64);
        _tile_stored(7, c[3], 64);
        for (int j = 0; j < 4; j++) block_into(p, task, xq, eight, t0, blk + j, c[j], acc);
    }
    for (; blk < xq->blocks; blk++) {
        BLOCK_PRODUCT(0, 2, 4, blk);
        _tile_stored(4, c[0], 64);
        block_into(p, task, xq, eight, t0, blk, c[0], acc);
    }
}

/* x's codes must hold whole A tiles: rows up to c1 rounded up to 16 (zeros past the tokens) */
void pd_int8_amx_task(const int8_pack *p, const uint8_t *task, const x_side *xq, int cols, int eight, int c0, int c1,
                      float *out, int nrows, int n, uint8_t *staging) {
    const uint8_t *codes = task;
    if (!eight) split_nibbles(task, xq->blocks, staging), codes = staging;
    __mmask16 keep = nrows - n >= 16 ? 0xffff : (__mmask16)((1u << (nrows - n)) - 1);
    for (int t0 = c0; t0 < c1; t0 += AMX_I8_TOKENS) {
        __m512 acc[AMX_I8_TOKENS];
        for (int t = 0; t < AMX_I8_TOKENS; t++) acc[t] = _mm512_setzero_ps();
        tokens16(p, task, codes, xq, cols, eight, t0, acc);
        for (int t = 0; t < AMX_I8_TOKENS && t0 + t < c1; t++)
            _mm512_mask_storeu_ps(out + (long)(t0 + t) * nrows + n, keep, _mm512_permutexvar_ps(lane_rows(), acc[t]));
    }
}
#elif defined(__AVX512VNNI__)
int pd_int8_amx_takes(int tokens) { return 0; } /* no AMX int8 in this build: VNNI */
void pd_int8_amx_configure(void) {}
void pd_int8_amx_release(void) {}
void pd_int8_amx_task(const int8_pack *p, const uint8_t *task, const x_side *xq, int cols, int eight, int c0, int c1,
                      float *out, int nrows, int n, uint8_t *staging) {}
#endif
