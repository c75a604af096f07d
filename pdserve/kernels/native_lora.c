/* LoRA deltas inside the compiled decode step (native_decode.c): y[t] += (x[t] A_s^T) B_s^T for
 * each row t whose adapter slot s = row_slots[t] is >= 0 (-1: the base model's row).
 *
 * Rows are taken in slot order, so the rows under one adapter read its A and B once between
 * them: row by row, a step of 32 rows read every adapter matrix 32 times from L2/L3, which cost
 * the step more than the products themselves. Per row the sums run as before (the product over
 * the input first, then one add per output, as torch's addmm does): h[j] in input order, each
 * delta[o] in rank order, then y += delta.
 */
#include <stdlib.h>
#include <string.h>

#include "native_decode.h"

enum { IN_BLOCK = 128, OUT_TILE = 64 };

/* The rows with an adapter, sorted by slot (stable: within a slot, in row order); returns how many. */
static int rows_by_slot(const int32_t *row_slots, int tokens, int *rows) {
    int n = 0;
    for (int t = 0; t < tokens; t++)
        if (row_slots[t] >= 0) rows[n++] = t;
    for (int k = 1; k < n; k++) { /* insertion sort: a step has at most 64 rows */
        int t = rows[k], j = k;
        for (; j > 0 && row_slots[rows[j - 1]] > row_slots[t]; j--) rows[j] = rows[j - 1];
        rows[j] = t;
    }
    return n;
}

/* h[k] = x[rows[k]] A_s^T for rows k in [k0, k1), a block of inputs at a time so that the block
 * of A stays in L1 across the rows of one slot */
static void shrink(const pd_lora *L, const float *x, int cols, const int *rows, const int32_t *row_slots,
                   int k0, int k1, float *h) {
    const int w = L->width;
    memset(h + (long)k0 * w, 0, sizeof(float) * (size_t)(k1 - k0) * w);
    for (int i0 = 0; i0 < cols; i0 += IN_BLOCK) {
        const int i1 = i0 + IN_BLOCK < cols ? i0 + IN_BLOCK : cols;
        for (int k = k0; k < k1; k++) {
            const int t = rows[k];
            const float *xr = x + (long)t * cols, *a = L->a + (long)row_slots[t] * w;
            float *hk = h + (long)k * w;
            for (int i = i0; i < i1; i++) {
                const float xi = xr[i], *ai = a + (long)i * L->ld;
                for (int j = 0; j < w; j++) hk[j] += xi * ai[j];
            }
        }
    }
}

/* y[rows[k]][o0:o1] += h[k] B_s^T over one tile of outputs, for every row: the tile of B stays in
 * L1 across the rows of one slot */
static void expand_tile(const pd_lora *L, const float *h, const int *rows, const int32_t *row_slots, int n,
                        int o0, int o1, float *y) {
    const int w = L->width, out = L->out;
    float delta[OUT_TILE];
    for (int k = 0; k < n; k++) {
        const int t = rows[k];
        const float *hk = h + (long)k * w, *b = L->b + (long)row_slots[t] * w * out;
        memset(delta, 0, sizeof delta);
        for (int j = 0; j < w; j++) {
            const float hj = hk[j], *bj = b + (long)j * out;
            if (hj == 0.0f) continue; /* past the adapter's rank, or a part it leaves alone */
            for (int o = o0; o < o1; o++) delta[o - o0] += hj * bj[o];
        }
        float *yr = y + (long)t * out;
        for (int o = o0; o < o1; o++) yr[o] += delta[o - o0];
    }
}

int pd_lora_add(const pd_lora *L, const float *x, int tokens, int cols, const int32_t *row_slots, float *y,
                int threads) {
    if (L->a == NULL || row_slots == NULL) return 0;
    int *rows = malloc(sizeof(int) * (size_t)tokens);
    float *h = malloc(sizeof(float) * (size_t)tokens * L->width);
    if (!rows || !h) {
        free(rows);
        free(h);
        return -2;
    }
    const int n = rows_by_slot(row_slots, tokens, rows);
    const int tiles = (L->out + OUT_TILE - 1) / OUT_TILE;
#pragma omp parallel num_threads(threads) if (n > 1)
    {
        /* each thread its contiguous share of the sorted rows, then the output tiles in turn */
#pragma omp for schedule(static)
        for (int part = 0; part < threads; part++)
            shrink(L, x, cols, rows, row_slots, (int)((long)n * part / threads), (int)((long)n * (part + 1) / threads),
                   h);
#pragma omp for schedule(static)
        for (int tile = 0; tile < tiles; tile++) {
            const int o0 = tile * OUT_TILE, o1 = o0 + OUT_TILE < L->out ? o0 + OUT_TILE : L->out;
            expand_tile(L, h, rows, row_slots, n, o0, o1, y);
        }
    }
    free(rows);
    free(h);
    return 0;
}
