/* int8 products for the integer layouts (pd_set_int8: the engine's cpu_gemm_dtype int8), with
 * AVX-512 VNNI: a decode step of several requests, and a prefill's products.
 *
 * bf16's dot product (vdpbf16ps) multiplies 32 pairs an instruction; VNNI's vpdpbusd multiplies
 * 64 bytes, and the 4-bit codes go in as they are instead of dequantized to bf16 first. As
 * llama.cpp multiplies its Q4/Q8 blocks, x is quantized to int8 per token and block of 32 columns
 * (Q8_0's rule: dx = max|x| / 127, codes c = round(x / dx)); each block's integer dot of the weight
 * codes q with c is exact, and the block adds
 *     d * dx * sum(q * c) + min * dx * sum(c)      (w = d * q + min)
 * to the token's float32 sum: the product of the weights with x rounded to 8 bits a block (the
 * error of Q8_1 activations, llama.cpp's for Q4_1). The min's term takes the rounded sum, not x's
 * own: with the exact sum the rounding errors met d * q, which does not center on zero as w
 * does, and a random Q4_1 model's logits erred ten times as far as with Q8_0 weights.
 *
 * vpdpbusd multiplies unsigned bytes by signed ones: the weights go in unsigned (4-bit codes as
 * they are; 8-bit codes + 128, with -128 * sum(c) a token's start to take the offset out), x's
 * codes signed. A task takes 16 weight rows into a vector's lanes: for each block, 8 vectors,
 * vector p holding column quad p of each row (a 4 x 4 transpose of the rows' dwords, four rows at a
 * time), laid out once per matrix (its int8 pack) and read for every token; each token's quad is
 * broadcast from its codes (by token, [tokens][cols]) into vpdpbusd, and 8 tokens' sums of the 16
 * rows stay in registers. So one token costs 8 dot products a block: the int8 product runs from
 * a single token (a token-major layout, 16 tokens to a vector, wasted 15 lanes of 16 there).
 */
#include "native_simd.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_int8.h"
#include "native_quant_blocks.h"

#define I8_TOKENS 8    /* tokens a pass holds: 8 int and 8 float sums of 16 rows */
#define I8_CHUNK 192   /* tokens a sweep over the rows takes: their codes (192 x cols bytes) stay in L2 */

static int int8_many = 0;

void pd_set_int8(int on) {
    int8_many = on;
    if (on) pd_amx_request(); /* AMX's int8 tiles, where the CPU has them */
}

/* From here int8: 4-bit codes from one token (SmolLM2's four layer matrices, one Zen 4 core: 0.28
 * ms against float32's 0.41); 8-bit codes, twice the bytes to transpose, from 8 (its Q8_0 LM head
 * on two threads: 2.40 ms against 1.48 at one token, 2.48 against 2.32 at 4, 3.17 against 4.69 at 8),
 * or from 2 read from its pack (nothing to transpose: 0.81-0.93 against 0.82-1.03 ms at one token,
 * 0.61-1.11 against 1.36-1.78 at 2, 1.26-1.38 against 2.25-2.27 at 4; a Zen 4 VM, 2026-12-04) */
int pd_int8_min_tokens = 1;
/* Up to here int8 (dequant_tiles.set_tile_dtype): on a CPU with AMX, past it bf16 tiles run a
 * matrix faster than vpdpbusd (native_gemv_amx.c; dequant_tiles.INT8_MAX_ROWS_AMX) */
int pd_int8_max_tokens = 1 << 30;
#define I8_MIN_TOKENS_8BIT 8
#define I8_MIN_TOKENS_8BIT_PACKED 2

#ifdef __AVX512VNNI__
/* 4 vectors of 4 rows each (128-bit lane l of a[k]: row 4k + l's 16 bytes) as 4 vectors of dwords:
 * vector p lane i = dword p of row 4 (i % 4) + i / 4 */
static inline void transpose16x4(const __m512i a[4], __m512i v[4]) {
    __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    v[0] = _mm512_unpacklo_epi64(t0, t2), v[1] = _mm512_unpackhi_epi64(t0, t2);
    v[2] = _mm512_unpacklo_epi64(t1, t3), v[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* the 16 rows' bytes gathered four rows to a vector (quads[(blk * halves + h) * 4 + k], rows
 * 4k .. 4k + 3), a quartet at a time: four row pointers live, not sixteen */
static void gather_quartets(const uint8_t *q, long qstride, int bits, int blocks, int n, int nrows, const uint8_t *zeros,
                            __m512i *quads) {
    int halves = bits == 8 ? 2 : 1, bb = bits == 8 ? 32 : 16;
    for (int k = 0; k < 4; k++) {
        const uint8_t *r[4];
        for (int l = 0; l < 4; l++) r[l] = n + 4 * k + l < nrows ? q + (long)(n + 4 * k + l) * qstride : zeros;
        for (int blk = 0; blk < blocks; blk++)
            for (int h = 0; h < halves; h++) {
                long at = (long)blk * bb + 16 * h;
                __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(r[0] + at)));
                z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(r[1] + at)), 1);
                z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(r[2] + at)), 2);
                quads[((long)blk * halves + h) * 4 + k] = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(r[3] + at)), 3);
            }
    }
}

