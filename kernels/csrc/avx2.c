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

/* ---- One token, four rows at a time (AVX2), as avx512.c's rows4 kernels ----------------------------------------
 * Only bandwidth matters with one token: four rows streamed side by side (stream_rows gives each thread four long
 * runs), 16 values of each a step in two chains a row (eight independent FMA chains, the most that leave room in 16
 * registers for the inputs), each line asked for ROWS4_PREFETCH bytes ahead. */
#define LOAD8_FP32(p) _mm256_loadu_ps((const float *)(p))
#define LOAD8_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD8_FP16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD8_INT8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define AVX2_ROWS __attribute__((target("avx2,fma,f16c")))

#define FMA8_ROW(J) a##J = _mm256_fmadd_ps(LOAD8(w##J + k), _mm256_loadu_ps(x[J] + k), a##J);                 \
                    b##J = _mm256_fmadd_ps(LOAD8(w##J + k + 8), _mm256_loadu_ps(x[J] + k + 8), b##J)
#define DEFINE_ROWS4_AVX2(NAME, WT, CONV, SCALED)                                                           \
AVX2_ROWS static void NAME(const char *const *rows, const void *const *scales, int group,                   \
                           const float *const *x, int n, float *const *res) {                               \
    (void)group;                                                                                            \
    const WT *w0 = (const WT *)rows[0], *w1 = (const WT *)rows[1];                                           \
    const WT *w2 = (const WT *)rows[2], *w3 = (const WT *)rows[3];                                           \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;          \
    int k = 0;                                                                                              \
    for (; k + 16 <= n; k += 16) {                                                                          \
        if ((k * (int)sizeof(WT)) % 64 == 0)  /* each line once (16 values: a line every 1, 2 or 4 steps) */ \
            for (int o = 0; o < 16 * (int)sizeof(WT); o += 64) {                                            \
                const int e = o / (int)sizeof(WT);                                                          \
                PREFETCH_AHEAD(w0 + k + e); PREFETCH_AHEAD(w1 + k + e);                                     \
                PREFETCH_AHEAD(w2 + k + e); PREFETCH_AHEAD(w3 + k + e);                                     \
            }                                                                                               \
        FMA8_ROW(0); FMA8_ROW(1); FMA8_ROW(2); FMA8_ROW(3);                                                 \
    }                                                                                                       \
    const WT *ws[4] = {w0, w1, w2, w3};                                                                     \
    const __m256 rs[4] = {_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1), _mm256_add_ps(a2, b2), _mm256_add_ps(a3, b3)}; \
    for (int j = 0; j < 4; j++) {                                                                           \
        float s = hsum8(rs[j]);                                                                             \
        for (int kk = k; kk < n; kk++) s += CONV(ws[j][kk]) * x[j][kk];                                     \
        *res[j] = SCALED ? s * *(const float *)scales[j] : s;                                               \
    }                                                                                                       \
}
#define LOAD8 LOAD8_FP32
DEFINE_ROWS4_AVX2(rows4_fp32_avx2, float, IDENT, 0)
#undef LOAD8
#define LOAD8 LOAD8_BF16
DEFINE_ROWS4_AVX2(rows4_bf16_avx2, uint16_t, bf16f, 0)
#undef LOAD8
#define LOAD8 LOAD8_FP16
DEFINE_ROWS4_AVX2(rows4_fp16_avx2, _Float16, F16, 0)
#undef LOAD8
#define LOAD8 LOAD8_INT8
DEFINE_ROWS4_AVX2(rows4_int8_avx2, int8_t, I8, 1)
#undef LOAD8

/* int4, one token, four rows: per 8 bytes of a group, 16 weights unpacked (low nibbles values j, high j + group/2),
 * the group's scale folded in (w s - 8 s), FMA'd into a low and a high chain per row. */
#define INT4_ROW8(J)                                                                                        \
    do {                                                                                                    \
        const float sc = bf16f(s##J[g]);                                                                    \
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q##J + (size_t)g * half + j))); \
        const __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, low)), _mm256_set1_ps(sc), \
                                          _mm256_set1_ps(-8.f * sc));                                       \
        const __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), _mm256_set1_ps(sc), \
                                          _mm256_set1_ps(-8.f * sc));                                       \
        r##J = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x[J] + (size_t)g * group + j), r##J);                   \
        h##J = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x[J] + (size_t)g * group + j + half), h##J);            \
    } while (0)
