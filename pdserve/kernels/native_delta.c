/* The gated delta rule's chunked form (Gated DeltaNet: Qwen3.5, Qwen3-Next) for one request's
 * span, compiled: pdserve/kernels/gated_delta.py's `chunked` with each (head, chunk) kept in a
 * thread's buffers. Built into the same library as native_gemv.c.
 *
 * Why: torch's form builds [heads, chunks, 64, 64] intermediates and passes over each with one op
 * after another (decays, masks, products, two triangular solves): 41% of a 32-request
 * Qwen3.5-shaped offline run on one thread went there, for about 3% of its arithmetic. Here every
 * 64 x 64 block stays in L1/L2 while it is used.
 *
 * Per head, chunk by chunk (L tokens, the last one short), with d the running sum of g from the
 * chunk's start, kb = k * beta, vb = v * beta:
 *   M = I + strictly-lower(kb_i . k_j * e^(d_i - d_j))        (unit lower-triangular)
 *   U = M^-1 vb,  W = M^-1 (kb * e^d)                          (forward substitution)
 *   corrected = U - W S;  out_i = (q_i e^(d_i)) S + sum_{j<=i} (q_i . k_j) e^(d_i - d_j) corrected_j
 *   S <- S e^(d_last) + sum_j (k_j e^(d_last - d_j))^T corrected_j
 * q and k arrive L2-normalised and q scaled (gated_delta._prepare), all float32, heads-first.
 */
#include "native_exp.h"
#include "native_simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Y [M][N] (row stride ldy) += alpha * A [M][K] (lda) @ B [K][N] (ldb), N a multiple of 16: each
 * row's 64 columns summed in registers over K (one call a product: the per-row vector calls it
 * replaced cost more in setup than in arithmetic at these sizes) */
static void gemm_acc(float *Y, long ldy, const float *A, long lda, const float *B, long ldb, int M, int K, int N,
                     float alpha) {
    for (int i = 0; i < M; i++) {
        float *y = Y + i * ldy;
        const float *a = A + i * lda;
        int n0 = 0;
        for (; n0 + 64 <= N; n0 += 64) {
            __m512 s0 = _mm512_loadu_ps(y + n0), s1 = _mm512_loadu_ps(y + n0 + 16);
            __m512 s2 = _mm512_loadu_ps(y + n0 + 32), s3 = _mm512_loadu_ps(y + n0 + 48);
            for (int k = 0; k < K; k++) {
                __m512 x = _mm512_set1_ps(alpha * a[k]);
                const float *b = B + k * ldb + n0;
                s0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b), s0);
                s1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b + 16), s1);
                s2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b + 32), s2);
                s3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b + 48), s3);
            }
            _mm512_storeu_ps(y + n0, s0), _mm512_storeu_ps(y + n0 + 16, s1);
            _mm512_storeu_ps(y + n0 + 32, s2), _mm512_storeu_ps(y + n0 + 48, s3);
        }
        for (; n0 < N; n0 += 16) {
            __m512 s0 = _mm512_loadu_ps(y + n0);
            for (int k = 0; k < K; k++) s0 = _mm512_fmadd_ps(_mm512_set1_ps(alpha * a[k]), _mm512_loadu_ps(B + k * ldb + n0), s0);
            _mm512_storeu_ps(y + n0, s0);
        }
    }
}

/* out[j] = e^(x[j] + shift) for j < n (out and x hold a multiple of 16 floats) */
static inline void exp_shifted(float *out, const float *x, float shift, int n) {
    for (int j = 0; j < n; j += 16)
        _mm512_storeu_ps(out + j, exp16(_mm512_add_ps(_mm512_loadu_ps(x + j), _mm512_set1_ps(shift))));
}

typedef struct { /* a thread's buffers for one chunk of C tokens (C a multiple of 16) */
    float *decay, *neg, *pair, *kt, *gk, *gq, *u, *w, *qd;
    /* [C] x 3, kt [dk][C], gk and gq [C][C] (then M's and intra's lower triangles), u [C][dv], w and qd [C][dk] */
} chunk_buffers;

/* floats of one thread's chunk_buffers, and the buffers laid out from `all` in the struct's order */
static size_t chunk_floats(int C, int dk, int dv) { return (size_t)C * (3 + 3 * dk + 2 * C + dv); }

static chunk_buffers chunk_buffers_in(float *all, int C, int dk, int dv) {
    chunk_buffers b = {all, all + C, all + 2 * C, all + 3 * C, all + (3L + dk) * C, all + (3L + dk + C) * C,
                       all + (3L + dk + 2 * C) * C, all + (3L + dk + 2 * C + dv) * C,
                       all + (3L + 2 * dk + 2 * C + dv) * C};
    return b;
}

