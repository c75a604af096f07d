/* Several tokens times a quantized (or float32) matrix on AVX2 without AVX-512, as a GEMM
 * micro-kernel: native_gemv.c's tiles keep 2 rows x 8 tokens of 16-column sums in registers,
 * which AVX-512's 32 registers hold and AVX2's 16 do not (on pairs of 256-bit registers they
 * spilled, and 32 tokens ran at about 40% of the FMA units' rate).
 *
 * Here x is packed transposed once per call, xt[k][t] (tokens padded to a multiple of 8, with
 * zeros), and each panel of PANEL_ROWS rows is dequantized once into a buffer. The kernel then
 * walks the columns k of the panel: it loads 8 or 16 tokens' x[k] as one or two vectors and
 * broadcasts each row's w[k], multiply-adding into R x V sums of 8 tokens (6 rows x 16 tokens, or
 * 12 rows x 8): 12 accumulators, the whole of each sum in one register lane, 12 FMAs for every
 * 8 loads. Each sum runs over k in order, one multiply-add a column: x @ dequantized(w).T up to
 * the order of the sums, as the other kernels give it.
 *
 * With AVX-512 this file compiles to a stub that declines (native_gemv.c's tiles fit there). */
#include "native_simd.h"
#include <stdint.h>
#include <stdlib.h>

#include "native_quant_blocks.h"

int pd_panels_min_tokens = 8; /* from this many tokens (native_gemv.set_panels_min_tokens); below, the tiles */

#if PD_AVX512
const int pd_panels_built = 0;

int pd_gemv_panels(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                   const void *mins, int half, int has_min, int group, float *out, int threads) {
    return 0;
}
#else
const int pd_panels_built = 1; /* native_gemv.max_tokens() reads it */

#undef __m512 /* native_simd.h's pairs: this file writes AVX2 itself */
#undef __m512i

#define PANEL_ROWS 12
#define MAX_PANEL_COLS 8192 /* a panel's buffer, 12 x 8192 floats (384 KiB), is allocated per thread */
#define PANELS_MAX_TOKENS 4096 /* a panel's sums, 12 x 4096 floats, allocated per thread */
#define KC 128              /* columns a pass over the tokens covers (panel) */

/* r[0..7], eight rows of 8 floats, transposed in place */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    __m256 a[8], b[8];
    for (int j = 0; j < 8; j += 2) {
        a[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        a[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
        b[j] = _mm256_shuffle_ps(a[j], a[j + 2], 0x44);
        b[j + 1] = _mm256_shuffle_ps(a[j], a[j + 2], 0xee);
        b[j + 2] = _mm256_shuffle_ps(a[j + 1], a[j + 3], 0x44);
        b[j + 3] = _mm256_shuffle_ps(a[j + 1], a[j + 3], 0xee);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2f128_ps(b[j], b[j + 4], 0x20);
        r[j + 4] = _mm256_permute2f128_ps(b[j], b[j + 4], 0x31);
    }
}

/* xt [cols][tpad] = x [tokens][cols] transposed (cols a multiple of 32); token columns past
 * `tokens` are zeros. Eight tokens at a time by 8 x 8 blocks in registers. */
static void pack_transposed(const float *x, int tokens, int cols, int tpad, float *xt) {
    int t = 0;
    for (; t + 8 <= tokens; t += 8)
        for (long k = 0; k < cols; k += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(x + (long)(t + j) * cols + k);
            transpose8(r);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(xt + (k + j) * tpad + t, r[j]);
        }
    for (long k = 0; k < cols && t < tpad; k++) {
        for (int u = t; u < tokens; u++) xt[k * tpad + u] = x[(long)u * cols + k];
        for (int u = tokens; u < tpad; u++) xt[k * tpad + u] = 0.f;
    }
}

/* Rows [n, n + rows) dequantized into buf [rows][cols] (decode32's values) */
static void dequantize_panel(const uint8_t *q, int bits, const void *sc, const void *mn, int half, int has_min,
                             int group, int cols, int n, int rows, float *buf) {
    long qstride = row_bytes(bits, cols), sstride = cols / group;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols / 32; c++) {
            pd_m512 w0, w1;
            decode32(q + (n + r) * qstride, bits, c, sc, mn, half, has_min, group, (n + r) * sstride, &w0, &w1);
            _pd_storeu_ps(buf + (long)r * cols + c * 32, w0);
            _pd_storeu_ps(buf + (long)r * cols + c * 32 + 16, w1);
        }
}

/* R rows of w (row r at w + r * ld) times V vectors of 8 tokens from t0 of xt, over kn columns,
 * added into the sums c [row][tpad] holds (first: from zero); R, V constants once inlined
 * (R * V <= 12). Each lane's sum runs over the columns in order, chunk after chunk. */
