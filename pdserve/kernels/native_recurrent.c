/* The recurrent layers' decode steps (kernels/recurrent_cpu.py's numba kernels, the same
 * arithmetic): the gated delta rule, the Mamba2 state update and the short causal convolution,
 * each request's state updated in place in the pool's arena. Built into the same library as
 * native_gemv.c, so they run on torch's OpenMP pool (numba's runs on a second libgomp), and with
 * denormals flushed: on strongly decaying heads e^g and the decayed states fall below float32's
 * normal range, and each such value cost a microcode assist (the delta rule's step of a
 * Qwen3.5-shaped model took 0.58 ms inside the engine against 0.15 on tame values).
 *
 * The arena is the pool view's whole storage as float32: a request's state is at
 * offset + slot * stride. Rows of x and the outputs are contiguous float32. */
#include "native_exp.h"
#include "native_simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* one (request, value head): q and k normalised (eps 1e-6 inside the root), q scaled; the state
 * decayed, read along k; corrected along k by (v - read) * beta; read along q */
static void delta_item(const float *q, const float *k, const float *v, float g, float beta, int k_dim, int v_dim,
                       float *S, float *out) {
    float qq = 0.f, kk = 0.f, qn[k_dim], kn[k_dim], read[v_dim];
    for (int i = 0; i < k_dim; i++) qq += q[i] * q[i], kk += k[i] * k[i];
    float q_inv = 1.f / sqrtf(qq + 1e-6f), k_inv = 1.f / sqrtf(kk + 1e-6f), scale = 1.f / sqrtf((float)k_dim);
    for (int i = 0; i < k_dim; i++) qn[i] = q[i] * q_inv * scale, kn[i] = k[i] * k_inv;
    float decay = expf(g);
    for (int j = 0; j < v_dim; j++) read[j] = 0.f, out[j] = 0.f;
    for (int i = 0; i < k_dim; i++)
        for (int j = 0; j < v_dim; j++) {
            S[i * v_dim + j] *= decay;
            read[j] += S[i * v_dim + j] * kn[i];
        }
    for (int j = 0; j < v_dim; j++) read[j] = (v[j] - read[j]) * beta;
    for (int i = 0; i < k_dim; i++)
        for (int j = 0; j < v_dim; j++) {
            S[i * v_dim + j] += kn[i] * read[j];
            out[j] += S[i * v_dim + j] * qn[i];
        }
}

/* q, k [rows][k_heads][k_dim], v [rows][v_heads][v_dim], g, beta [rows][v_heads]; out as v */
void pd_gated_delta_step(const float *q, const float *k, const float *v, const float *g, const float *beta, int rows,
                         int k_heads, int v_heads, int k_dim, int v_dim, float *arena, long offset, long stride,
                         const int64_t *slots, float *out, int threads) {
    int per_key_head = v_heads / k_heads;
#pragma omp parallel num_threads(threads)
    {
        unsigned int csr = pd_denormals_flush();
#pragma omp for schedule(static)
        for (int item = 0; item < rows * v_heads; item++) {
            int b = item / v_heads, h = item % v_heads, kh = h / per_key_head;
            long qk = ((long)b * k_heads + kh) * k_dim;
            delta_item(q + qk, k + qk, v + (long)item * v_dim, g[item], beta[item], k_dim, v_dim,
                       arena + offset + slots[b] * stride + (long)h * k_dim * v_dim, out + (long)item * v_dim);
        }
        pd_denormals_restore(csr);
    }
}

/* one (request, head): state [head_dim][size] <- state * e^(dt A) + dt B x; y = state C + x D */
static void mamba2_item(const float *x, float step, float A, float D, const float *b, const float *c, int head_dim,
                        int size, float *S, float *y) {
    float decay = expf(step * A), dt_b[size];
    for (int n = 0; n < size; n++) dt_b[n] = step * b[n];
    for (int p = 0; p < head_dim; p++) {
        float acc = 0.f;
        for (int n = 0; n < size; n++) {
            float s = S[p * size + n] * decay + dt_b[n] * x[p];
            S[p * size + n] = s;
            acc += s * c[n];
        }
        y[p] = acc + x[p] * D;
    }
}

/* x [rows][heads][head_dim], dt [rows][heads] (discretised), A, D [heads], B, C [rows][groups][size] */
void pd_mamba2_step(const float *x, const float *dt, const float *A, const float *B, const float *C, const float *D,
                    int rows, int heads, int head_dim, int groups, int size, float *arena, long offset, long stride,
                    const int64_t *slots, float *out, int threads) {
    int per_group = heads / groups;
#pragma omp parallel num_threads(threads)
    {
        unsigned int csr = pd_denormals_flush();
#pragma omp for schedule(static)
        for (int item = 0; item < rows * heads; item++) {
            int r = item / heads, h = item % heads;
            long bc = ((long)r * groups + h / per_group) * size;
            mamba2_item(x + (long)item * head_dim, dt[item], A[h], D[h], B + bc, C + bc, head_dim, size,
                        arena + offset + slots[r] * stride + (long)h * head_dim * size, out + (long)item * head_dim);
        }
        pd_denormals_restore(csr);
    }
}

