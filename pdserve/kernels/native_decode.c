/* A decode step through every layer of a Llama-family model on CPU, in one call: pdserve's decode
 * steps at a few requests. Built into the same library as native_gemv.c (native_gemv.py builds it;
 * native_decode.py lays out the model and calls it).
 *
 * Why: at one request a SmolLM2 step spent about 5 ms of its 13 in Python between the kernels,
 * some ten calls a layer (norms, RoPE, the cache write, attention, SiLU, four matmuls) of 3 to
 * 10 us each. Here the same work runs layer after layer in C, and only the matmuls (pd_gemv) and
 * attention open parallel regions.
 *
 * Each op is the one pdserve.models.llama runs on CPU (numba_fused, numba_ops, quant_cpu), in
 * float32, in the same order of ops; sums may be taken in another order, as between those
 * kernels and transformers' own. Per layer:
 *   h = RMSNorm(x) (carried from the layer before), qkv = h @ Wqkv.T (+ its bias: Qwen2), each
 *   head of q and k RMS-normed (Qwen3), RoPE on q and k, k and v into the paged cache, paged
 *   attention per (query row, KV head), x += attn @ Wo.T,
 *   h = RMSNorm(x), x += (SiLU(gate) * up) @ Wdown.T, h = the next layer's RMSNorm(x).
 * Gemma 3's layers differ in three ways the model declares: the attention and MLP outputs are
 * RMS-normed before they join x, the gate is GELU (tanh), and each layer takes the RoPE table of
 * its kind (sliding or full). Its (1 + w) norm weights come in already added.
 * With LoRA, each of the four products gets its row's adapter delta (x A^T) B^T added.
 * A MoE layer (L->moe) runs its router and experts in place of gate_up and down (native_moe.c).
 * At tensor_parallel_size > 1 each rank runs its shard (its heads, its intermediate slice): the o
 * and down products are partial sums, which m->reduce (the rank group's all-reduce, a callback
 * into Python) sums over ranks before they join the residual, where RowParallelLinear sums them.
 * A query row is one token: a plain decode's, or one of a verify step's k + 1 rows (speculation).
 * Each row carries its own context length, so a verify row sees the rows before it (their keys are
 * in the cache before any row attends) and not those after: causal among the rows.
 */
#include "native_simd.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native_decode.h"
#include "native_bf16.h"
#include "native_exp.h"

/* h = w * (x / sqrt(mean(x^2) + eps)) for each of the tokens' rows, after x += delta when delta is
 * given. The sum of squares runs element by element (numba's and transformers' float32 order),
 * or under bf16 products in 16 lanes as the Python layers' norms then sum (native_rows.c: the
 * same values as theirs): one element after another it was a chain of dependent FMAs, 3.8% of a
 * 128-request step of the default GGUF (perf). */
void pd_add_norm(float *x, const float *delta, const float *w, float eps, int tokens, int cols, float *h) {
    int lanes = cols % 16 == 0 && pd_bf16_on();
    for (int t = 0; t < tokens; t++) {
        float *xr = x + (long)t * cols, *hr = h + (long)t * cols, ss = 0.f;
        if (delta)
            for (int c = 0; c < cols; c++) xr[c] += delta[(long)t * cols + c];
        if (lanes) ss = pd_squares16(xr, cols);
        else
            for (int c = 0; c < cols; c++) ss += xr[c] * xr[c];
        float inv = 1.0f / sqrtf(ss / (float)cols + eps);
        for (int c = 0; c < cols; c++) hr[c] = w[c] * (xr[c] * inv);
    }
}

/* rotate_half RoPE in place on `heads` heads of one token; cos, sin that token's [head_dim] */
void pd_rope(float *x, int heads, int dim, const float *cos, const float *sin) {
    int half = dim / 2;
    for (int h = 0; h < heads; h++) {
        float *xh = x + (long)h * dim;
        for (int d = 0; d < half; d++) {
            float x1 = xh[d], x2 = xh[d + half];
            xh[d] = x1 * cos[d] - x2 * sin[d];
            xh[d + half] = x2 * cos[d + half] + x1 * sin[d + half];
        }
    }
}

/* A bf16 KV cache (m->kv_bf16: --kv-cache-dtype bfloat16) holds to_bf16_bits of each element
 * (native_decode.h); offsets are in elements either way. Half the bytes attention reads at many
 * requests. */
static void store_kv_row(const pd_model *m, float *plane, long at, const float *row, int D) {
    if (!m->kv_bf16) {
        memcpy(plane + at, row, D * sizeof(float));
        return;
    }
    uint16_t *out = (uint16_t *)plane + at;
    for (int d = 0; d < D; d++) out[d] = to_bf16_bits(row[d]);
}