/* rows [0, L) of U = M^-1 vb and W = M^-1 (kb e^d), and intra (in gq, zero above the diagonal) */
static void solve_chunk(const float *q, const float *k, const float *v, const float *beta, int L, int C, int dk,
                        int dv, const chunk_buffers *b) {
    memset(b->kt, 0, sizeof(float) * (size_t)dk * C);
    for (int j = 0; j < L; j++)
        for (int r = 0; r < dk; r++) b->kt[(long)r * C + j] = k[(long)j * dk + r];
    memset(b->gk, 0, sizeof(float) * (size_t)C * C);
    memset(b->gq, 0, sizeof(float) * (size_t)C * C);
    gemm_acc(b->gk, C, k, dk, b->kt, C, L, dk, C, 1.f); /* k_i . k_j */
    gemm_acc(b->gq, C, q, dk, b->kt, C, L, dk, C, 1.f); /* q_i . k_j */
    for (int j = 0; j < C; j++) b->neg[j] = j < L ? -b->decay[j] : 0.f;
    for (int i = 0; i < L; i++) {
        float *u = b->u + (long)i * dv, *w = b->w + (long)i * dk, *m = b->gk + (long)i * C, e = expf(b->decay[i]);
        exp_shifted(b->pair, b->neg, b->decay[i], i + 1); /* e^(d_i - d_j) */
        for (int j = 0; j < C; j++) b->gq[(long)i * C + j] = j <= i ? b->gq[(long)i * C + j] * b->pair[j] : 0.f;
        for (int j = 0; j < i; j++) m[j] *= beta[i] * b->pair[j]; /* M_ij = beta_i (k_i . k_j) e^(d_i - d_j) */
        for (int c = 0; c < dv; c++) u[c] = v[(long)i * dv + c] * beta[i];
        for (int c = 0; c < dk; c++) w[c] = k[(long)i * dk + c] * beta[i] * e;
        gemm_acc(u, dv, m, C, b->u, dv, 1, i, dv, -1.f);
        gemm_acc(w, dk, m, C, b->w, dk, 1, i, dk, -1.f);
    }
}

/* the chunk's outputs out [L][dv] from S [dk][dv], then S carried past the chunk */
static void apply_chunk(const float *q, int L, int C, int dk, int dv, float *S, float *out, const chunk_buffers *b) {
    float last = b->decay[L - 1];
    gemm_acc(b->u, dv, b->w, dk, S, dv, L, dk, dv, -1.f); /* corrected = U - W S, in place of U */
    for (int i = 0; i < L; i++) {
        float e = expf(b->decay[i]);
        for (int r = 0; r < dk; r++) b->qd[(long)i * dk + r] = q[(long)i * dk + r] * e;
    }
    memset(out, 0, sizeof(float) * (size_t)L * dv);
    gemm_acc(out, dv, b->qd, dk, S, dv, L, dk, dv, 1.f);
    gemm_acc(out, dv, b->gq, C, b->u, dv, L, L, dv, 1.f); /* + intra corrected */
    exp_shifted(b->pair, b->neg, last, L); /* e^(d_last - d_j) */
    for (int r = 0; r < dk; r++)
        for (int j = 0; j < L; j++) b->kt[(long)r * C + j] *= b->pair[j];
    float carry = expf(last);
    for (long x = 0; x < (long)dk * dv; x++) S[x] *= carry;
    gemm_acc(S, dv, b->kt, C, b->u, dv, dk, L, dv, 1.f);
}

/* q, k [heads][T][dk], v [heads][T][dv], g, beta [heads][T], state [heads][dk][dv] (updated in
 * place), out [heads][T][dv]; chunks of C tokens (a multiple of 16). 0; -1 for another C, -2 where a
 * buffer could not be had. */
int pd_gated_delta_chunked(const float *q, const float *k, const float *v, const float *g, const float *beta,
                           int heads, int T, int dk, int dv, float *state, float *out, int C, int threads) {
    if (C % 16 || dk % 16 || dv % 16) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *all = malloc(sizeof(float) * chunk_floats(C, dk, dv));
        chunk_buffers b = chunk_buffers_in(all, C, dk, dv);
        failed = all == NULL;
        unsigned int csr = pd_denormals_flush();
#pragma omp for schedule(dynamic, 1)
        for (int h = 0; h < heads; h++) {
            if (failed) continue;
            for (int c0 = 0; c0 < T; c0 += C) {
                int L = T - c0 < C ? T - c0 : C;
                long at = (long)h * T + c0;
                float sum = 0.f;
                for (int i = 0; i < L; i++) b.decay[i] = sum += g[at + i];
                solve_chunk(q + at * dk, k + at * dk, v + at * dv, beta + at, L, C, dk, dv, &b);
                apply_chunk(q + at * dk, L, C, dk, dv, state + (long)h * dk * dv, out + at * dv, &b);
            }
        }
        pd_denormals_restore(csr);
        free(all);
    }
    return failed ? -2 : 0;
}