/* r[i] lane j -> r[j] lane i */
static inline void transpose16x16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c)), r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d)), r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88), t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88), t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88), r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88), r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* the blocks' scales (or mins) of the 16 rows in lane order, 16 blocks at a time: each row's 16
 * read as a vector (rows in lane order), then transposed (groups of 32 columns; other groups and
 * rows past nrows one at a time) */
static void lane_scales(const void *s, int half, int group, long sstride, int blocks, int n, int nrows, float *dst) {
    int blk = 0;
    if (group == 32 && n + 16 <= nrows)
        for (; blk < blocks; blk += 16) {
            __mmask16 take = blocks - blk >= 16 ? 0xffff : (__mmask16)((1u << (blocks - blk)) - 1);
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                long at = (long)(n + 4 * (i % 4) + i / 4) * sstride + blk;
                r[i] = half ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(take, (const uint16_t *)s + at))
                            : _mm512_maskz_loadu_ps(take, (const float *)s + at);
            }
            transpose16x16(r);
            for (int j = 0; j < 16 && blk + j < blocks; j++) _mm512_storeu_ps(dst + (blk + j) * 16, r[j]);
        }
    for (; blk < blocks; blk++)
        for (int i = 0; i < 16; i++) {
            int r = 4 * (i % 4) + i / 4;
            dst[blk * 16 + i] = n + r < nrows ? scale_at(s, half, (long)(n + r) * sstride + blk * 32 / group) : 0.f;
        }
}

/* a task's 16 lane-ordered scales (or mins) a block, written in the pack's format */
static void store_scales(const float *d, int blocks, int half, uint8_t *at) {
    for (int blk = 0; blk < blocks; blk++) {
        __m512 v = _mm512_loadu_ps(d + blk * 16);
        if (half) /* values read from float16: back exactly */
            _mm256_store_si256((__m256i *)at + blk, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        else
            _mm512_store_ps((float *)at + 16 * blk, v);
    }
}

/* rows n .. n + 15 of the matrix as one task of pack p at `task` (scratch: quads, 8 vectors a
 * block, and d, 16 floats a block) */
static void pack_task(int cols, const uint8_t *q, int bits, const void *sc, const void *mins, int half, int has_min,
                      int group, int n, int nrows, const uint8_t *zeros, __m512i *quads, float *d,
                      const int8_pack *p, uint8_t *task) {
    int blocks = cols / 32;
    long qstride = row_bytes(bits, cols), sstride = cols / group;
    gather_quartets(q, qstride, bits, blocks, n, nrows, zeros, quads);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i *codes = (__m512i *)task;
    for (int blk = 0; blk < blocks; blk++) {
        if (bits == 4) {
            transpose16x4(quads + (long)blk * 4, codes + (long)blk * 4);
            continue;
        }
        __m512i *w = codes + (long)blk * 8;
        transpose16x4(quads + (long)blk * 8, w);
        transpose16x4(quads + (long)blk * 8 + 4, w + 4);
        for (int k = 0; k < 8; k++) w[k] = _mm512_xor_si512(w[k], flip);
    }
    for (int m = 0; m < (has_min ? 2 : 1); m++) {
        lane_scales(m ? mins : sc, half, group, sstride, blocks, n, nrows, d);
        store_scales(d, blocks, p->half, task + p->code_bytes + (m ? p->scale_bytes : 0));
    }
}

/* NT tokens from t0 times a task's 16 rows (pack p, at `task`), into out[t][n .. n + 15] (NT and
 * EIGHT constants once inlined): a block's 8 codes vectors (a 4-bit block's nibbles split here),
 * each token's quad broadcast into vpdpbusd */
static inline __attribute__((always_inline)) void tokens_int8(const int8_pack *p, const uint8_t *task,
                                                              const x_side *xq, int cols, int t0, float *out, int nrows,
                                                              int n, const char *ahead, const int NT, const int EIGHT) {
    int blocks = xq->blocks, per_block = ahead ? (p->task_bytes / 64 + blocks) / blocks : 0; /* the next task's lines */
    const __m512i *codes = (const __m512i *)task, low = _mm512_set1_epi8(15);
    __m512 acc[I8_TOKENS];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    for (int blk = 0; blk < blocks; blk++) {
        for (int l = 0; l < per_block; l++) _mm_prefetch(ahead + ((long)blk * per_block + l) * 64, _MM_HINT_T0);
        __m512i ai[I8_TOKENS], v[4];
        for (int t = 0; t < NT; t++)
            ai[t] = EIGHT ? _mm512_set1_epi32(xq->xc[(long)(t0 + t) * blocks + blk]) : _mm512_setzero_si512();
        if (!EIGHT)
            for (int k = 0; k < 4; k++) v[k] = _mm512_load_si512(codes + (long)blk * 4 + k);
        for (int k = 0; k < 8; k++) { /* 4-bit byte j: column j in the low nibble, j + 16 in the high one */
            __m512i wv = EIGHT ? _mm512_load_si512(codes + (long)blk * 8 + k)
                               : _mm512_and_si512(k < 4 ? v[k] : _mm512_srli_epi16(v[k - 4], 4), low);
            for (int t = 0; t < NT; t++)
                ai[t] = _mm512_dpbusd_epi32(ai[t], wv, _mm512_set1_epi32(*(const int32_t *)(xq->codes + (long)(t0 + t) * cols + blk * 32 + 4 * k)));
        }
        __m512 dv = pack_scales16(p, task, 0, blk), mv = p->has_min ? pack_scales16(p, task, 1, blk) : _mm512_setzero_ps();
        for (int t = 0; t < NT; t++) {
            long at = (long)(t0 + t) * blocks + blk;
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[t]), _mm512_mul_ps(dv, _mm512_set1_ps(xq->dx[at])), acc[t]);
            acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xq->xs[at]), acc[t]);
        }
    }
    __mmask16 keep = nrows - n >= 16 ? 0xffff : (__mmask16)((1u << (nrows - n)) - 1);
    for (int t = 0; t < NT; t++)
        _mm512_mask_storeu_ps(out + (long)(t0 + t) * nrows + n, keep, _mm512_permutexvar_ps(lane_rows(), acc[t]));
}

