/* The MoE MLP of a compiled decode step (native_decode.c calls it for a layer with experts), as
 * pdserve.models.moe computes it on CPU: softmax_topk or topk_softmax routing, then each expert's SiLU MLP over
 * the rows that chose it, experts in ascending order, and each row's weighted outputs summed in
 * that order from zero (Experts.forward's index_add); then the shared expert's (gated) output. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "native_decode.h"

/* ids [top_k] of the top_k largest of x [n] (descending, the lower index first on a tie, as
 * topk), and their values; x's chosen entries become -inf */
static void top_k(float *x, int n, int k, int32_t *ids, float *values) {
    for (int j = 0; j < k; j++) {
        int best = 0;
        for (int i = 1; i < n; i++) best = x[i] > x[best] ? i : best;
        ids[j] = best;
        values[j] = x[best];
        x[best] = -INFINITY;
    }
}

/* Drop all but the topk_group best of the n_group groups of choice [experts] (set to `dropped`) */
static void keep_groups(const pd_moe *e, float *choice, float dropped) {
    int per = e->experts / e->n_group;
    float score[e->n_group], best[2];
    int32_t kept[e->topk_group], ids[2];
    for (int g = 0; g < e->n_group; g++) {
        float group[per];
        memcpy(group, choice + g * per, sizeof(group));
        top_k(group, per, e->group_top2 ? 2 : 1, ids, best);
        score[g] = e->group_top2 ? best[0] + best[1] : best[0];
    }
    float kept_scores[e->topk_group];
    top_k(score, e->n_group, e->topk_group, kept, kept_scores);
    for (int g = 0; g < e->n_group; g++) {
        int keep = 0;
        for (int j = 0; j < e->topk_group; j++) keep |= kept[j] == g;
        for (int i = 0; !keep && i < per; i++) choice[g * per + i] = dropped;
    }
}

/* DeepSeek's routing (see pd_moe) of one row's logits [experts] -> ids [top_k], weights [top_k] */
static void route_grouped(const pd_moe *e, float *logits, int32_t *ids, float *weights) {
    int E = e->experts;
    float scores[E], choice[E], chosen[e->top_k], total = 0.f;
    for (int i = 0; i < E; i++) scores[i] = e->sigmoid ? 1.f / (1.f + expf(-logits[i])) : logits[i];
    if (!e->sigmoid) pd_softmax(scores, E, NULL);
    for (int i = 0; i < E; i++) choice[i] = scores[i] + (e->correction_bias ? e->correction_bias[i] : 0.f);
    if (e->n_group > 1) keep_groups(e, choice, e->sigmoid ? -INFINITY : 0.f);
    top_k(choice, E, e->top_k, ids, chosen);
    for (int k = 0; k < e->top_k; k++) total += (weights[k] = scores[ids[k]]);
    for (int k = 0; k < e->top_k; k++) weights[k] = (e->renormalize ? weights[k] / (total + 1e-20f) : weights[k]) * e->scaling;
}

/* One row's routing (see pd_moe) of its logits [experts] -> ids [top_k], weights [top_k] */
static void route(const pd_moe *e, float *logits, int32_t *ids, float *weights) {
    if (e->grouped) {
        route_grouped(e, logits, ids, weights);
        return;
    }
    pd_add_bias(logits, 1, e->experts, e->router_bias);
    if (e->topk_first) {
        top_k(logits, e->experts, e->top_k, ids, weights);
        pd_softmax(weights, e->top_k, NULL);
        return;
    }
    pd_softmax(logits, e->experts, NULL);
    top_k(logits, e->experts, e->top_k, ids, weights);
    if (!e->renormalize) return;
    float chosen = 0.f;
    for (int k = 0; k < e->top_k; k++) chosen += weights[k];
    for (int k = 0; k < e->top_k; k++) weights[k] /= chosen;
}

/* gpt-oss's clamped SwiGLU of each row's [gate | up]: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g),
 * g = min(gate, limit) */
static void clamped_swiglu(const pd_moe *e, const float *gu, int rows, float *act) {
    int inter = e->inter;
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < inter; i++) {
            float g = fminf(gu[(size_t)r * 2 * inter + i], e->limit);
            float u = fmaxf(fminf(gu[(size_t)r * 2 * inter + inter + i], e->limit), -e->limit);
            act[(size_t)r * inter + i] = (u + 1.f) * (g * (1.f / (1.f + expf(-(g * e->alpha)))));
        }
}

/* One expert's MLP over the n rows of h that chose it (rows: their indices), each row's output
 * to ys at its (row, choice) slot (slots: those indices); one thread */
static int expert_rows(const pd_moe *e, int ex, const float *h, int hidden, const int32_t *rows, const int32_t *slots,
                       int n, float *scratch, float *ys) {
    float *x = scratch, *gu = x + (size_t)n * hidden, *act = gu + (size_t)n * 2 * e->inter, *y = act + (size_t)n * e->inter;
    for (int j = 0; j < n; j++) memcpy(x + (size_t)j * hidden, h + (size_t)rows[j] * hidden, sizeof(float) * hidden);
    int rc = pd_matmul(&e->gate_up[ex], x, n, hidden, gu, 1);
    if (rc) return rc;
    if (e->gate_up_bias) pd_add_bias(gu, n, 2 * e->inter, e->gate_up_bias + (size_t)ex * 2 * e->inter);
    if (e->limit > 0.f) clamped_swiglu(e, gu, n, act);
    else pd_gate_mul(gu, n, e->inter, 0, act);
    if ((rc = pd_matmul(&e->down[ex], act, n, e->inter, y, 1))) return rc;
    if (e->down_bias) pd_add_bias(y, n, hidden, e->down_bias + (size_t)ex * hidden);
    for (int j = 0; j < n; j++) memcpy(ys + (size_t)slots[j] * hidden, y + (size_t)j * hidden, sizeof(float) * hidden);
    return 0;
}