static inline __attribute__((always_inline)) void micro(const float *w, long ld, const float *xt, int tpad, int kn,
                                                        int t0, float *c, int first, const int R, const int V) {
    __m256 acc[12][2];
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int v = 0; v < V; v++)
            acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + (long)r * tpad + t0 + 8 * v);
    const float *xk = xt + t0;
    for (int k = 0; k < kn; k++, xk += tpad) {
        __m256 x0 = _mm256_loadu_ps(xk), x1 = V == 2 ? _mm256_loadu_ps(xk + 8) : x0;
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            __m256 b = _mm256_broadcast_ss(w + r * ld + k);
            acc[r][0] = _mm256_fmadd_ps(b, x0, acc[r][0]);
            if (V == 2) acc[r][1] = _mm256_fmadd_ps(b, x1, acc[r][1]);
        }
    }
    /* Every index a constant: an acc element read at a variable index kept the whole array in
     * memory, and GCC stored every sum back to the stack on each column. */
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) _mm256_storeu_ps(c + (long)r * tpad + t0 + 8 * v, acc[r][v]);
}

/* One chunk of kn columns of a panel's rows times every token, into c [PANEL_ROWS][tpad] */
static void panel_chunk(const float *w, long ld, const float *xt, int tpad, int kn, int rows, float *c, int first) {
    int t = 0;
    for (; t + 16 <= tpad; t += 16) {
        int r = 0;
        for (; r + 6 <= rows; r += 6) micro(w + r * ld, ld, xt, tpad, kn, t, c + (long)r * tpad, first, 6, 2);
        for (; r < rows; r++) micro(w + r * ld, ld, xt, tpad, kn, t, c + (long)r * tpad, first, 1, 2);
    }
    if (t < tpad) { /* a last 8 tokens */
        if (rows == PANEL_ROWS) {
            micro(w, ld, xt, tpad, kn, t, c, first, 12, 1);
        } else {
            for (int r = 0; r < rows; r++) micro(w + r * ld, ld, xt, tpad, kn, t, c + (long)r * tpad, first, 1, 1);
        }
    }
}

/* A panel's rows [n, n + rows) times every token, KC columns at a time: that chunk of x (8 KiB
 * for 16 tokens) and of the rows (6 KiB) stay in L1 while every token block passes over them.
 * Whole rows at once read x from L2 for each pass, and 128 tokens ran 20% slower a product than
 * 32. c holds the sums between chunks. */
static void panel(const float *w, long ld, const float *xt, int tpad, int cols, int tokens, float *out, int nrows,
                  int n, int rows, float *c) {
    for (int k0 = 0; k0 < cols; k0 += KC)
        panel_chunk(w + k0, ld, xt + (long)k0 * tpad, tpad, cols - k0 < KC ? cols - k0 : KC, rows, c, k0 == 0);
    for (int t = 0; t < tokens; t++)
        for (int r = 0; r < rows; r++) out[(long)t * nrows + n + r] = c[(long)r * tpad + t];
}

int pd_gemv_panels(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
                   const void *mins, int half, int has_min, int group, float *out, int threads) {
    if (tokens < pd_panels_min_tokens || (bits != 4 && bits != 8 && bits != 32 && bits != BITS_BF16) || half == 2 || cols > MAX_PANEL_COLS ||
        tokens > PANELS_MAX_TOKENS)
        return 0;
    int tpad = (tokens + 7) / 8 * 8, panels = (nrows + PANEL_ROWS - 1) / PANEL_ROWS;
    float *xt = malloc(sizeof(float) * (long)cols * tpad);
    if (!xt) return 0;
    pack_transposed(x, tokens, cols, tpad, xt);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *buf = bits == 32 ? NULL : malloc(sizeof(float) * PANEL_ROWS * (long)cols);
        float *c = malloc(sizeof(float) * PANEL_ROWS * (long)tpad);
        failed = (bits != 32 && !buf) || !c;
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            int n = p * PANEL_ROWS, rows = nrows - n < PANEL_ROWS ? nrows - n : PANEL_ROWS;
            if (failed) continue;
            if (bits == 32) {
                panel((const float *)q + (long)n * cols, cols, xt, tpad, cols, tokens, out, nrows, n, rows, c);
            } else {
                dequantize_panel(q, bits, scales, mins, half, has_min, group, cols, n, rows, buf);
                panel(buf, cols, xt, tpad, cols, tokens, out, nrows, n, rows, c);
            }
        }
        free(buf);
        free(c);
    }
    free(xt);
    return !failed;
}
#endif