/* Rows of a step are independent in the norms, the gate and finish_qkv: past this many the
 * step runs them on every thread (on one, the other thread spun in libgomp meanwhile: the gate's
 * SiLU over 128 tokens x 1536 took 0.2 ms a layer), each row computed exactly as on one thread. */
#define PARALLEL_ROWS 8

static void add_norm_rows(float *x, const float *delta, const float *w, float eps, int tokens, int cols, float *h,
                          int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens >= PARALLEL_ROWS)
    for (int t = 0; t < tokens; t++)
        pd_add_norm(x + (long)t * cols, delta ? delta + (long)t * cols : NULL, w, eps, 1, cols, h + (long)t * cols);
}

/* Each token's qkv row: its bias added, q's and k's heads normed, RoPE on them, then its k and v
 * into the cache slot slots[t] (skipped when < 0) */
static void finish_qkv(const pd_model *m, const pd_layer *L, float *qkv, int tokens, const float *cos,
                       const float *sin, const int64_t *slots, int threads) {
    int D = m->head_dim, cols = (m->heads + 2 * m->kv_heads) * D;
    cos += (long)L->rope * tokens * D; /* the layer's table: tables [rope tables, tokens, head_dim] */
    sin += (long)L->rope * tokens * D;
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens >= PARALLEL_ROWS)
    for (int t = 0; t < tokens; t++) {
        float *q = qkv + (long)t * cols, *k = q + m->heads * D, *v = k + m->kv_heads * D;
        if (L->qkv_bias)
            for (int c = 0; c < cols; c++) q[c] += L->qkv_bias[c];
        if (L->q_norm) {
            pd_add_norm(q, NULL, L->q_norm, m->eps, m->heads, D, q);
            pd_add_norm(k, NULL, L->k_norm, m->eps, m->kv_heads, D, k);
        }
        pd_rope(q, m->heads, D, cos + (long)t * D, sin + (long)t * D);
        pd_rope(k, m->kv_heads, D, cos + (long)t * D, sin + (long)t * D);
        if (slots[t] < 0) continue; /* (each token its own slot: no two threads write one row) */
        long base = pd_slot_row(m, slots[t]);
        for (int h = 0; h < m->kv_heads; h++) {
            store_kv_row(m, L->k_cache, base + h * m->s_head, k + (long)h * D, D);
            store_kv_row(m, L->v_cache, base + h * m->s_head, v + (long)h * D, D);
        }
    }
}

/* SiLU as torch's: g / (1 + e^-g) */
static inline __m512 silu16(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

/* GELU as torch's gelu(approximate="tanh"): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), with
 * tanh(u) as sign(u) (1 - e^-2|u|) / (1 + e^-2|u|) (no overflow at any u) */
static inline __m512 gelu_tanh16(__m512 g) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                             _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), _mm512_mul_ps(_mm512_mul_ps(g, g), g), g));
    __m512 e = exp16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(u)));
    __m512 th = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    th = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(th), _mm512_and_si512(
        _mm512_castps_si512(u), _mm512_set1_epi32((int)0x80000000))));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, th));
}

static inline float gate1(float g, int gelu) {
    return gelu ? 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)))
                : g / (1.0f + expf(-g));
}

/* (native_decode.h) GELU where gelu is set: Gemma 3 */
void pd_gate_mul(const float *gu, int tokens, int inter, int gelu, float *act) {
    for (int t = 0; t < tokens; t++) {
        const float *gate = gu + (long)t * 2 * inter, *up = gate + inter;
        float *a = act + (long)t * inter;
        int i = 0;
        for (; i + 16 <= inter; i += 16) {
            __m512 g = _mm512_loadu_ps(gate + i);
            _mm512_storeu_ps(a + i, _mm512_mul_ps(gelu ? gelu_tanh16(g) : silu16(g), _mm512_loadu_ps(up + i)));
        }
        for (; i < inter; i++) a[i] = gate1(gate[i], gelu) * up[i];
    }
}

/* attn [tokens, heads * head_dim] = the layer's attention of h, its K and V into the cache; qkv
 * is its scratch rows */