/* out += the shared expert's output, times sigmoid(h . shared_gate) where it is gated */
static int shared_expert(const pd_moe *e, const float *h, int tokens, int hidden, float *scratch, float *out,
                         int threads) {
    float *gu = scratch, *act = gu + (size_t)tokens * 2 * e->shared_inter, *y = act + (size_t)tokens * e->shared_inter;
    int rc = pd_matmul(&e->shared_gate_up, h, tokens, hidden, gu, threads);
    if (rc) return rc;
    pd_gate_mul(gu, tokens, e->shared_inter, 0, act);
    if ((rc = pd_matmul(&e->shared_down, act, tokens, e->shared_inter, y, threads))) return rc;
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

/* Each expert's rows of this step (the (row, choice) slots that chose it, in row order), the
 * experts in parallel, one thread each: at a few rows an expert's matrices are too small to split
 * between threads (each split cost a barrier, 448 a step at 32 rows of the benchmark's model),
 * while whole experts stream their weights side by side. Then each row sums its outputs in
 * ascending expert order from zero, as the experts one after another added them. */
static int run_experts(const pd_moe *e, const float *h, int tokens, int hidden, const int32_t *ids,
                       const float *weights, float *out, int threads) {
    int K = e->top_k, E = e->local_experts, E0 = e->first_expert;
    int inter = e->inter, pairs = tokens * K;
    size_t per_thread = (size_t)tokens * (2 * hidden + 3 * (size_t)inter);
    int32_t *first = malloc(sizeof(int32_t) * ((size_t)E + 1 + 2 * (size_t)pairs));
    float *ys = malloc(sizeof(float) * ((size_t)pairs * hidden + per_thread * threads));
    if (!first || !ys) {
        free(first);
        free(ys);
        return -2;
    }
    int32_t *rows = first + E + 1, *slots = rows + pairs;
    first[0] = 0;
    for (int ex = 0, n = 0; ex < E; first[++ex] = n) /* each expert's pairs, in row order */
        for (int p = 0; p < pairs; p++)
            if (ids[p] == E0 + ex) rows[n] = p / K, slots[n++] = p;
    int rc = 0;
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (pairs > 1)
    for (int ex = 0; ex < E; ex++) {
        int n = first[ex + 1] - first[ex], err;
        float *scratch = ys + (size_t)pairs * hidden + per_thread * (size_t)omp_get_thread_num();
        if (n && (err = expert_rows(e, ex, h, hidden, rows + first[ex], slots + first[ex], n, scratch, ys))) {
#pragma omp atomic write
            rc = err;
        }
    }
    for (int t = 0; rc == 0 && t < tokens; t++)
        for (int done = 0, last = -1; done < K; done++) { /* the row's choices by ascending expert */
            int next = -1;
            for (int k = 0; k < K; k++)
                if (ids[t * K + k] > last && (next < 0 || ids[t * K + k] < ids[t * K + next])) next = k;
            if (next < 0) break; /* repeated ids (NaN logits can give them): never read before the row */
            last = ids[t * K + next];
            if (last < E0 || last >= E0 + E) continue; /* another rank's expert (expert parallelism) */
            const float w = weights[t * K + next], *y = ys + (size_t)(t * K + next) * hidden;
            float *o = out + (size_t)t * hidden;
            for (int c = 0; c < hidden; c++) o[c] += w * y[c];
        }
    free(first);
    free(ys);
    return rc;
}

int pd_moe_mlp(const pd_moe *e, const float *h, int tokens, int hidden, float *out, int threads) {
    int inter = e->inter > e->shared_inter ? e->inter : e->shared_inter;
    size_t per_row = (size_t)e->experts + e->top_k + 2 * hidden + 3 * (size_t)inter;
    float *logits = malloc(sizeof(float) * per_row * tokens + sizeof(int32_t) * (size_t)tokens * e->top_k);
    if (!logits) return -2;
    float *weights = logits + (size_t)tokens * e->experts, *scratch = weights + (size_t)tokens * e->top_k;
    int32_t *ids = (int32_t *)(logits + per_row * tokens);
    int rc = pd_matmul(&e->router, h, tokens, hidden, logits, threads);
    for (int t = 0; rc == 0 && t < tokens; t++)
        route(e, logits + (size_t)t * e->experts, ids + (size_t)t * e->top_k, weights + (size_t)t * e->top_k);
    memset(out, 0, sizeof(float) * (size_t)tokens * hidden);
    if (rc == 0) rc = run_experts(e, h, tokens, hidden, ids, weights, out, threads);
    if (rc == 0 && e->shared_inter > 0) rc = shared_expert(e, h, tokens, hidden, scratch, out, threads);
    free(logits);
    return rc;
}
