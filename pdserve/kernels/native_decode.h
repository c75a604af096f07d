/* The compiled decode step's layout of a model (native_decode.c, native_moe.c; native_decode.py
 * mirrors these structs in ctypes). */
#pragma once
#include <stdint.h>
#include <string.h>

/* A bf16 KV cache's words: each element's upper 16 bits, rounded to nearest even as torch's
 * float-to-bf16 conversion rounds (denormals kept, NaN kept a NaN). The compiled step's stores and
 * a prefill's (native_rows.c) both write them; the scalar form vectorizes. */
static inline uint16_t to_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* a bf16 word widened to float32, exactly */
static inline float from_bf16_bits(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

int pd_gemv(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
            const void *mins, int half, int has_min, int group, const uint8_t *pack, float *out, int threads);

/* One quantized matrix, as native_gemv.matrix_args describes it (native_decode.py mirrors these). */
typedef struct {
    const uint8_t *q;
    const void *scales, *mins;
    int32_t nrows, bits, half, has_min, group;
    const uint8_t *pack; /* its int8 pack (pd_int8_pack), or NULL */
} pd_matrix;

/* A linear layer's LoRA slots (pdserve.lora.slots.LoRALayerSlots): slot s's A^T is columns
 * s * width .. of a [in, ld], its scaled B^T rows s * width .. of b [slots * width, out]; columns
 * past an adapter's rank are zero. a NULL: the layer has no LoRA. */
typedef struct {
    const float *a, *b;
    int32_t width, ld, out;
} pd_lora;

/* y[t] += (x[t] A_s^T) B_s^T for each row t with an adapter slot s = row_slots[t] >= 0 (native_lora.c);
 * 0, or -2 when out of memory */
int pd_lora_add(const pd_lora *L, const float *x, int tokens, int cols, const int32_t *row_slots, float *y,
                int threads);

/* A mixture-of-experts MLP (Qwen2/3-MoE, Mixtral, gpt-oss): each row's top_k experts, by a softmax
 * over the router's logits then the top k (their weights renormalized to sum 1 where renormalize
 * is set), or where topk_first is set by the top k logits then a softmax over those (gpt-oss).
 * Each expert is a SiLU MLP, or where limit > 0 gpt-oss's clamped SwiGLU; Qwen2-MoE adds a shared
 * expert whose output sigmoid(h . shared_gate) scales. */
typedef struct pd_moe {
    pd_matrix router;                /* [experts, hidden] */
    const pd_matrix *gate_up, *down; /* expert e's [2 inter, hidden] and [hidden, inter] */
    int32_t experts, top_k, inter, renormalize, topk_first;
    const float *router_bias, *gate_up_bias, *down_bias; /* [experts], [experts, 2 inter], [experts, hidden], or NULL */
    float alpha, limit; /* the clamped SwiGLU's (limit 0: SiLU) */
    /* DeepSeek's grouped routing where grouped is set (pdserve.models.moe.grouped_topk): scores by
     * a sigmoid (else a softmax), chosen by score + correction_bias within the topk_group best of
     * n_group groups (a group scored by its best two where group_top2, else its best), weighted by
     * the scores (renormalized where asked), times scaling */
    int32_t grouped, sigmoid, n_group, topk_group, group_top2;
    const float *correction_bias;
    float scaling;
    pd_matrix shared_gate_up, shared_down; /* read where shared_inter > 0 */
    int32_t shared_inter;
    const float *shared_gate; /* [hidden], or NULL: the shared expert's output is not gated */
    /* this rank's experts, [first_expert, first_expert + local_experts) of the router's `experts`
     * (gate_up, down and the experts' biases index them from 0): every expert but under expert
     * parallelism, where the rows' choices of other ranks' experts add nothing here */
    int32_t first_expert, local_experts;
} pd_moe;

/* Multi-head latent attention (DeepSeek-V2/V3; pdserve.models.mla), absorbed as its decode runs:
 * queries q_b(RMSNorm(q_a h)) (or q h where q_lora is 0), [nope | rope] per head; the latent
 * kv_a h = [kv_lora | rope], its first part RMS-normed and its rope part rotated, is the token's
 * one cache row (the layer's k_cache plane, at the model's strides). Each head attends over the
 * latents with [q_nope W_UK | q_pe], and its output is W_UV times the weighted latents; kv_b
 * [heads, nope + v, kv_lora] holds W_UK's rows, then W_UV's, for each head. */
typedef struct pd_mla {
    pd_matrix q_a, q_b, q, kv_a;
    const float *q_a_bias, *kv_a_bias; /* or NULL */
    const float *q_a_norm, *kv_a_norm, *kv_b;
    int32_t q_lora, kv_lora, nope, rope, v_dim, interleave; /* interleave: RoPE on (even, odd) pairs */
    float latent_eps, scale;
} pd_mla;

typedef struct {
    pd_matrix qkv, o, gate_up, down;
    pd_lora lora_qkv, lora_o, lora_gate_up, lora_down;
    const float *input_norm, *post_norm;
    const float *qkv_bias;        /* added to h @ Wqkv.T (Qwen2), or NULL */
    const float *q_norm, *k_norm; /* per-head RMSNorm weights [head_dim] before RoPE (Qwen3), or NULL */
    float *k_cache, *v_cache; /* this layer's planes: [blocks, block_size, kv_heads, head_dim] at the strides below */
    int64_t window;           /* sliding window in tokens, 0 for full attention */
    /* Gemma 3's norms of the attention and MLP outputs before they join the residual, or NULL */
    const float *attn_out_norm, *mlp_out_norm;
    int32_t rope; /* which of the step's RoPE tables this layer takes (Gemma 3: sliding or full) */
    const struct pd_moe *moe; /* the layer's experts in place of gate_up and down, or NULL */
    const float *o_bias;      /* added to attn @ Wo.T (gpt-oss), or NULL */
    const float *sinks;       /* [heads]: each head's sink logit in its softmax's denominator (gpt-oss), or NULL */
    const struct pd_mla *mla; /* multi-head latent attention in place of qkv (DeepSeek), or NULL */
} pd_layer;

/* Sums buf[0 .. n) over the tensor-parallel ranks in place; 0, or nonzero on failure. */
typedef int (*pd_reduce)(float *buf, int64_t n);

typedef struct {
    int32_t layers, hidden, inter, heads, kv_heads, head_dim, block_size;
    float eps, scale;
    int64_t s_block, s_slot, s_head; /* cache strides, in floats */
    const float *final_norm;
    const pd_layer *layer;
    pd_reduce reduce; /* NULL: one rank */
    int32_t act;      /* the MLP's gate: 0 SiLU, 1 GELU (tanh approximation: Gemma 3) */
    int32_t kv_bf16;  /* the KV planes hold bf16 (native_attend.c's kv16), not float32 */
} pd_model;

/* f(gate) * up for each row's [gate | up] of gu [tokens, 2 * inter] -> act [tokens, inter]: f SiLU,
 * or GELU (tanh) where gelu is set */
void pd_gate_mul(const float *gu, int tokens, int inter, int gelu, float *act);

/* out [tokens, hidden] = the MoE MLP of h [tokens, hidden]; 0, or < 0 (no memory, a bad shape) */
int pd_moe_mlp(const pd_moe *e, const float *h, int tokens, int hidden, float *out, int threads);

/* (native_decode.c) h = w * x / rms(x) per row, after x += delta where delta is given; rotate_half
 * RoPE on `heads` heads of one row; (native_attend.c) a softmax with an optional sink logit */
void pd_add_norm(float *x, const float *delta, const float *w, float eps, int tokens, int cols, float *h);
/* (native_rows.c) a row's sum of squares in 16 lanes (cols a multiple of 16) */
float pd_squares16(const float *x, int cols);
void pd_rope(float *x, int heads, int dim, const float *cos, const float *sin);
void pd_softmax(float *s, long length, const float *sink);

/* (native_attend.c) each row's attention over its paged context: row b's query heads start at
 * q + b * cols, its context is lens[b] tokens through tables[b]; out [tokens, heads * head_dim].
 * 0, or -2 when out of memory */
int pd_attend(const pd_model *m, const pd_layer *L, const float *q, long cols, int tokens, const int32_t *tables,
              int max_blocks, const int32_t *lens, float *out, int threads);

/* (native_mla.c) out [tokens, heads * v_dim] = the MLA layer's attention of h; the latents into the cache */
int pd_mla_attention(const pd_model *m, const pd_layer *L, const float *h, int tokens, const float *cos,
                     const float *sin, const int64_t *slots, const int32_t *tables, int max_blocks, const int32_t *lens,
                     float *out, int threads);

/* The helpers every file of the step shares, inline here. */

/* out [tokens, nrows] = x [tokens, cols] @ m.T (pd_gemv); 0, or < 0 for a shape it does not take */
static inline int pd_matmul(const pd_matrix *m, const float *x, int tokens, int cols, float *out, int threads) {
    return pd_gemv(x, tokens, cols, m->q, m->nrows, m->bits, m->scales, m->mins, m->half, m->has_min, m->group,
                   m->pack, out, threads);
}

/* rows [n, width] += bias [width]; nothing where bias is NULL */
static inline void pd_add_bias(float *rows, int n, int width, const float *bias) {
    for (int r = 0; bias && r < n; r++)
        for (int c = 0; c < width; c++) rows[(long)r * width + c] += bias[c];
}

/* The offset, in floats, of cache slot `slot` (block slot / block_size, row slot % block_size) */
static inline long pd_slot_row(const pd_model *m, int64_t slot) {
    return (slot / m->block_size) * m->s_block + (slot % m->block_size) * m->s_slot;
}

/* The offset of KV head kh of a sequence's token t, through its block table */
static inline long pd_cache_row(const pd_model *m, const int32_t *table, long t, int kh) {
    return table[t / m->block_size] * m->s_block + (t % m->block_size) * m->s_slot + kh * m->s_head;
}