/* A chunk of one span's rows for value head h, gathered heads-first into the chunk buffers' own
 * copies (q normalised and scaled, k normalised, as gated_delta._prepare does), the decays summed */
typedef struct {
    const float *q, *k, *v, *g, *beta;
    long q_row, k_row, v_row; /* floats between rows */
    int k_heads, v_heads, dk, dv;
} token_rows;

static void gather_chunk(const token_rows *x, long first, int L, int h, float *q, float *k, float *v, float *beta,
                         float *decay) {
    int kh = h / (x->v_heads / x->k_heads);
    float scale = 1.f / sqrtf((float)x->dk), sum = 0.f;
    for (int i = 0; i < L; i++) {
        const float *qi = x->q + (first + i) * x->q_row + (long)kh * x->dk, *ki = x->k + (first + i) * x->k_row + (long)kh * x->dk;
        float qq = 0.f, kk = 0.f;
        for (int r = 0; r < x->dk; r++) qq += qi[r] * qi[r], kk += ki[r] * ki[r];
        float qs = scale / sqrtf(qq + 1e-6f), ks = 1.f / sqrtf(kk + 1e-6f);
        for (int r = 0; r < x->dk; r++) q[(long)i * x->dk + r] = qi[r] * qs, k[(long)i * x->dk + r] = ki[r] * ks;
        memcpy(v + (long)i * x->dv, x->v + (first + i) * x->v_row + (long)h * x->dv, sizeof(float) * x->dv);
        long gi = (first + i) * x->v_heads + h;
        beta[i] = x->beta[gi];
        decay[i] = sum += x->g[gi];
    }
}

/* Every prefill span of a step in one call: spans [n][3] (state slot, first row, end row) of q, k
 * [rows][k_heads][dk] and v [rows][v_heads][dv] (row strides q_row, k_row, v_row floats; not yet
 * normalised), g, beta [rows][v_heads]; each span's state at arena + offset + slot * stride
 * ([v_heads][dk][dv], updated in place); out [rows][v_heads][dv] (the spans' rows written). Work
 * items are (span, value head), so a step's short prompts share the threads; the Python per span
 * (heads-first copies, norms, a call, a concatenation) was a third of a Qwen3.5-shaped prefill. */
int pd_gated_delta_spans(const float *q, const float *k, const float *v, const float *g, const float *beta,
                         long q_row, long k_row, long v_row, int k_heads, int v_heads, int dk, int dv, float *arena,
                         long offset, long stride, const int64_t *spans, int n, float *out, int C, int threads) {
    if (C % 16 || dk % 16 || dv % 16 || v_heads % k_heads) return -1;
    token_rows x = {q, k, v, g, beta, q_row, k_row, v_row, k_heads, v_heads, dk, dv};
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* then a chunk's gathered q, k, v, its output and its betas */
        float *all = malloc(sizeof(float) * (chunk_floats(C, dk, dv) + (size_t)C * (2 * dk + 2 * dv + 1)));
        chunk_buffers b = chunk_buffers_in(all, C, dk, dv);
        float *qc = all + chunk_floats(C, dk, dv), *kc = qc + (long)C * dk, *vc = kc + (long)C * dk,
              *oc = vc + (long)C * dv, *bc = oc + (long)C * dv;
        failed = all == NULL;
        unsigned int csr = pd_denormals_flush();
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < n * v_heads; item++) {
            if (failed) continue;
            const int64_t *span = spans + 3L * (item / v_heads);
            int h = item % v_heads;
            float *S = arena + offset + span[0] * stride + (long)h * dk * dv;
            for (long c0 = span[1]; c0 < span[2]; c0 += C) {
                int L = span[2] - c0 < C ? (int)(span[2] - c0) : C;
                gather_chunk(&x, c0, L, h, qc, kc, vc, bc, b.decay);
                solve_chunk(qc, kc, vc, bc, L, C, dk, dv, &b);
                apply_chunk(qc, L, C, dk, dv, S, oc, &b);
                for (int i = 0; i < L; i++)
                    memcpy(out + ((c0 + i) * v_heads + h) * (long)dv, oc + (long)i * dv, sizeof(float) * dv);
            }
        }
        pd_denormals_restore(csr);
        free(all);
    }
    return failed ? -2 : 0;
}