/* x [rows][channels]; each window [channels][width] (the last width inputs), weight [channels][width + 1]:
 * out = window . weight[:width] + x weight[width] (+ bias), then the window shifts x in */
void pd_conv_step(const float *x, int rows, int channels, int width, float *arena, long offset, long stride,
                  const int64_t *slots, const float *weight, const float *bias, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < rows; b++) {
        float *windows = arena + offset + slots[b] * stride;
        for (int c = 0; c < channels; c++) {
            float *w = windows + (long)c * width, xc = x[(long)b * channels + c], acc = 0.f;
            const float *wt = weight + (long)c * (width + 1);
            for (int t = 0; t < width; t++) acc += w[t] * wt[t];
            acc += xc * wt[width];
            for (int t = 0; t + 1 < width; t++) w[t] = w[t + 1];
            if (width > 0) w[width - 1] = xc;
            out[(long)b * channels + c] = bias ? acc + bias[c] : acc;
        }
    }
}

/* One Mamba2 span's chunked scan (kernels/mamba2.py's chunked, its arithmetic per chunk of L
 * tokens, the last one short): per group and chunk CB[i][j] = C_i . B_j; per head, with
 * seg(i, j) = dtA_{j+1} + ... + dtA_i (summed along, as the reference's segment sums) and cum the
 * running sum of dtA from the chunk's start:
 *   y_i = sum_{j<=i} CB[i][j] e^seg(i,j) xdt_j + e^cum_i (S C_i) + D x_i
 *   S <- S e^cum_last + sum_j e^(cum_last - cum_j) xdt_j B_j^T
 * x [T][H][P], dt [T][H], A, D [H], B, C [T][G][N], state [H][P][N] (updated), y [T][H][P];
 * P and N multiples of 16 (else -1: torch's form runs). */
/* a . b and y += a x over n floats, n a multiple of 16 */
static inline float dot16(const float *a, const float *b, int n) {
    __m512 acc = _mm512_setzero_ps();
    for (int k = 0; k < n; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc);
    return _mm512_reduce_add_ps(acc);
}

static inline void axpy16(float *y, float a, const float *x, int n) {
    __m512 av = _mm512_set1_ps(a);
    for (int k = 0; k < n; k += 16) _mm512_storeu_ps(y + k, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + k), _mm512_loadu_ps(y + k)));
}

/* CB of one group's chunk [L][L] (lower triangle) */
static void chunk_cb(const float *B, const float *C, int groups, int size, int L, float *cb) {
    long row = (long)groups * size;
    for (int i = 0; i < L; i++)
        for (int j = 0; j <= i; j++) cb[i * L + j] = dot16(C + i * row, B + j * row, size);
}

/* one head's chunk: y [L][P] from S (chunk start) and CB, then S carried past the chunk */
static void mamba2_chunk(const float *x, const float *dt, float A, float D, const float *B, const float *C,
                         const float *cb, int heads, int P, int groups, int N, int L, float *S, float *y,
                         float *buf) {
    float *dta = buf, *cum = buf + L, *seg = buf + 2 * L, *xdt = buf + 3 * L + 16; /* seg [L + 16], xdt [L][P] */
    long xrow = (long)heads * P, brow = (long)groups * N;
    float run = 0.f;
    for (int t = 0; t < L; t++) {
        dta[t] = A * dt[(long)t * heads];
        cum[t] = run += dta[t];
        for (int p = 0; p < P; p++) xdt[t * P + p] = x[t * xrow + p] * dt[(long)t * heads];
    }
    for (int i = 0; i < L; i++) {
        float *yi = y + i * xrow, acc = 0.f, e = expf(cum[i]);
        seg[i] = 0.f;
        for (int j = i - 1; j >= 0; j--) seg[j] = acc += dta[j + 1];
        for (int j = 0; j <= i; j += 16) /* (lanes past i: unused; seg and cb are padded by 16) */
            _mm512_storeu_ps(seg + j, _mm512_mul_ps(exp16(_mm512_loadu_ps(seg + j)), _mm512_loadu_ps(cb + i * L + j)));
        for (int p = 0; p < P; p++) yi[p] = e * dot16(C + i * brow, S + p * N, N) + D * x[i * xrow + p];
        for (int j = 0; j <= i; j++) axpy16(yi, seg[j], xdt + j * P, P);
    }
    float last = cum[L - 1], carry = expf(last);
    for (long k = 0; k < (long)P * N; k++) S[k] *= carry;
    for (int j = 0; j < L; j++) {
        float w = expf(last - cum[j]);
        for (int p = 0; p < P; p++) axpy16(S + p * N, xdt[j * P + p] * w, B + j * brow, N);
    }
}

