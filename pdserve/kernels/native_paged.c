/* Paged decode attention on its own (native_paged.py): the compiled step's attention
 * (native_attend.c's pd_attend) for the decode rows of a step the Python layers run, a mixed
 * step's or one the compiled step does not take. Over a bf16 cache it reads the blocks as they
 * are; the Python path gathered and widened every block a row reads, each layer. */
#include <string.h>

#include "native_decode.h"

/* q: row b's heads at q + b * q_stride (floats); caches: one layer's K and V planes at strides
 * s_block, s_slot, s_head (elements), float32 or bf16 (kv_bf16); window > 0: the last `window`
 * keys; sinks [heads] or NULL; out [tokens, heads * head_dim]. 0, or < 0 on failure. */
int pd_paged_attention(const float *q, long q_stride, int tokens, int heads, int kv_heads, int head_dim,
                       int block_size, int64_t s_block, int64_t s_slot, int64_t s_head, float scale,
                       const void *k_cache, const void *v_cache, int kv_bf16, int64_t window, const float *sinks,
                       const int32_t *tables, int max_blocks, const int32_t *lens, float *out, int threads) {
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || head_dim <= 0 || block_size <= 0) return -1;
    pd_model m;
    pd_layer L;
    memset(&m, 0, sizeof m);
    memset(&L, 0, sizeof L);
    m.heads = heads, m.kv_heads = kv_heads, m.head_dim = head_dim, m.block_size = block_size;
    m.scale = scale, m.s_block = s_block, m.s_slot = s_slot, m.s_head = s_head, m.kv_bf16 = kv_bf16;
    L.k_cache = (float *)k_cache, L.v_cache = (float *)v_cache, L.window = window, L.sinks = sinks;
    return pd_attend(&m, &L, q, q_stride, tokens, tables, max_blocks, lens, out, threads);
}