AVX2_ROWS static void rows4_int4_avx2(const char *const *rows, const void *const *scales, int group,
                                      const float *const *x, int n, float *const *res) {
    const uint8_t *q0 = (const uint8_t *)rows[0], *q1 = (const uint8_t *)rows[1], *q2 = (const uint8_t *)rows[2];
    const uint8_t *q3 = (const uint8_t *)rows[3];
    const int ngroups = n / group, half = group / 2;
    const uint16_t *s0 = scales[0], *s1 = scales[1], *s2 = scales[2], *s3 = scales[3];
    const __m256i low = _mm256_set1_epi32(15);
    __m256 r0 = _mm256_setzero_ps(), r1 = r0, r2 = r0, r3 = r0, h0 = r0, h1 = r0, h2 = r0, h3 = r0;
    for (int g = 0; g < ngroups; g++) {
        for (int j = 0; j < half; j += 8) {
            const size_t o = (size_t)g * half + j;
            if (o % 64 == 0) {
                PREFETCH_AHEAD(q0 + o); PREFETCH_AHEAD(q1 + o); PREFETCH_AHEAD(q2 + o); PREFETCH_AHEAD(q3 + o);
            }
            INT4_ROW8(0); INT4_ROW8(1); INT4_ROW8(2); INT4_ROW8(3);
        }
    }
    *res[0] = hsum8(_mm256_add_ps(r0, h0));
    *res[1] = hsum8(_mm256_add_ps(r1, h1));
    *res[2] = hsum8(_mm256_add_ps(r2, h2));
    *res[3] = hsum8(_mm256_add_ps(r3, h3));
}

/* MXFP4, one token, four rows: as dot_mxfp4_avx2 (pshufb lookups of twice the E2M1 values), each row's block scale
 * applied once per block. */
AVX2_ROWS static void rows4_mxfp4_avx2(const char *const *rows, const void *const *scales, int group,
                                       const float *const *x, int n, float *const *res) {
    (void)group;
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i nibble = _mm_set1_epi8(0x0f);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int g = 0; g < n / 32; g++) {
        _Pragma("GCC unroll 4")
        for (int j = 0; j < 4; j++) {
            const uint8_t *w = (const uint8_t *)rows[j] + (size_t)g * 16;
            if (g % 4 == 0) PREFETCH_AHEAD(w);
            const __m128i q = _mm_loadu_si128((const __m128i *)w);
            const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(q, nibble));
            const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), nibble));
            const float *xs = x[j] + (size_t)g * 32;
            __m256 t = _mm256_mul_ps(widen8(lo), _mm256_loadu_ps(xs));
            t = _mm256_fmadd_ps(widen8(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(xs + 8), t);
            t = _mm256_fmadd_ps(widen8(hi), _mm256_loadu_ps(xs + 16), t);
            t = _mm256_fmadd_ps(widen8(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(xs + 24), t);
            acc[j] = _mm256_fmadd_ps(t, _mm256_set1_ps(e8m0_half(((const uint8_t *)scales[j])[g])), acc[j]);
        }
    }
    for (int j = 0; j < 4; j++) *res[j] = hsum8(acc[j]);
}

/* GGUF blocks in the float path (fp32 compute, and GGUF's MXFP4, which q8avx2.c does not take): per chunk of 256
 * values, each row's blocks unpacked into L1 (blocks.h), then FMA'd against its input in two chains. */
