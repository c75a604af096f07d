/* The 512-bit vector intrinsics every kernel here is written in. With AVX-512 (F and BW) they are
 * the compiler's own. Without it, on AVX2 with FMA and F16C (AMD before Zen 4, Intel's desktop
 * parts), each one the kernels use is defined below on a pair of 256-bit registers, so the same
 * sources compile to AVX2 code instead of leaving those CPUs to numba. The bf16, AMX and VNNI
 * kernels stay behind their own feature macros, which are not defined there.
 *
 * Why not SIMDe (libsimde-dev), which does this for every intrinsic: its 512-bit types are unions
 * of arrays that GCC keeps in memory, and its build ran SmolLM2's decode products 1.5 to 5 times
 * slower than numba's kernel (benchmarks/kernels/bench_native_gemv.py); a struct of two __m256
 * stays in registers. */
#ifndef PD_SIMD_H
#define PD_SIMD_H
#include <immintrin.h>
#include <stdint.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PD_AVX512 1
/* an optimisation barrier on a vector: the compiler may not fuse arithmetic across it */
#define PD_OPAQUE(v) __asm__("" : "+v"(v))
#else
#define PD_AVX512 0
#define PD_INLINE static inline __attribute__((always_inline))
typedef struct { __m256 lo, hi; } pd_m512;
typedef struct { __m256i lo, hi; } pd_m512i;
#define __m512 pd_m512
#define __m512i pd_m512i
#define PD_OPAQUE(v) __asm__("" : "+x"((v).lo), "+x"((v).hi))

