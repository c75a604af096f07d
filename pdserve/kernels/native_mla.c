/* Multi-head latent attention in a compiled decode step (native_decode.c calls it for a DeepSeek
 * layer), as pdserve.models.mla.MLAttention decodes: the absorbed form, each head attending
 * straight over the cached latents (see pd_mla in native_decode.h). Per row, in float32: the
 * queries, the latent (normed, its key part rotated) into the cache slot; then per (row, head) in
 * parallel: q_nope W_UK, scores over the row's context, the softmax, the weighted latents, W_UV. */
#include <stdlib.h>
#include <string.h>

#include "native_decode.h"

/* RoPE on one vector of dim values: interleaved pairs (x0, x1), (x2, x3) ... written back
 * de-interleaved (all first halves, then the second), as mla.rope_interleaved; else rotate_half */
static void rope(const pd_mla *a, float *x, const float *cos, const float *sin) {
    int half = a->rope / 2;
    if (!a->interleave) {
        pd_rope(x, 1, a->rope, cos, sin);
        return;
    }
    float tmp[a->rope];
    for (int i = 0; i < half; i++) {
        float x1 = x[2 * i], x2 = x[2 * i + 1];
        tmp[i] = x1 * cos[i] - x2 * sin[i];
        tmp[half + i] = x2 * cos[i] + x1 * sin[i];
    }
    memcpy(x, tmp, sizeof(tmp));
}

/* q [tokens, heads, nope + rope] and the latents kv [tokens, kv_lora + rope] of h, rotated and
 * normed; each row's latent into its cache slot (slots[t] < 0: none) */
static int project(const pd_model *m, const pd_layer *L, const float *h, int tokens, const float *cos,
                   const float *sin, const int64_t *slots, float *q, float *kv, float *qa, int threads) {
    const pd_mla *a = L->mla;
    int H = m->hidden, qk = a->nope + a->rope, latent = a->kv_lora + a->rope, rc;
    if (a->q_lora) {
        if ((rc = pd_matmul(&a->q_a, h, tokens, H, qa, threads))) return rc;
        pd_add_bias(qa, tokens, a->q_lora, a->q_a_bias);
        pd_add_norm(qa, NULL, a->q_a_norm, a->latent_eps, tokens, a->q_lora, qa);
        rc = pd_matmul(&a->q_b, qa, tokens, a->q_lora, q, threads);
    } else {
        rc = pd_matmul(&a->q, h, tokens, H, q, threads);
    }
    if (rc || (rc = pd_matmul(&a->kv_a, h, tokens, H, kv, threads))) return rc;
    pd_add_bias(kv, tokens, latent, a->kv_a_bias);
    for (int t = 0; t < tokens; t++) {
        float *row = kv + (size_t)t * latent;
        const float *c = cos + (size_t)t * a->rope, *s = sin + (size_t)t * a->rope;
        pd_add_norm(row, NULL, a->kv_a_norm, a->latent_eps, 1, a->kv_lora, row);
        rope(a, row + a->kv_lora, c, s);
        for (int hd = 0; hd < m->heads; hd++) rope(a, q + ((size_t)t * m->heads + hd) * qk + a->nope, c, s);
        if (slots[t] < 0) continue;
        memcpy(L->k_cache + pd_slot_row(m, slots[t]), row, sizeof(float) * latent);
    }
    return 0;
}

/* One head of one row: out [v_dim] = W_UV (softmax(scale [q_nope W_UK | q_pe] . latents) latents) */
static void attend_head(const pd_model *m, const pd_layer *L, const float *q, int hd, const int32_t *table,
                        int32_t length, float *scores, float *out) {
    const pd_mla *a = L->mla;
    int latent = a->kv_lora + a->rope, C = a->kv_lora;
    const float *w_uk = a->kv_b + (size_t)hd * (a->nope + a->v_dim) * C, *w_uv = w_uk + (size_t)a->nope * C;
    float query[latent], acc[C];
    memset(query, 0, sizeof(float) * C);
    for (int n = 0; n < a->nope; n++)
        for (int c = 0; c < C; c++) query[c] += q[n] * w_uk[(size_t)n * C + c];
    for (int r = 0; r < a->rope; r++) query[C + r] = q[a->nope + r];
    for (int i = 0; i < length; i++) {
        const float *key = L->k_cache + pd_cache_row(m, table, i, 0);
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int c = 0; c < latent; c++) dot += query[c] * key[c];
        scores[i] = dot * a->scale;
    }
    pd_softmax(scores, length, NULL);
    memset(acc, 0, sizeof(acc));
    for (int i = 0; i < length; i++) {
        const float *key = L->k_cache + pd_cache_row(m, table, i, 0);
        for (int c = 0; c < C; c++) acc[c] += scores[i] * key[c];
    }
    for (int j = 0; j < a->v_dim; j++) {
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int c = 0; c < C; c++) sum += acc[c] * w_uv[(size_t)j * C + c];
        out[j] = sum;
    }
}

int pd_mla_attention(const pd_model *m, const pd_layer *L, const float *h, int tokens, const float *cos,
                     const float *sin, const int64_t *slots, const int32_t *tables, int max_blocks, const int32_t *lens,
                     float *out, int threads) {
    const pd_mla *a = L->mla;
    int qk = a->nope + a->rope, latent = a->kv_lora + a->rope, max_len = 1;
    for (int t = 0; t < tokens; t++) max_len = lens[t] > max_len ? lens[t] : max_len;
    size_t items = (size_t)tokens * m->heads;
    float *q = malloc(sizeof(float) * (items * qk + (size_t)tokens * (latent + a->q_lora) + items * max_len));
    if (!q) return -2;
    float *kv = q + items * qk, *qa = kv + (size_t)tokens * latent, *scores = qa + (size_t)tokens * a->q_lora;
    int rc = project(m, L, h, tokens, cos, sin, slots, q, kv, qa, threads);
    if (rc) {
        free(q);
        return rc;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (size_t item = 0; item < items; item++) {
        int t = item / m->heads, hd = item % m->heads;
        attend_head(m, L, q + item * qk, hd, tables + (size_t)t * max_blocks, lens[t], scores + item * max_len,
                    out + item * a->v_dim);
    }
    free(q);
    return 0;
}