#define DEFINE_BLOCK_ROWS4_AVX2(NAME, V, B)                                                                 \
AVX2_ROWS static void rows4_##NAME##_avx2(const char *const *rows, const void *const *scales, int group,     \
                                          const float *const *x, int n, float *const *res) {                \
    (void)scales, (void)group;                                                                              \
    float buf[CHUNK];                                                                                       \
    __m256 a[4][2];                                                                                         \
    for (int j = 0; j < 4; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();                                    \
    for (int k0 = 0; k0 < n; k0 += CHUNK) {                                                                 \
        const int c = n - k0 < CHUNK ? n - k0 : CHUNK;                                                      \
        const size_t at = (size_t)k0 / (V) * (B), len = (size_t)c / (V) * (B);                              \
        for (int j = 0; j < 4; j++) {                                                                       \
            const uint8_t *w = (const uint8_t *)rows[j];                                                    \
            for (size_t o = (at + 63) / 64 * 64; o < at + len; o += 64) PREFETCH_AHEAD(w + o);              \
            UNPACK_CHUNK(unpack_##NAME, V, B, w, k0, c, buf);                                               \
            for (int k = 0; k < c; k += 16) {                                                               \
                a[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(buf + k), _mm256_loadu_ps(x[j] + k0 + k), a[j][0]); \
                a[j][1] = _mm256_fmadd_ps(_mm256_loadu_ps(buf + k + 8), _mm256_loadu_ps(x[j] + k0 + k + 8), \
                                          a[j][1]);                                                         \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    for (int j = 0; j < 4; j++) *res[j] = hsum8(_mm256_add_ps(a[j][0], a[j][1]));                          \
}
DEFINE_BLOCK_ROWS4_AVX2(q8_0, 32, 34)
DEFINE_BLOCK_ROWS4_AVX2(q4_0, 32, 18)
DEFINE_BLOCK_ROWS4_AVX2(q4_1, 32, 20)
DEFINE_BLOCK_ROWS4_AVX2(q5_0, 32, 22)
DEFINE_BLOCK_ROWS4_AVX2(q5_1, 32, 24)
DEFINE_BLOCK_ROWS4_AVX2(q4_k, 256, 144)
DEFINE_BLOCK_ROWS4_AVX2(q5_k, 256, 176)
DEFINE_BLOCK_ROWS4_AVX2(q6_k, 256, 210)
DEFINE_BLOCK_ROWS4_AVX2(gmxfp4, 32, 17)

rows4_fn rows4_avx2(int kind) {
    static const rows4_fn four[KINDS] = {
        rows4_fp32_avx2, rows4_bf16_avx2, rows4_fp16_avx2, rows4_int8_avx2, rows4_int4_avx2, rows4_mxfp4_avx2,
        rows4_q8_0_avx2, rows4_q4_0_avx2, rows4_q4_1_avx2, rows4_q5_0_avx2, rows4_q5_1_avx2, rows4_q4_k_avx2,
        rows4_q5_k_avx2, rows4_q6_k_avx2, rows4_gmxfp4_avx2};
    return kind >= 0 && kind < KINDS ? four[kind] : NULL;
}

/* g[i] = silu(g[i]) * g[I + i] for i in [lo, hi), 8 lanes at a time: exp as exp512 computes it (2^n 2^f, a degree-7
 * series for 2^f), so the AVX2 variant's activations are those of the AVX-512 one. */
AVX2_ROWS static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
    const __m256 nf = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, nf), _mm256_set1_ps(0.69314718f));
    __m256 p = _mm256_set1_ps(1.f / 5040);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 720));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nf), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));  /* 2^n for n in [-126, 127] (x clamped above) */
}

AVX2_ROWS void swiglu256(float *g, int I, int lo, int hi) {
    int i = lo;
    for (; i + 8 <= hi; i += 8) {
        const __m256 v = _mm256_loadu_ps(g + i);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), v));
        const __m256 s = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(s, _mm256_loadu_ps(g + I + i)));
    }
    for (; i < hi; i++) g[i] = silu(g[i]) * g[I + i];
}

/* g[i] = gelu_tanh(g[i]) * g[I + i], as geglu512 (avx512.c) computes it, 8 lanes at a time. */
AVX2_ROWS void geglu256(float *g, int I, int lo, int hi) {
    int i = lo;
    for (; i + 8 <= hi; i += 8) {
        const __m256 v = _mm256_loadu_ps(g + i);
        const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(v, v), v), _mm256_set1_ps(0.044715f), v);
        const __m256 e = exp256(_mm256_mul_ps(inner, _mm256_set1_ps(-GELU_2C)));
        const __m256 s = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(s, _mm256_loadu_ps(g + I + i)));
    }
    for (; i < hi; i++) g[i] = gelu_tanh(g[i]) * g[I + i];
}

/* ---- Several tokens (AVX2): 8 weights converted once, FMA'd into up to 8 token accumulators ---------------------
 * (avx512.c's DEFINE_FMA_TOKENS in 256-bit vectors). Each row is read once for all the tokens of a call, from L1
 * after the first: beams and a prompt's tokens reuse it. One token keeps four chains (not bound by FMA latency). */
