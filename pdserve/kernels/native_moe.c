/* The MoE MLP of a compiled decode step (native_decode.c calls it for a layer with experts), as
 * pdserve.models.moe computes it on CPU: softmax_topk routing, then each expert's SiLU MLP over
 * the rows that chose it, experts in ascending order, and each row's weighted outputs summed in
 * that order from zero (Experts.forward's index_add); then the shared expert's (gated) output. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native_decode.h"

static int matmul(const pd_matrix *m, const float *x, int tokens, int cols, float *out, int threads) {
    return pd_gemv(x, tokens, cols, m->q, m->nrows, m->bits, m->scales, m->mins, m->half, m->has_min, m->group,
                   out, threads);
}

/* One row's routing: softmax over its logits [experts], the top_k largest (descending, the lower
 * index first on a tie, as topk), renormalized where asked -> ids [top_k], weights [top_k] */
static void route(const pd_moe *e, float *logits, int32_t *ids, float *weights) {
    float peak = logits[0], total = 0.f;
    for (int i = 1; i < e->experts; i++) peak = logits[i] > peak ? logits[i] : peak;
    for (int i = 0; i < e->experts; i++) total += (logits[i] = expf(logits[i] - peak));
    for (int i = 0; i < e->experts; i++) logits[i] /= total;
    float chosen = 0.f;
    for (int k = 0; k < e->top_k; k++) {
        int best = -1;
        for (int i = 0; i < e->experts; i++)
            if (logits[i] >= 0.f && (best < 0 || logits[i] > logits[best])) best = i;
        ids[k] = best;
        weights[k] = logits[best];
        chosen += logits[best];
        logits[best] = -1.f; /* taken */
    }
    if (e->renormalize)
        for (int k = 0; k < e->top_k; k++) weights[k] /= chosen;
}

/* out += weight * (one expert's MLP) for the n rows of h that chose it (rows: their indices) */
static int expert_rows(const pd_moe *e, int ex, const float *h, int hidden, const int32_t *rows, const float *w,
                       int n, float *scratch, float *out, int threads) {
    float *x = scratch, *gu = x + (size_t)n * hidden, *act = gu + (size_t)n * 2 * e->inter, *y = act + (size_t)n * e->inter;
    for (int j = 0; j < n; j++) memcpy(x + (size_t)j * hidden, h + (size_t)rows[j] * hidden, sizeof(float) * hidden);
    int rc = matmul(&e->gate_up[ex], x, n, hidden, gu, threads);
    if (rc) return rc;
    pd_gate_mul(gu, n, e->inter, 0, act);
    if ((rc = matmul(&e->down[ex], act, n, e->inter, y, threads))) return rc;
    for (int j = 0; j < n; j++) {
        float *o = out + (size_t)rows[j] * hidden;
        const float *yr = y + (size_t)j * hidden;
        for (int c = 0; c < hidden; c++) o[c] += w[j] * yr[c];
    }
    return 0;
}

/* out += the shared expert's output, times sigmoid(h . shared_gate) where it is gated */
static int shared_expert(const pd_moe *e, const float *h, int tokens, int hidden, float *scratch, float *out,
                         int threads) {
    float *gu = scratch, *act = gu + (size_t)tokens * 2 * e->shared_inter, *y = act + (size_t)tokens * e->shared_inter;
    int rc = matmul(&e->shared_gate_up, h, tokens, hidden, gu, threads);
    if (rc) return rc;
    pd_gate_mul(gu, tokens, e->shared_inter, 0, act);
    if ((rc = matmul(&e->shared_down, act, tokens, e->shared_inter, y, threads))) return rc;
    for (int t = 0; t < tokens; t++) {
        const float *ht = h + (size_t)t * hidden, *yt = y + (size_t)t * hidden;
        float g = 1.f;
        if (e->shared_gate) {
            float dot = 0.f;
            for (int c = 0; c < hidden; c++) dot += ht[c] * e->shared_gate[c];
            g = 1.f / (1.f + expf(-dot));
        }
        for (int c = 0; c < hidden; c++) out[(size_t)t * hidden + c] += g * yt[c];
    }
    return 0;
}

/* Each expert's rows of this step (the (row, slot) pairs that chose it, in row order), then the MLPs */
static int run_experts(const pd_moe *e, const float *h, int tokens, int hidden, const int32_t *ids,
                       const float *weights, float *scratch, float *out, int threads) {
    int32_t rows[tokens];
    float w[tokens];
    for (int ex = 0, rc; ex < e->experts; ex++) {
        int n = 0;
        for (int t = 0; t < tokens; t++)
            for (int k = 0; k < e->top_k; k++)
                if (ids[t * e->top_k + k] == ex) rows[n] = t, w[n++] = weights[t * e->top_k + k];
        if (n && (rc = expert_rows(e, ex, h, hidden, rows, w, n, scratch, out, threads))) return rc;
    }
    return 0;
}

int pd_moe_mlp(const pd_moe *e, const float *h, int tokens, int hidden, float *out, int threads) {
    int inter = e->inter > e->shared_inter ? e->inter : e->shared_inter;
    size_t per_row = (size_t)e->experts + e->top_k + 2 * hidden + 3 * (size_t)inter;
    float *logits = malloc(sizeof(float) * per_row * tokens + sizeof(int32_t) * (size_t)tokens * e->top_k);
    if (!logits) return -2;
    float *weights = logits + (size_t)tokens * e->experts, *scratch = weights + (size_t)tokens * e->top_k;
    int32_t *ids = (int32_t *)(logits + per_row * tokens);
    int rc = matmul(&e->router, h, tokens, hidden, logits, threads);
    for (int t = 0; rc == 0 && t < tokens; t++)
        route(e, logits + (size_t)t * e->experts, ids + (size_t)t * e->top_k, weights + (size_t)t * e->top_k);
    memset(out, 0, sizeof(float) * (size_t)tokens * hidden);
    if (rc == 0) rc = run_experts(e, h, tokens, hidden, ids, weights, scratch, out, threads);
    if (rc == 0 && e->shared_inter > 0) rc = shared_expert(e, h, tokens, hidden, scratch, out, threads);
    free(logits);
    return rc;
}