static int attention(const pd_model *m, const pd_layer *L, const float *h, int tokens, const float *cos,
                     const float *sin, const int64_t *slots, const int32_t *tables, int max_blocks,
                     const int32_t *lens, const int32_t *row_slots, float *qkv, float *attn, int threads) {
    int rc = pd_matmul(&L->qkv, h, tokens, m->hidden, qkv, threads);
    if (rc || (rc = pd_lora_add(&L->lora_qkv, h, tokens, m->hidden, row_slots, qkv, threads))) return rc;
    finish_qkv(m, L, qkv, tokens, cos, sin, slots, threads);
    return pd_attend(m, L, qkv, (long)(m->heads + 2 * m->kv_heads) * m->head_dim, tokens, tables, max_blocks, lens,
                     attn, threads);
}

/* o = the layer's MLP of h (with its LoRA deltas); gu and act are its scratch rows */
static int dense_mlp(const pd_model *m, const pd_layer *L, const float *h, int tokens, const int32_t *row_slots,
                     float *gu, float *act, float *o, int threads) {
    int rc = pd_matmul(&L->gate_up, h, tokens, m->hidden, gu, threads);
    if (rc || (rc = pd_lora_add(&L->lora_gate_up, h, tokens, m->hidden, row_slots, gu, threads))) return rc;
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens >= PARALLEL_ROWS)
    for (int t = 0; t < tokens; t++)
        pd_gate_mul(gu + (long)t * 2 * m->inter, 1, m->inter, m->act, act + (long)t * m->inter);
    if ((rc = pd_matmul(&L->down, act, tokens, m->inter, o, threads))) return rc;
    return pd_lora_add(&L->lora_down, act, tokens, m->inter, row_slots, o, threads);
}

/* x [tokens, hidden]: the embedded tokens in, the last residual out; h [tokens, hidden] out: the
 * final RMSNorm's output. cos, sin [rope tables, tokens, head_dim]; slots [tokens]; tables [tokens, max_blocks];
 * lens [tokens] (each sequence's context, this token included); row_slots [tokens]: each row's LoRA
 * slot (-1: none), or NULL when no row has an adapter. Returns 0, or < 0 on failure (a
 * shape pd_gemv does not take: the caller checked them; no memory), or the reduce's failure. */
int pd_decode_layers(const pd_model *m, float *x, int tokens, const float *cos, const float *sin,
                     const int64_t *slots, const int32_t *tables, int max_blocks, const int32_t *lens,
                     const int32_t *row_slots, float *h, int threads) {
    int H = m->hidden, D = m->head_dim, qkv_cols = (m->heads + 2 * m->kv_heads) * D, q_cols = m->heads * D;
    size_t per_token = (size_t)qkv_cols + q_cols + H + 2 * m->inter + m->inter;
    float *qkv = malloc(sizeof(float) * per_token * tokens), *attn = qkv + (size_t)tokens * qkv_cols;
    float *o = attn + (size_t)tokens * q_cols, *gu = o + (size_t)tokens * H, *act = gu + (size_t)tokens * 2 * m->inter;
    int rc = qkv ? 0 : -2;
    add_norm_rows(x, NULL, m->layer[0].input_norm, m->eps, tokens, H, h, threads);
    for (int l = 0; rc == 0 && l < m->layers; l++) {
        const pd_layer *L = &m->layer[l];
        rc = L->mla ? pd_mla_attention(m, L, h, tokens, cos, sin, slots, tables, max_blocks, lens, attn, threads)
                    : attention(m, L, h, tokens, cos, sin, slots, tables, max_blocks, lens, row_slots, qkv, attn,
                                threads);
        if (rc || (rc = pd_matmul(&L->o, attn, tokens, q_cols, o, threads))) break;
        if ((rc = pd_lora_add(&L->lora_o, attn, tokens, q_cols, row_slots, o, threads))) break;
        pd_add_bias(o, tokens, H, L->o_bias);
        if (m->reduce && (rc = m->reduce(o, (int64_t)tokens * H))) break;
        if (L->attn_out_norm) add_norm_rows(o, NULL, L->attn_out_norm, m->eps, tokens, H, o, threads);
        add_norm_rows(x, o, L->post_norm, m->eps, tokens, H, h, threads);
        rc = L->moe ? pd_moe_mlp(L->moe, h, tokens, H, o, threads)
                    : dense_mlp(m, L, h, tokens, row_slots, gu, act, o, threads);
        if (rc) break;
        if (m->reduce && (rc = m->reduce(o, (int64_t)tokens * H))) break;
        if (L->mlp_out_norm) add_norm_rows(o, NULL, L->mlp_out_norm, m->eps, tokens, H, o, threads);
        add_norm_rows(x, o, l + 1 < m->layers ? m->layer[l + 1].input_norm : m->final_norm, m->eps, tokens, H, h,
                      threads);
    }
    free(qkv);
    return rc;
}