#define TOKENS(NT) (eight ? tokens_int8(p, task, xq, cols, t0, out, nrows, n, ahead, NT, 1) \
                        : tokens_int8(p, task, xq, cols, t0, out, nrows, n, ahead, NT, 0))

/* the task's rows times tokens [c0, c1), I8_TOKENS at a time */
static void task_tokens(const int8_pack *p, const uint8_t *task, const x_side *xq, int cols, int eight, int c0, int c1,
                        float *out, int nrows, int n, const char *ahead) {
    for (int t0 = c0; t0 < c1; t0 += I8_TOKENS, ahead = NULL) { /* (the first tokens' pass fetches them) */
        switch (c1 - t0 < I8_TOKENS ? c1 - t0 : I8_TOKENS) {
        case 1: TOKENS(1); break;
        case 2: TOKENS(2); break;
        case 3: TOKENS(3); break;
        case 4: TOKENS(4); break;
        case 5: TOKENS(5); break;
        case 6: TOKENS(6); break;
        case 7: TOKENS(7); break;
        default: TOKENS(8);
        }
    }
}

static int int8_takes(int cols, int bits, int half, int group) {
    return (bits == 4 || bits == 8) && group % 32 == 0 && half <= 1 && cols % 32 == 0 && cols <= 8192;
}

long pd_int8_pack_bytes(int nrows, int cols, int bits, int half, int has_min) {
    return (long)((nrows + 15) / 16) * pack_layout(cols, bits, half, has_min).task_bytes;
}

int pd_int8_pack(const uint8_t *q, int nrows, int cols, int bits, const void *scales, const void *mins, int half,
                 int has_min, int group, uint8_t *pack, int threads) {
    if (!int8_takes(cols, bits, half, group) || ((uintptr_t)pack & 63)) return -1;
    int blocks = cols / 32, tasks = (nrows + 15) / 16, failed = 0;
    int8_pack p = pack_layout(cols, bits, half, has_min);
    uint8_t *zeros = calloc(row_bytes(bits, cols), 1);
#pragma omp parallel num_threads(threads) if (zeros) reduction(| : failed)
    {
        __m512i *quads = zeros ? aligned_alloc(64, sizeof(__m512i) * 8 * blocks) : NULL;
        float *d = malloc(sizeof(float) * 16 * blocks);
        failed |= !quads || !d;
#pragma omp for schedule(static)
        for (int t = 0; t < tasks; t++)
            if (quads && d)
                pack_task(cols, q, bits, scales, mins, half, has_min, group, 16 * t, nrows, zeros, quads, d, &p,
                          pack + (long)t * p.task_bytes);
        free(quads), free(d);
    }
    free(zeros);
    return zeros && !failed ? 0 : -2;
}

