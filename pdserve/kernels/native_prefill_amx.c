/* native_prefill.c's causal attention of fresh prompts with its two products on AMX bf16 tiles,
 * for steps whose products are bf16 tiles already (native_prefill.py picks it): queries and
 * probabilities rounded to bf16, keys and values as they are (a bf16 KV cache's rows, exact).
 * pd_prefill_attention_amx_paged also takes prompts after a cached prefix, whose keys and values
 * it reads from a bf16 paged cache's blocks (the prefix's queries are not in the step).
 *
 * Why: in float32 FMAs the prefill attention was 13% of a 2,048-token prefill step of SmolLM2 on
 * the 2-core AMX Xeon (160-token prompts: ~170 GFLOP/s). One TDPBF16PS multiplies 16 x 32 by
 * 32 x 16 in about 16 cycles.
 *
 * Work items as native_prefill.c's: (sequence, KV head, block of QB queries), the group's query
 * heads times the block's queries as rows; they, the packing and the softmax are shared with the
 * AVX-512 BF16 kernel (native_prefill_bf16.h). Per item:
 *   kb = the keys up to the block's last query as B tiles (16 keys by 16 pairs of dimensions),
 *   S = Q K^T in C tiles, 16 rows x 32 keys at a time, then * scale,
 *   each row's softmax over the keys its query sees, divided by its sum, then rounded to bf16,
 *   vb = the values as B tiles (16 pairs of keys by 16 dimensions),
 *   O = P V in four C tiles (64 dimensions) a pass, stored straight into out where the tile's
 *   rows are one head's consecutive queries.
 * Sums in the tile unit's order; the inputs' rounding makes this bf16 attention, not float32's.
 */
#include "native_amx.h"

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "native_prefill_bf16.h" /* the work items, the packing, the softmax, the parallel region */

/* s[r][0 : ld] = Q_r . K^T for the 16-row tile at qb (row stride D words); kb's pair chunks are
 * `chunks` tiles apart */
