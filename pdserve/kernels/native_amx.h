/* What the two AMX kernels share (native_gemv_amx.c: bf16 tiles; native_gemv_int8_amx.c: int8
 * tiles): the process's permission for the tile state, and loading a tile configuration. */
#pragma once
#include <stdint.h>
#include <string.h>

/* asks the kernel for the AMX tile state once a process (Linux gives it only on request) */
void pd_amx_request(void);
/* whether that request was granted (0 in a build without AMX) */
int pd_amx_granted(void);

#ifdef __AMX_TILE__
#include <immintrin.h>

/* ldtilecfg's 64-byte operand: palette 1, each tile's rows and bytes a row (unused tiles zero) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* A zeroed palette-1 configuration for the caller to fill */
static inline tile_config tile_config_palette1(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    return config;
}

/* GCC 12's ldtilecfg builtin declares no read of its operand, so the stores that filled it could be
 * dropped (the int8 kernel's were: SIGSEGV on an all-zero configuration); the barrier keeps them */
static inline void load_tile_config(const tile_config *config) {
    __asm__ volatile("" : : "r"(config) : "memory");
    _tile_loadconfig(config);
}

/* tiles 0-7 each 16 rows of 64 bytes (16 x 16 float32 or 16 x 32 bf16): the bf16 kernels' layout */
static inline void load_full_tiles(void) {
    tile_config config = tile_config_palette1();
    for (int i = 0; i < 8; i++) {
        config.rows[i] = 16;
        config.colsb[i] = 64;
    }
    load_tile_config(&config);
}
#endif