/* x's codes (quantize_token) then each task's tokens, I8_CHUNK tokens a sweep over the tasks: from
 * the matrix's pack where the caller has one, else each task packed here first (float32 scales);
 * a pack's tasks on AMX's int8 tiles from pd_int8_amx_min_tokens tokens (the same bits) */
static void products(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                     const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out,
                     const x_side *xq, int *failed) {
    int blocks = cols / 32, tasks = (nrows + 15) / 16;
#pragma omp for schedule(static)
    for (int t = 0; t < tokens; t++) quantize_token(x, cols, t, xq);
    int8_pack p = pack_layout(cols, bits, pack ? half : 0, has_min);
    uint8_t *own = pack ? NULL : aligned_alloc(64, p.task_bytes), *zeros = pack ? NULL : calloc(row_bytes(bits, cols), 1);
    __m512i *quads = pack ? NULL : aligned_alloc(64, sizeof(__m512i) * 8 * blocks);
    float *d = pack ? NULL : malloc(sizeof(float) * 16 * blocks);
    int ready = pack || (own && zeros && quads && d);
    uint8_t *staging = pack && pd_int8_amx_takes(tokens) ? aligned_alloc(64, 512 * (size_t)blocks) : NULL;
    if (!ready) *failed = 1; /* a thread without its buffers still meets every barrier below, doing no task */
    if (staging) pd_int8_amx_configure();
    for (int c0 = 0; c0 < tokens; c0 += I8_CHUNK) {
        int c1 = c0 + I8_CHUNK < tokens ? c0 + I8_CHUNK : tokens;
#pragma omp for schedule(static)
        for (int t = 0; t < tasks; t++) {
            if (!ready) continue;
            const uint8_t *task = pack ? pack + (long)t * p.task_bytes : own;
            if (!pack) pack_task(cols, q, bits, scales, mins, half, has_min, group, 16 * t, nrows, zeros, quads, d, &p, own);
            if (staging) pd_int8_amx_task(&p, task, xq, cols, bits == 8, c0, c1, out, nrows, 16 * t, staging);
            else /* the pack's next task (the thread's next, under the static schedule) fetched while
                  * this one computes: a decode step's products waited on memory (bf16's did too) */
                task_tokens(&p, task, xq, cols, bits == 8, c0, c1, out, nrows, 16 * t,
                            (const char *)(pack && t + 1 < tasks ? task + p.task_bytes : task));
        }
    }
    if (staging) pd_int8_amx_release();
    free(own), free(zeros), free(quads), free(d), free(staging);
}

int pd_gemv_int8(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                 const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out, int threads) {
    int eight_from = pack ? I8_MIN_TOKENS_8BIT_PACKED : I8_MIN_TOKENS_8BIT;
    if (!int8_many || tokens < (bits == 8 ? eight_from : pd_int8_min_tokens) || tokens > pd_int8_max_tokens ||
        !int8_takes(cols, bits, half, group))
        return 0;
    /* rows past the tokens, to a multiple of 16, zero: AMX's A tiles take 16 tokens' codes */
    int padded = (tokens + 15) / 16 * 16;
    long per_block = (long)padded * (cols / 32), past = (long)(padded - tokens) * (cols / 32);
    x_side xq = {malloc((size_t)padded * cols), malloc(sizeof(float) * per_block), malloc(sizeof(float) * per_block),
                 malloc(sizeof(int32_t) * per_block), cols / 32};
    int ok = xq.codes && xq.dx && xq.xs && xq.xc, failed = 0;
    if (ok && past) {
        memset(xq.codes + (long)tokens * cols, 0, (size_t)(padded - tokens) * cols);
        memset(xq.dx + per_block - past, 0, sizeof(float) * past), memset(xq.xs + per_block - past, 0, sizeof(float) * past);
        memset(xq.xc + per_block - past, 0, sizeof(int32_t) * past);
    }
#pragma omp parallel num_threads(threads) if (ok) reduction(| : failed)
    if (ok) products(x, tokens, cols, q, nrows, bits, scales, mins, half, has_min, group, pack, out, &xq, &failed);
    free(xq.codes), free(xq.dx), free(xq.xs), free(xq.xc);
    return ok && !failed;
}
#else
int pd_gemv_int8(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                 const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out, int threads) {
    return 0; /* no AVX-512 VNNI in this build: bf16 or float32 */
}

long pd_int8_pack_bytes(int nrows, int cols, int bits, int half, int has_min) { return -1; }

int pd_int8_pack(const uint8_t *q, int nrows, int cols, int bits, const void *scales, const void *mins, int half,
                 int has_min, int group, uint8_t *pack, int threads) {
    return -1;
}
#endif