static void score_tiles(const uint16_t *qb, int D, const uint32_t *kb, int chunks, int ld, float *s) {
    for (int kc = 0; kc < ld / 16; kc += 2) {
        _tile_zero(0);
        _tile_zero(1);
        for (int pc = 0; pc < D / 32; pc++) {
            _tile_loadd(4, qb + 32 * pc, D * 2);
            _tile_loadd(6, kb + ((long)pc * chunks + kc) * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, kb + ((long)pc * chunks + kc + 1) * 256, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        _tile_stored(0, s + 16 * kc, ld * 4);
        _tile_stored(1, s + 16 * kc + 16, ld * 4);
    }
}

/* the 16-row tile's outputs P V over keys [0, seen) into os[r] (NULL: a padding row); straight from
 * the tiles where the rows are one head's consecutive queries (os[r] = os[0] + r * ld_out) */
static void output_tiles(const uint16_t *pb, int ld, const uint32_t *vb, int D, int seen, float *const *os,
                         long ld_out) {
    float o[16][64] __attribute__((aligned(64)));
    int direct = 1;
    for (int r = 0; r < 16; r++) direct &= os[r] != NULL && os[r] == os[0] + r * ld_out;
    const int dcs = D / 16, kps = (seen + 31) / 32;
    for (int d0 = 0; d0 < dcs; d0 += 4) { /* 64 dimensions a pass (D is a multiple of 64) */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int kp = 0; kp < kps; kp++) {
            _tile_loadd(4, pb + 32 * kp, ld * 2);
            const uint32_t *b = vb + ((long)kp * dcs + d0) * 256;
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b + 256, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(6, b + 512, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, b + 768, 64);
            _tile_dpbf16ps(3, 4, 7);
        }
        float *to = direct ? os[0] + 16 * d0 : &o[0][0];
        long stride = direct ? ld_out * 4 : 256;
        _tile_stored(0, to, stride);
        _tile_stored(1, to + 16, stride);
        _tile_stored(2, to + 32, stride);
        _tile_stored(3, to + 48, stride);
        if (direct) continue;
        for (int r = 0; r < 16; r++)
            if (os[r]) memcpy(os[r] + 16 * d0, o[r], sizeof o[r]);
    }
}

/* One work item: rows r = g * nq + i (query head g of the group, query q0 + i) */
static void attend_item(const bf16_args *a, const bf16_item *w, const uint32_t *packed, bf16_buffers *buf) {
    const int keys = w->prefix + w->q1, ld = (keys + KEYS_STEP - 1) / KEYS_STEP * KEYS_STEP;
    const int rows = a->group * (w->q1 - w->q0), padded = (rows + 15) / 16 * 16, D = a->D;
    round_queries(a, w, rows, padded, buf->qb);
    for (int r0 = 0; r0 < padded; r0 += 16) score_tiles(buf->qb + (long)r0 * D, D, packed + w->kb, w->chunks, ld, buf->s + (long)r0 * ld);
    softmax_rows(a, w, rows, padded, ld, buf);
    for (int r0 = 0; r0 < padded; r0 += 16) {
        float *os[16];
        int seen = output_rows(a, w, rows, r0, 16, os);
        output_tiles(buf->pb + (long)r0 * ld, ld, packed + w->vb, D, seen, os, (long)a->heads * D);
    }
}

static void release_tiles(void) { _tile_release(); }

/* pd_prefill_attention's contract (native_prefill.c) on AMX tiles; -1 also where the process has
 * no AMX permission or the shape is not one it takes */
int pd_prefill_attention_amx(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                             long v_stride, const int32_t *starts, const int32_t *lens, int seqs, int heads,
                             int kv_heads, int D, float scale, float *out, int threads) {
    pd_amx_request();
    if (!pd_amx_granted() || D % 64 || heads % kv_heads || seqs <= 0) return -1;
    bf16_args a = {q, k, v, out, q_stride, k_stride, v_stride, heads, kv_heads, heads / kv_heads, D, scale,
                  NULL, NULL, NULL, NULL, 1, 0, 0};
    return attend_all(&a, starts, lens, seqs, threads, attend_item, load_full_tiles, release_tiles);
}

/* The same where sequence i's first prefix[i] keys and values are in a bf16 paged cache
 * [blocks][block_size][kv_heads][D] (blocks block_stride words apart; its block table
 * tables[i * max_blocks ...]) and its lens[i] new rows, from starts[i], follow them: query j of
 * the sequence sees keys up to prefix[i] + j. */
int pd_prefill_attention_amx_paged(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                                   long v_stride, const int32_t *starts, const int32_t *lens, const int32_t *prefix,
                                   int seqs, int heads, int kv_heads, int D, float scale, const uint16_t *k_cache,
                                   const uint16_t *v_cache, int block_size, long block_stride, const int32_t *tables,
                                   int max_blocks, float *out, int threads) {
    pd_amx_request();
    if (!pd_amx_granted() || D % 64 || heads % kv_heads || seqs <= 0 || block_size <= 0) return -1;
    bf16_args a = {q, k, v, out, q_stride, k_stride, v_stride, heads, kv_heads, heads / kv_heads, D, scale,
                  k_cache, v_cache, tables, prefix, block_size, max_blocks, block_stride};
    return attend_all(&a, starts, lens, seqs, threads, attend_item, load_full_tiles, release_tiles);
}
#else
int pd_prefill_attention_amx(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                             long v_stride, const int32_t *starts, const int32_t *lens, int seqs, int heads,
                             int kv_heads, int D, float scale, float *out, int threads) {
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)starts, (void)lens, (void)seqs;
    (void)heads, (void)kv_heads, (void)D, (void)scale, (void)out, (void)threads;
    return -1;
}

int pd_prefill_attention_amx_paged(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                                   long v_stride, const int32_t *starts, const int32_t *lens, const int32_t *prefix,
                                   int seqs, int heads, int kv_heads, int D, float scale, const uint16_t *k_cache,
                                   const uint16_t *v_cache, int block_size, long block_stride, const int32_t *tables,
                                   int max_blocks, float *out, int threads) {
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)starts, (void)lens, (void)prefix;
    (void)seqs, (void)heads, (void)kv_heads, (void)D, (void)scale, (void)k_cache, (void)v_cache, (void)block_size;
    (void)block_stride, (void)tables, (void)max_blocks, (void)out, (void)threads;
    return -1;
}
#endif
