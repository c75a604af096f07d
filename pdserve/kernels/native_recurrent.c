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
#include "native_simd.h"
#include <math.h>
#include <stdint.h>

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

/* x [rows][heads][head_dim], dt [rows][heads] (discretised), A, D [heads], B, C [rows][groups][size]:
 * per (request, head) state [head_dim][size] <- state * e^(dt A) + dt B x; y = state C + x D */
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
            const float *b = B + ((long)r * groups + h / per_group) * size, *c = C + ((long)r * groups + h / per_group) * size;
            float step = dt[item], decay = expf(step * A[h]), dt_b[size];
            for (int n = 0; n < size; n++) dt_b[n] = step * b[n];
            float *S = arena + offset + slots[r] * stride + (long)h * head_dim * size;
            for (int p = 0; p < head_dim; p++) {
                float xp = x[(long)item * head_dim + p], acc = 0.f;
                for (int n = 0; n < size; n++) {
                    float s = S[p * size + n] * decay + dt_b[n] * xp;
                    S[p * size + n] = s;
                    acc += s * c[n];
                }
                out[(long)item * head_dim + p] = acc + xp * D[h];
            }
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