#define FMA8_STEP(J) a##J = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (size_t)(J) * ldx + k), a##J)
#define DEFINE_FMA8_TOKENS(NAME, WT, LOAD, CONV)                                                           \
AVX2_ROWS static inline __attribute__((always_inline)) void NAME##_m(const WT *w, float scale,             \
        const float *x, int ldx, int m, int n, float *res, int ldr) {                                      \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;        \
    int k = 0;                                                                                             \
    if (m == 1) {                                                                                          \
        for (; k + 32 <= n; k += 32) {                                                                     \
            a0 = _mm256_fmadd_ps(LOAD(w + k), _mm256_loadu_ps(x + k), a0);                                \
            a1 = _mm256_fmadd_ps(LOAD(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);                         \
            a2 = _mm256_fmadd_ps(LOAD(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);                       \
            a3 = _mm256_fmadd_ps(LOAD(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);                       \
        }                                                                                                  \
        a0 = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));                                  \
    } else if (m <= 4) {  /* two chains a token (a4..a7 the second): FMA latency, not throughput, bounds one */ \
        for (; k + 16 <= n; k += 16) {                                                                     \
            const __m256 wv = LOAD(w + k), wh = LOAD(w + k + 8);                                           \
            FMA8_STEP(0);                                                                                  \
            a4 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x + k + 8), a4);                                      \
            if (m > 1) { FMA8_STEP(1); a5 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x + (size_t)ldx + k + 8), a5); } \
            if (m > 2) { FMA8_STEP(2); a6 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x + 2 * (size_t)ldx + k + 8), a6); } \
            if (m > 3) { FMA8_STEP(3); a7 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x + 3 * (size_t)ldx + k + 8), a7); } \
        }                                                                                                  \
        a0 = _mm256_add_ps(a0, a4), a1 = _mm256_add_ps(a1, a5), a2 = _mm256_add_ps(a2, a6);                 \
        a3 = _mm256_add_ps(a3, a7);                                                                        \
    }                                                                                                      \
    for (; k + 8 <= n; k += 8) {                                                                           \
        const __m256 wv = LOAD(w + k);                                                                     \
        FMA8_STEP(0);                                                                                      \
        if (m > 1) FMA8_STEP(1);                                                                           \
        if (m > 2) FMA8_STEP(2);                                                                           \
        if (m > 3) FMA8_STEP(3);                                                                           \
        if (m > 4) FMA8_STEP(4);                                                                           \
        if (m > 5) FMA8_STEP(5);                                                                           \
        if (m > 6) FMA8_STEP(6);                                                                           \
        if (m > 7) FMA8_STEP(7);                                                                           \
    }                                                                                                      \
    const __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};                                                \
    for (int j = 0; j < m; j++) {                                                                          \
        float sum = hsum8(acc[j]);                                                                         \
        for (int kk = k; kk < n; kk++) sum += CONV(w[kk]) * x[(size_t)j * ldx + kk];                       \
        res[(size_t)j * ldr] = sum * scale;                                                                \
    }                                                                                                      \
}                                                                                                          \
AVX2_ROWS void NAME(const void *wrow, float scale, const void *gscale, int group, const float *x, int ldx,  \
                    int nt, int n, float *res, int ldr) {                                                  \
    (void)gscale; (void)group;                                                                             \
    const WT *w = (const WT *)wrow;                                                                        \
    for (int t = 0; t < nt; t += 8) {                                                                      \
        const int m = nt - t < 8 ? nt - t : 8;                                                             \
        const float *xs = x + (size_t)t * ldx;                                                             \
        float *r = res + (size_t)t * ldr;                                                                  \
        switch (m) {  /* a constant count per case: the accumulators stay in registers */                \
            case 1: NAME##_m(w, scale, xs, ldx, 1, n, r, ldr); break;                                      \
            case 2: NAME##_m(w, scale, xs, ldx, 2, n, r, ldr); break;                                      \
            case 3: NAME##_m(w, scale, xs, ldx, 3, n, r, ldr); break;                                      \
            case 4: NAME##_m(w, scale, xs, ldx, 4, n, r, ldr); break;                                      \
            case 5: NAME##_m(w, scale, xs, ldx, 5, n, r, ldr); break;                                      \
            case 6: NAME##_m(w, scale, xs, ldx, 6, n, r, ldr); break;                                      \
            case 7: NAME##_m(w, scale, xs, ldx, 7, n, r, ldr); break;                                      \
            default: NAME##_m(w, scale, xs, ldx, 8, n, r, ldr); break;                                     \
        }                                                                                                  \
    }                                                                                                      \
}
DEFINE_FMA8_TOKENS(fma8_fp32, float, LOAD8_FP32, IDENT)
DEFINE_FMA8_TOKENS(fma8_bf16, uint16_t, LOAD8_BF16, bf16f)
DEFINE_FMA8_TOKENS(fma8_fp16, _Float16, LOAD8_FP16, F16)
DEFINE_FMA8_TOKENS(fma8_int8, int8_t, LOAD8_INT8, I8)
