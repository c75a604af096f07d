/* The compiled decode step's layout of a model (native_decode.c, native_moe.c; native_decode.py
 * mirrors these structs in ctypes). */
#pragma once
#include <stdint.h>

int pd_gemv(const float *x, int tokens, int cols, const uint8_t *q, int nrows, int bits, const void *scales,
            const void *mins, int half, int has_min, int group, float *out, int threads);

/* One quantized matrix, as native_gemv.matrix_args describes it (native_decode.py mirrors these). */
typedef struct {
    const uint8_t *q;
    const void *scales, *mins;
    int32_t nrows, bits, half, has_min, group;
} pd_matrix;

/* A linear layer's LoRA slots (pdserve.lora.slots.LoRALayerSlots): slot s's A^T is columns
 * s * width .. of a [in, ld], its scaled B^T rows s * width .. of b [slots * width, out]; columns
 * past an adapter's rank are zero. a NULL: the layer has no LoRA. */
typedef struct {
    const float *a, *b;
    int32_t width, ld, out;
} pd_lora;

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
    pd_matrix shared_gate_up, shared_down; /* read where shared_inter > 0 */
    int32_t shared_inter;
    const float *shared_gate; /* [hidden], or NULL: the shared expert's output is not gated */
} pd_moe;

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
} pd_model;

/* f(gate) * up for each row's [gate | up] of gu [tokens, 2 * inter] -> act [tokens, inter]: f SiLU,
 * or GELU (tanh) where gelu is set */
void pd_gate_mul(const float *gu, int tokens, int inter, int gelu, float *act);

/* out [tokens, hidden] = the MoE MLP of h [tokens, hidden]; 0, or < 0 (no memory, a bad shape) */
int pd_moe_mlp(const pd_moe *e, const float *h, int tokens, int hidden, float *out, int threads);
