/* The AVX2 variant (ISA_AVX2): the plain C loops of base.c (DEFINE_DOTS, DEFINE_SUM in common.h; the block kinds'
 * DEFINE_BLOCK_DOTS in blocks.h) compiled for AVX2+FMA+F16C, and MXFP4 with intrinsics; expert_generic and linear_rows (base.c) run them. */
#include "common.h"
#include "blocks.h"

DEFINE_DOTS(avx2, __attribute__((target("avx2,fma,f16c"))))
DEFINE_BLOCK_DOTS(avx2, __attribute__((target("avx2,fma,f16c"))))
DEFINE_SUM(sum_avx2, __attribute__((target("avx2,fma"))))

/* MXFP4: per block, the 16 low and the 16 high nibbles are looked up with pshufb in a table of twice the E2M1 values
 * (small integers), widened to float 8 at a time and FMA'd into up to 4 token accumulators, which take the block's
 * scale once per block. About 10x the plain C loop (which gathers from the table value by value). */
#define AVX2_TARGET __attribute__((target("avx2,fma")))
AVX2_TARGET static inline __m256 widen8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
AVX2_TARGET static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

AVX2_TARGET void dot_mxfp4_avx2(const void *wrow, float scale, const void *gscale, int group, const float *x, int ldx,
                                int nt, int n, float *res, int ldr) {
    (void)scale, (void)group;
    const uint8_t *w = (const uint8_t *)wrow, *e = (const uint8_t *)gscale;
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i nibble = _mm_set1_epi8(0x0f);
    for (int t0 = 0; t0 < nt; t0 += 4) {
        const int m = nt - t0 < 4 ? nt - t0 : 4;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int g = 0; g < n / 32; g++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(w + (size_t)g * 16));
            const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(q, nibble));  /* values 0-15 */
            const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), nibble));  /* 16-31 */
            const __m256 v0 = widen8(lo), v1 = widen8(_mm_srli_si128(lo, 8));
            const __m256 v2 = widen8(hi), v3 = widen8(_mm_srli_si128(hi, 8));
            const __m256 s = _mm256_set1_ps(e8m0_half(e[g]));
            for (int j = 0; j < m; j++) {
                const float *xs = x + (size_t)(t0 + j) * ldx + (size_t)g * 32;
                __m256 t = _mm256_mul_ps(v0, _mm256_loadu_ps(xs));
                t = _mm256_fmadd_ps(v1, _mm256_loadu_ps(xs + 8), t);
                t = _mm256_fmadd_ps(v2, _mm256_loadu_ps(xs + 16), t);
                t = _mm256_fmadd_ps(v3, _mm256_loadu_ps(xs + 24), t);
                acc[j] = _mm256_fmadd_ps(t, s, acc[j]);
            }
        }
        for (int j = 0; j < m; j++) res[(size_t)(t0 + j) * ldr] = hsum8(acc[j]);
    }
}