int pd_mamba2_chunked(const float *x, const float *dt, const float *A, const float *B, const float *C, const float *D,
                      int T, int heads, int P, int groups, int N, int L, float *state, float *y, int threads) {
    if (P % 16 || N % 16) return -1;
    int chunks = (T + L - 1) / L, per_group = heads / groups, failed = 0;
    float *cbs = calloc((size_t)groups * chunks * L * L + 16, sizeof(float));
    if (!cbs) return -2;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        unsigned int csr = pd_denormals_flush();
        float *buf = calloc((size_t)L * (3 + P) + 16, sizeof(float));
        failed = buf == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < groups * chunks; item++) {
            int g = item / chunks, c0 = item % chunks * L, len = T - c0 < L ? T - c0 : L;
            chunk_cb(B + ((long)c0 * groups + g) * N, C + ((long)c0 * groups + g) * N, groups, N, len,
                     cbs + (long)item * L * L);
        }
#pragma omp for schedule(dynamic, 1)
        for (int h = 0; h < heads; h++) {
            if (failed) continue;
            int g = h / per_group;
            for (int c = 0; c < chunks; c++) {
                int c0 = c * L, len = T - c0 < L ? T - c0 : L;
                long bc = ((long)c0 * groups + g) * N;
                mamba2_chunk(x + ((long)c0 * heads + h) * P, dt + (long)c0 * heads + h, A[h], D[h], B + bc, C + bc,
                             cbs + ((long)g * chunks + c) * L * L, heads, P, groups, N, len,
                             state + (long)h * P * N, y + ((long)c0 * heads + h) * P, buf);
            }
        }
        free(buf);
        pd_denormals_restore(csr);
    }
    free(cbs);
    return failed ? -2 : 0;
}

/* Every prefill span of a step through the causal convolution (causal_conv.causal_conv's values):
 * x [rows][channels] (row stride x_row), each span's window [channels][width] at arena + offset +
 * slot * stride (the span's first inputs continue it; updated to its last width inputs), the
 * weight transposed, taps [width + 1][channels], bias or NULL; out [rows][channels], the spans'
 * rows written. Items are (span, block of 64 channels); each output row's channels in vectors. */
#define CONV_BLOCK 64
void pd_conv_spans(const float *x, long x_row, int channels, int width, float *arena, long offset, long stride,
                   const int64_t *spans, int n, const float *taps, const float *bias, float *out, int threads) {
    int blocks = (channels + CONV_BLOCK - 1) / CONV_BLOCK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int item = 0; item < n * blocks; item++) {
        const int64_t *span = spans + 3L * (item / blocks);
        int c0 = item % blocks * CONV_BLOCK, cn = channels - c0 < CONV_BLOCK ? channels - c0 : CONV_BLOCK;
        long first = span[1], T = span[2] - span[1];
        float *win = arena + offset + span[0] * stride, before[(width > 0 ? width : 1) * CONV_BLOCK];
        for (int j = 0; j < width; j++) /* the window as rows: input j - width of the span */
            for (int c = 0; c < cn; c++) before[j * CONV_BLOCK + c] = win[(long)(c0 + c) * width + j];
        for (long t = 0; t < T; t++) {
            float acc[CONV_BLOCK];
            for (int c = 0; c < cn; c++) acc[c] = 0.f;
            for (int i = 0; i <= width; i++) {
                long s = t - width + i;
                const float *in = s < 0 ? before + (width + s) * CONV_BLOCK : x + (first + s) * x_row + c0;
                const float *w = taps + (long)i * channels + c0;
                for (int c = 0; c < cn; c++) acc[c] += in[c] * w[c];
            }
            float *o = out + (first + t) * (long)channels + c0;
            for (int c = 0; c < cn; c++) o[c] = bias ? acc[c] + bias[c0 + c] : acc[c];
        }
        for (int j = 0; j < width; j++) { /* the last width inputs (from `before` where the span is shorter) */
            long s = T - width + j;
            for (int c = 0; c < cn; c++)
                win[(long)(c0 + c) * width + j] = s < 0 ? before[(width + s) * CONV_BLOCK + c] : x[(first + s) * x_row + c0 + c];
        }
    }
}