#define PD_F2(op, a, b) ((pd_m512){op((a).lo, (b).lo), op((a).hi, (b).hi)})
PD_INLINE pd_m512 _pd_setzero_ps(void) { return (pd_m512){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
PD_INLINE pd_m512 _pd_set1_ps(float v) { return (pd_m512){_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
PD_INLINE pd_m512 _pd_loadu_ps(const void *p) {
    return (pd_m512){_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8)};
}
PD_INLINE void _pd_storeu_ps(void *p, pd_m512 a) {
    _mm256_storeu_ps((float *)p, a.lo);
    _mm256_storeu_ps((float *)p + 8, a.hi);
}
PD_INLINE pd_m512 _pd_add_ps(pd_m512 a, pd_m512 b) { return PD_F2(_mm256_add_ps, a, b); }
PD_INLINE pd_m512 _pd_sub_ps(pd_m512 a, pd_m512 b) { return PD_F2(_mm256_sub_ps, a, b); }
PD_INLINE pd_m512 _pd_mul_ps(pd_m512 a, pd_m512 b) { return PD_F2(_mm256_mul_ps, a, b); }
PD_INLINE pd_m512 _pd_div_ps(pd_m512 a, pd_m512 b) { return PD_F2(_mm256_div_ps, a, b); }
PD_INLINE pd_m512 _pd_max_ps(pd_m512 a, pd_m512 b) { return PD_F2(_mm256_max_ps, a, b); }
PD_INLINE pd_m512 _pd_min_ps(pd_m512 a, pd_m512 b) { return PD_F2(_mm256_min_ps, a, b); }
PD_INLINE pd_m512 _pd_fmadd_ps(pd_m512 a, pd_m512 b, pd_m512 c) {
    return (pd_m512){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
PD_INLINE pd_m512 _pd_fnmadd_ps(pd_m512 a, pd_m512 b, pd_m512 c) {
    return (pd_m512){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
PD_INLINE pd_m512 _pd_abs_ps(pd_m512 a) {
    __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return (pd_m512){_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
PD_INLINE float _pd_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
PD_INLINE float _pd_reduce_add_ps(pd_m512 a) { return _pd_hsum8(_mm256_add_ps(a.lo, a.hi)); }
PD_INLINE float _pd_reduce_max_ps(pd_m512 a) {
    __m256 m = _mm256_max_ps(a.lo, a.hi);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
/* a * 2^n for integral n, as vscalefps gives it: two factors 2^h and 2^(n - h), each a normal
 * float, so that n down to -252 (exp16's range reaches -150) scales exactly as one would */
PD_INLINE __m256 _pd_scalef8(__m256 a, __m256 n) {
    __m256i k = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(k, 1), bias = _mm256_set1_epi32(127);
    __m256 f0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
    __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(k, h), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(a, f0), f1);
}
PD_INLINE pd_m512 _pd_scalef_ps(pd_m512 a, pd_m512 n) { return (pd_m512){_pd_scalef8(a.lo, n.lo), _pd_scalef8(a.hi, n.hi)}; }
/* table[idx & 15] in each lane: two 8-entry lookups, the right one chosen by bit 3 */
PD_INLINE __m256 _pd_lookup16(__m256i idx, pd_m512 table) {
    __m256 lo = _mm256_permutevar8x32_ps(table.lo, idx), hi = _mm256_permutevar8x32_ps(table.hi, idx);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
PD_INLINE pd_m512 _pd_permutexvar_ps(pd_m512i idx, pd_m512 table) {
    return (pd_m512){_pd_lookup16(idx.lo, table), _pd_lookup16(idx.hi, table)};
}
/* __mmask16's bits as two 8-lane masks of all-ones words */
PD_INLINE __m256 _pd_mask8(unsigned bits) {
    __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), lane), lane));
}
PD_INLINE pd_m512 _pd_maskz_mov_ps(__mmask16 k, pd_m512 a) {
    return (pd_m512){_mm256_and_ps(a.lo, _pd_mask8(k & 255)), _mm256_and_ps(a.hi, _pd_mask8(k >> 8))};
}
PD_INLINE pd_m512 _pd_mask_max_ps(pd_m512 src, __mmask16 k, pd_m512 a, pd_m512 b) {
    pd_m512 m = _pd_max_ps(a, b);
    return (pd_m512){_mm256_blendv_ps(src.lo, m.lo, _pd_mask8(k & 255)), _mm256_blendv_ps(src.hi, m.hi, _pd_mask8(k >> 8))};
}
PD_INLINE pd_m512 _pd_unpacklo_ps(pd_m512 a, pd_m512 b) { return PD_F2(_mm256_unpacklo_ps, a, b); }
PD_INLINE pd_m512 _pd_unpackhi_ps(pd_m512 a, pd_m512 b) { return PD_F2(_mm256_unpackhi_ps, a, b); }

PD_INLINE pd_m512i _pd_set1_epi32(int v) { return (pd_m512i){_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
PD_INLINE pd_m512i _pd_and_si512(pd_m512i a, pd_m512i b) { return (pd_m512i){_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
PD_INLINE pd_m512i _pd_or_si512(pd_m512i a, pd_m512i b) { return (pd_m512i){_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
PD_INLINE pd_m512 _pd_castsi512_ps(pd_m512i a) { return (pd_m512){_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
PD_INLINE pd_m512i _pd_castps_si512(pd_m512 a) { return (pd_m512i){_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
PD_INLINE pd_m512 _pd_cvtepi32_ps(pd_m512i a) { return (pd_m512){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
PD_INLINE pd_m512i _pd_cvtepu8_epi32(__m128i a) {
    return (pd_m512i){_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))};
}
PD_INLINE pd_m512i _pd_cvtepi8_epi32(__m128i a) {
    return (pd_m512i){_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))};
}
PD_INLINE pd_m512i _pd_cvtepu16_epi32(__m256i a) {
    return (pd_m512i){_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}

#define _mm512_setzero_ps _pd_setzero_ps
#define _mm512_set1_ps _pd_set1_ps
#define _mm512_loadu_ps _pd_loadu_ps
#define _mm512_storeu_ps _pd_storeu_ps
#define _mm512_add_ps _pd_add_ps
#define _mm512_sub_ps _pd_sub_ps
#define _mm512_mul_ps _pd_mul_ps
#define _mm512_div_ps _pd_div_ps
#define _mm512_max_ps _pd_max_ps
#define _mm512_min_ps _pd_min_ps
#define _mm512_fmadd_ps _pd_fmadd_ps
#define _mm512_fnmadd_ps _pd_fnmadd_ps
#define _mm512_abs_ps _pd_abs_ps
#define _mm512_reduce_add_ps _pd_reduce_add_ps
#define _mm512_reduce_max_ps _pd_reduce_max_ps
#define _mm512_scalef_ps _pd_scalef_ps
#define _mm512_permutexvar_ps _pd_permutexvar_ps
#define _mm512_maskz_mov_ps _pd_maskz_mov_ps
#define _mm512_mask_max_ps _pd_mask_max_ps
#define _mm512_unpacklo_ps _pd_unpacklo_ps
#define _mm512_unpackhi_ps _pd_unpackhi_ps
#define _mm512_set1_epi32 _pd_set1_epi32
#define _mm512_and_si512 _pd_and_si512
#define _mm512_or_si512 _pd_or_si512
#define _mm512_castsi512_ps _pd_castsi512_ps
#define _mm512_castps_si512 _pd_castps_si512
#define _mm512_cvtepi32_ps _pd_cvtepi32_ps
#define _mm512_cvtepu8_epi32 _pd_cvtepu8_epi32
#define _mm512_cvtepi8_epi32 _pd_cvtepi8_epi32
#define _mm512_cvtepu16_epi32 _pd_cvtepu16_epi32
/* the ones that take an immediate: macros, so it reaches the instruction as a constant */
/* roundscale to whole numbers only (scale 0, imm's upper bits): what exp16 asks; another scale fails to compile */
#define _mm512_roundscale_ps(a, imm)                                                                    \
    ({ _Static_assert(((imm) >> 4) == 0, "roundscale: only scale 0 is defined on AVX2");                \
       pd_m512 a_ = (a); (pd_m512){_mm256_round_ps(a_.lo, imm), _mm256_round_ps(a_.hi, imm)}; })
#define _mm512_slli_epi32(a, imm) \
    ({ pd_m512i a_ = (a); (pd_m512i){_mm256_slli_epi32(a_.lo, imm), _mm256_slli_epi32(a_.hi, imm)}; })
#define _mm512_srli_epi32(a, imm) \
    ({ pd_m512i a_ = (a); (pd_m512i){_mm256_srli_epi32(a_.lo, imm), _mm256_srli_epi32(a_.hi, imm)}; })
#define _mm512_shuffle_ps(a, b, imm) \
    ({ pd_m512 a_ = (a), b_ = (b); (pd_m512){_mm256_shuffle_ps(a_.lo, b_.lo, imm), _mm256_shuffle_ps(a_.hi, b_.hi, imm)}; })
/* 128-bit lanes: the result's lanes 0-1 from a, 2-3 from b, each chosen by two bits of imm;
 * vperm2f128's selector names a's (or b's) four lanes as 0-3 across its two registers */
#define PD_LANE_PAIR(imm) (((imm) & 3) | (((imm) >> 2 & 3) << 4))
#define _mm512_shuffle_f32x4(a, b, imm)                                        \
    ({ pd_m512 a_ = (a), b_ = (b);                                             \
       (pd_m512){_mm256_permute2f128_ps(a_.lo, a_.hi, PD_LANE_PAIR(imm)),      \
                 _mm256_permute2f128_ps(b_.lo, b_.hi, PD_LANE_PAIR((imm) >> 4))}; })
#endif

/* 16 bf16 values at p widened to float32 (exact: a bf16 is a float's upper 16 bits), in either build */
static inline __attribute__((always_inline)) __m512 pd_bf16x16(const void *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* o[0 : cols] = s[0 : cols] (bf16) widened to float32, exactly */
static inline void pd_widen_row(const uint16_t *s, long cols, float *o) {
    long c = 0;
    for (; c + 16 <= cols; c += 16) _mm512_storeu_ps(o + c, pd_bf16x16(s + c));
    for (; c < cols; c++) {
        uint32_t bits = (uint32_t)s[c] << 16;
        __builtin_memcpy(o + c, &bits, 4);
    }
}
/* Denormal floats flushed to zero (MXCSR's FTZ and DAZ) on the calling thread until
 * pd_denormals_restore: returns the register to restore. Each operation on a denormal takes a
 * microcode assist of about a hundred cycles, and the recurrent layers' decays (e^(d_i - d_j) over
 * a chunk, a state decayed token after token) put whole blocks of values there: a Qwen3.5-shaped
 * prefill's delta rule ran 4-10x slower on strongly decaying heads. What is flushed is below
 * 1.2e-38, far under float32's rounding of the sums it enters. */
static inline unsigned int pd_denormals_flush(void) {
    unsigned int old = _mm_getcsr();
    _mm_setcsr(old | 0x8040);
    return old;
}

static inline void pd_denormals_restore(unsigned int csr) { _mm_setcsr(csr); }
#endif
