/* The AVX-512 variant (ISA_AVX512): weight rows converted 16 values at a time and FMA'd into up to 8 token
 * accumulators (the dot products expert_generic runs), the SwiGLU activation 16 lanes at a time, and one token
 * as four long runs per thread (stream_rows), for the experts of every weight kind and for dense matrices (bf16,
 * GGUF blocks); the block kinds' dot products (blocks.h) compiled for AVX-512.
 * One token takes these rows on AMX machines too (bf16, fp16, fp32 weights). */
#include "common.h"
#include "blocks.h"

/* ---- AVX-512: convert 16 weights once, FMA them into up to 8 token accumulators -------------------- */
#define FMA_STEP(J) a##J = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + (size_t)(J) * ldx + k), a##J)

#define DEFINE_FMA_TOKENS(NAME, WT, LOAD, CONV)                                                           \
AVX512_TARGET static inline __attribute__((always_inline)) void NAME##_m(const WT *w, float scale,         \
        const float *x, int ldx, int m, int n, float *res, int ldr) {                                      \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;        \
    int k = 0;                                                                                             \
    if (m == 1) {                                                                                          \
        for (; k + 64 <= n; k += 64) {                                                                     \
            a0 = _mm512_fmadd_ps(LOAD(w + k), _mm512_loadu_ps(x + k), a0);                                \
            a1 = _mm512_fmadd_ps(LOAD(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);                       \
            a2 = _mm512_fmadd_ps(LOAD(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);                       \
            a3 = _mm512_fmadd_ps(LOAD(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);                       \
        }                                                                                                  \
        a0 = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));                                  \
    }                                                                                                      \
    for (; k + 16 <= n; k += 16) {                                                                         \
        __m512 wv = LOAD(w + k);                                                                           \
        FMA_STEP(0);                                                                                       \
        if (m > 1) FMA_STEP(1);                                                                            \
        if (m > 2) FMA_STEP(2);                                                                            \
        if (m > 3) FMA_STEP(3);                                                                            \
        if (m > 4) FMA_STEP(4);                                                                            \
        if (m > 5) FMA_STEP(5);                                                                            \
        if (m > 6) FMA_STEP(6);                                                                            \
        if (m > 7) FMA_STEP(7);                                                                            \
    }                                                                                                      \
    __m512 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};                                                      \
    for (int j = 0; j < m; j++) {                                                                          \
        float sum = _mm512_reduce_add_ps(acc[j]);                                                          \
        for (int kk = k; kk < n; kk++) sum += CONV(w[kk]) * x[(size_t)j * ldx + kk];                       \
        res[(size_t)j * ldr] = sum * scale;                                                                \
    }                                                                                                      \
}                                                                                                          \
AVX512_TARGET void NAME(const void *wrow, float scale, const void *gscale, int group,                          \
        const float *x, int ldx, int nt, int n, float *res, int ldr) {                                     \
    (void)gscale; (void)group;                                                                             \
    const WT *w = (const WT *)wrow;                                                                        \
    for (int t = 0; t < nt; t += 8) {                                                                      \
        const int m = nt - t < 8 ? nt - t : 8;                                                             \
        const float *xs = x + (size_t)t * ldx;                                                             \
        float *r = res + (size_t)t * ldr;                                                                  \
        switch (m) {                                                                                       \
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

DEFINE_FMA_TOKENS(fma_fp32, float, LOAD_FP32, IDENT)
DEFINE_FMA_TOKENS(fma_bf16, uint16_t, LOAD_BF16, bf16f)
DEFINE_FMA_TOKENS(fma_fp16, _Float16, LOAD_FP16, F16)
DEFINE_FMA_TOKENS(fma_int8, int8_t, LOAD_INT8, I8)

/* int4: per 16 bytes of a group, 32 weights are unpacked, scaled by the group's scale (shared by all tokens)
 * and FMA'd into up to 8 token accumulators. Groups are 32, 64 or 128 values: whole 16-byte steps. */
#define FMA4_STEP(J, XOFF, WV) a##J = _mm512_fmadd_ps(WV, _mm512_loadu_ps(x + (size_t)(J) * ldx + (XOFF)), a##J)
#define FMA4_ALL(XOFF, WV) do { FMA4_STEP(0, XOFF, WV);                                                     \
    if (m > 1) FMA4_STEP(1, XOFF, WV);                                                                    \
    if (m > 2) FMA4_STEP(2, XOFF, WV);                                                                    \
    if (m > 3) FMA4_STEP(3, XOFF, WV);                                                                    \
    if (m > 4) FMA4_STEP(4, XOFF, WV);                                                                    \
    if (m > 5) FMA4_STEP(5, XOFF, WV);                                                                    \
    if (m > 6) FMA4_STEP(6, XOFF, WV);                                                                    \
    if (m > 7) FMA4_STEP(7, XOFF, WV);                                                                    \
} while (0)
/* Up to 4 tokens: the high nibbles go to a second set of accumulators (a4..a7), so the FMA chains of
 * one token are independent and the loop is not bound by FMA latency. */
#define FMA4_HI(XOFF, WV) do { FMA4_STEP2(4, 0, XOFF, WV);                                                 \
    if (m > 1) FMA4_STEP2(5, 1, XOFF, WV);                                                                \
    if (m > 2) FMA4_STEP2(6, 2, XOFF, WV);                                                                \
    if (m > 3) FMA4_STEP2(7, 3, XOFF, WV);                                                                \
} while (0)
#define FMA4_STEP2(A, J, XOFF, WV) a##A = _mm512_fmadd_ps(WV, _mm512_loadu_ps(x + (size_t)(J) * ldx + (XOFF)), a##A)
AVX512_TARGET static inline __attribute__((always_inline)) void int4_m(const uint8_t *w, const void *scales,
        int group, const float *x, int ldx, int m, int n, float *res, int ldr) {
    const uint16_t *gscale = (const uint16_t *)scales;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const int half = group / 2;
    const __m512i low = _mm512_set1_epi32(15);
    for (int g = 0; g < n / group; g++) {
        const float gs = bf16f(gscale[g]);
        const __m512 sc = _mm512_set1_ps(gs), off = _mm512_set1_ps(-8.f * gs);
        const uint8_t *q = w + (size_t)g * half;
        const int base = g * group;
        for (int j = 0; j < half; j += 16) {
            __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j)));
            __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, low)), sc, off);
            __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), sc, off);
            FMA4_ALL(base + j, lo);
            if (m <= 4) FMA4_HI(base + j + half, hi);
            else FMA4_ALL(base + j + half, hi);
        }
    }
    if (m <= 4) {
        a0 = _mm512_add_ps(a0, a4); a1 = _mm512_add_ps(a1, a5);
        a2 = _mm512_add_ps(a2, a6); a3 = _mm512_add_ps(a3, a7);
    }
    __m512 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int j = 0; j < m; j++) res[(size_t)j * ldr] = _mm512_reduce_add_ps(acc[j]);
}

/* MXFP4: per 32-value block, the table of its 16 codes' values (E2M1X2 times half the block's scale, exact) is made
 * once; each 16-byte step looks 16 low and 16 high nibbles up in it (vpermps reads an index's low 4 bits only) and
 * FMAs them into up to 8 token accumulators. */
AVX512_TARGET static inline __attribute__((always_inline)) void mxfp4_m(const uint8_t *w, const void *gscale,
        int group, const float *x, int ldx, int m, int n, float *res, int ldr) {
    (void)group;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const uint8_t *scales = (const uint8_t *)gscale;
    const __m512 codes = _mm512_loadu_ps(E2M1X2);
    for (int g = 0; g < n / 32; g++) {
        const __m512 table = _mm512_mul_ps(codes, _mm512_set1_ps(e8m0_half(scales[g])));
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + (size_t)g * 16)));
        const __m512 lo = _mm512_permutexvar_ps(bytes, table);
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
        FMA4_ALL(g * 32, lo);
        if (m <= 4) FMA4_HI(g * 32 + 16, hi);
        else FMA4_ALL(g * 32 + 16, hi);
    }
    if (m <= 4) {
        a0 = _mm512_add_ps(a0, a4); a1 = _mm512_add_ps(a1, a5);
        a2 = _mm512_add_ps(a2, a6); a3 = _mm512_add_ps(a3, a7);
    }
    __m512 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int j = 0; j < m; j++) res[(size_t)j * ldr] = _mm512_reduce_add_ps(acc[j]);
}

/* Up to 8 tokens at a time through BODY (int4_m or mxfp4_m) specialised for the count. */
#define DEFINE_GROUPED(NAME, BODY)                                                                         \
AVX512_TARGET void NAME(const void *wrow, float scale, const void *gscale, int group,                      \
                        const float *x, int ldx, int nt, int n, float *res, int ldr) {                     \
    (void)scale;                                                                                           \
    const uint8_t *w = (const uint8_t *)wrow;                                                              \
    const void *gs = gscale;                                                                               \
    for (int t = 0; t < nt; t += 8) {                                                                      \
        const int m = nt - t < 8 ? nt - t : 8;                                                             \
        const float *xs = x + (size_t)t * ldx;                                                             \
        float *r = res + (size_t)t * ldr;                                                                  \
        switch (m) {                                                                                       \
            case 1: BODY(w, gs, group, xs, ldx, 1, n, r, ldr); break;                                      \
            case 2: BODY(w, gs, group, xs, ldx, 2, n, r, ldr); break;                                      \
            case 3: BODY(w, gs, group, xs, ldx, 3, n, r, ldr); break;                                      \
            case 4: BODY(w, gs, group, xs, ldx, 4, n, r, ldr); break;                                      \
            case 5: BODY(w, gs, group, xs, ldx, 5, n, r, ldr); break;                                      \
            case 6: BODY(w, gs, group, xs, ldx, 6, n, r, ldr); break;                                      \
            case 7: BODY(w, gs, group, xs, ldx, 7, n, r, ldr); break;                                      \
            default: BODY(w, gs, group, xs, ldx, 8, n, r, ldr); break;                                     \
        }                                                                                                  \
    }                                                                                                      \
}
DEFINE_GROUPED(fma_int4, int4_m)
DEFINE_GROUPED(fma_mxfp4, mxfp4_m)

/* g[i] = silu(g[i]) * g[I + i] for i in [lo, hi): 16 lanes at a time where AVX-512 is there. exp via 2^n * 2^f,
 * |f| <= 1/2, with a degree-7 series for 2^f (relative error < 1e-7, below float rounding of the result). */
AVX512_TARGET static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));  /* e^f = 2^(t - n) */
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

AVX512_TARGET void swiglu512(float *g, int I, int lo, int hi) {
    int i = lo;
    for (; i + 16 <= hi; i += 16) {
        const __m512 v = _mm512_loadu_ps(g + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), v));
        const __m512 s = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(s, _mm512_loadu_ps(g + I + i)));
    }
    for (; i < hi; i++) g[i] = silu(g[i]) * g[I + i];
}

/* g[i] = gelu_tanh(g[i]) * g[I + i] (Gemma's GeGLU): gelu_tanh(v) = v sigmoid(2 sqrt(2/pi) (v + 0.044715 v^3)), the
 * tanh form's own value (0.5 (1 + tanh z) = sigmoid(2z)), through exp512 as silu. */
AVX512_TARGET void geglu512(float *g, int I, int lo, int hi) {
    int i = lo;
    for (; i + 16 <= hi; i += 16) {
        const __m512 v = _mm512_loadu_ps(g + i);
        const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(v, v), v), _mm512_set1_ps(0.044715f), v);
        const __m512 e = exp512(_mm512_mul_ps(inner, _mm512_set1_ps(-GELU_2C)));
        const __m512 s = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(s, _mm512_loadu_ps(g + I + i)));
    }
    for (; i < hi; i++) g[i] = gelu_tanh(g[i]) * g[I + i];
}

/* gpt-oss's clamped SwiGLU with the gate and up biases (NULL: none), as `activate` (common.h) computes it. */
AVX512_TARGET void clamped512(float *g, const float *gate_bias, const float *up_bias, float alpha, float limit,
                              int I, int lo, int hi) {
    const __m512 top = _mm512_set1_ps(limit), bottom = _mm512_set1_ps(-limit), one = _mm512_set1_ps(1.f);
    const __m512 nalpha = _mm512_set1_ps(-alpha);
    int i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m512 gv = _mm512_loadu_ps(g + i), uv = _mm512_loadu_ps(g + I + i);
        if (gate_bias) gv = _mm512_add_ps(gv, _mm512_loadu_ps(gate_bias + i));
        if (up_bias) uv = _mm512_add_ps(uv, _mm512_loadu_ps(up_bias + i));
        gv = _mm512_min_ps(gv, top);
        uv = _mm512_min_ps(_mm512_max_ps(uv, bottom), top);
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_mul_ps(nalpha, gv))));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_add_ps(uv, one), s));
    }
    for (; i < hi; i++) {
        float gv = g[i] + (gate_bias ? gate_bias[i] : 0.f), uv = g[I + i] + (up_bias ? up_bias[i] : 0.f);
        gv = fminf(gv, limit), uv = fminf(fmaxf(uv, -limit), limit);
        g[i] = (uv + 1.f) * (gv / (1.f + expf(-alpha * gv)));
    }
}

/* ---- One token, four rows at a time (AVX-512) ---------------------------------------------------------
 * With a single token there is no reuse to exploit, only bandwidth: four rows are streamed side by side,
 * two vectors of each per step, which keeps eight independent FMA chains and four memory streams in flight
 * per thread. Row j: weights rows[j], scales scales[j] (int8: the row's, int4: its groups'), input x[j] (the
 * rows may belong to different experts), result *res[j]. */
#define FMA_ROW(J) a##J = _mm512_fmadd_ps(LOADW(w##J + k), _mm512_loadu_ps(x[J] + k), a##J);                 \
                   b##J = _mm512_fmadd_ps(LOADW(w##J + k + 16), _mm512_loadu_ps(x[J] + k + 16), b##J)
/* The four rows lie far apart (stream_rows), each the head of a long sequential run, and each line is asked for
 * ROWS4_PREFETCH bytes ahead (common.h). Two vectors per row per step (two chains each): faster than one for fp16.
 * Figures: docs/bench/kernels.md. */
#define DEFINE_ROWS4(NAME, WT, LOADW_, CONV, SCALED)                                                        \
AVX512_TARGET static void NAME(const char *const *rows, const void *const *scales, int group,               \
                               const float *const *x, int n, float *const *res) {                           \
    (void)group;                                                                                            \
    const WT *w0 = (const WT *)rows[0], *w1 = (const WT *)rows[1];                                           \
    const WT *w2 = (const WT *)rows[2], *w3 = (const WT *)rows[3];                                           \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;          \
    int k = 0;                                                                                              \
    for (; k + 32 <= n; k += 32) {                                                                          \
        if ((k * (int)sizeof(WT)) % 64 == 0)  /* each line once, ROWS4_PREFETCH bytes ahead (int8: every other step) */ \
            for (int o = 0; o < 32 * (int)sizeof(WT); o += 64) {                                            \
                const int e = o / (int)sizeof(WT);                                                          \
                PREFETCH_AHEAD(w0 + k + e); PREFETCH_AHEAD(w1 + k + e);                                     \
                PREFETCH_AHEAD(w2 + k + e); PREFETCH_AHEAD(w3 + k + e);                                     \
            }                                                                                               \
        FMA_ROW(0); FMA_ROW(1); FMA_ROW(2); FMA_ROW(3);                                                     \
    }                                                                                                       \
    const WT *ws[4] = {w0, w1, w2, w3};                                                                     \
    __m512 rs[4] = {_mm512_add_ps(a0, b0), _mm512_add_ps(a1, b1), _mm512_add_ps(a2, b2), _mm512_add_ps(a3, b3)}; \
    for (int j = 0; j < 4; j++) {                                                                           \
        int kk = k;                                                                                         \
        if (kk + 16 <= n) { rs[j] = _mm512_fmadd_ps(LOADW(ws[j] + kk), _mm512_loadu_ps(x[j] + kk), rs[j]); kk += 16; } \
        float s = _mm512_reduce_add_ps(rs[j]);                                                              \
        for (; kk < n; kk++) s += CONV(ws[j][kk]) * x[j][kk];                                               \
        *res[j] = SCALED ? s * *(const float *)scales[j] : s;                                               \
    }                                                                                                       \
}
#define LOADW LOAD_FP32
DEFINE_ROWS4(rows4_fp32, float, LOAD_FP32, IDENT, 0)
#undef LOADW
#define LOADW LOAD_BF16
DEFINE_ROWS4(rows4_bf16, uint16_t, LOAD_BF16, bf16f, 0)
#undef LOADW
#define LOADW LOAD_FP16
DEFINE_ROWS4(rows4_fp16, _Float16, LOAD_FP16, F16, 0)
#undef LOADW
#define LOADW LOAD_INT8
DEFINE_ROWS4(rows4_int8, int8_t, LOAD_INT8, I8, 1)
#undef LOADW

/* int4, one token, four rows: each row's group scale folds into the unpacked weights. */
#define INT4_ROW(J)                                                                                         \
    do {                                                                                                    \
        const float sc = bf16f(s##J[g]);                                                                    \
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q##J + (size_t)g * half + j))); \
        __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, low)), _mm512_set1_ps(sc),   \
                                    _mm512_set1_ps(-8.f * sc));                                             \
        __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), _mm512_set1_ps(sc),    \
                                    _mm512_set1_ps(-8.f * sc));                                             \
        r##J = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x[J] + (size_t)g * group + j), r##J);                   \
        h##J = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x[J] + (size_t)g * group + j + half), h##J);            \
    } while (0)
AVX512_TARGET static void rows4_int4(const char *const *rows, const void *const *scales, int group,
                                     const float *const *x, int n, float *const *res) {
    const uint8_t *q0 = (const uint8_t *)rows[0], *q1 = (const uint8_t *)rows[1], *q2 = (const uint8_t *)rows[2];
    const uint8_t *q3 = (const uint8_t *)rows[3];
    const int ngroups = n / group, half = group / 2;
    const uint16_t *s0 = scales[0], *s1 = scales[1], *s2 = scales[2], *s3 = scales[3];
    const __m512i low = _mm512_set1_epi32(15);
    __m512 r0 = _mm512_setzero_ps(), r1 = r0, r2 = r0, r3 = r0, h0 = r0, h1 = r0, h2 = r0, h3 = r0;
    for (int g = 0; g < ngroups; g++) {
        for (int j = 0; j < half; j += 16) {
            const size_t o = (size_t)g * half + j;  /* each line prefetched once, as the other four-row kernels do */
            if (o % 64 == 0) {
                PREFETCH_AHEAD(q0 + o); PREFETCH_AHEAD(q1 + o); PREFETCH_AHEAD(q2 + o); PREFETCH_AHEAD(q3 + o);
            }
            INT4_ROW(0); INT4_ROW(1); INT4_ROW(2); INT4_ROW(3);
        }
    }
    *res[0] = _mm512_reduce_add_ps(_mm512_add_ps(r0, h0));
    *res[1] = _mm512_reduce_add_ps(_mm512_add_ps(r1, h1));
    *res[2] = _mm512_reduce_add_ps(_mm512_add_ps(r2, h2));
    *res[3] = _mm512_reduce_add_ps(_mm512_add_ps(r3, h3));
}

/* Half of n E8M0 scale bytes (e8m0_half), 16 at a time. */
AVX512_TARGET void e8m0_halves(const uint8_t *e, int n, float *out) {
    int g = 0;
    for (; g + 16 <= n; g += 16) {
        const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(e + g)));
        const __mmask16 low = _mm512_cmplt_epu32_mask(u, _mm512_set1_epi32(2));
        const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(u, _mm512_set1_epi32(1)), 23);
        const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), u);
        _mm512_storeu_si512((void *)(out + g), _mm512_mask_blend_epi32(low, normal, tiny));
    }
    for (; g < n; g++) out[g] = e8m0_half(e[g]);
}

/* MXFP4, one token, four rows: each row's scales made floats first (e8m0_halves), then per block its table (as
 * mxfp4_m, the scale a broadcast from memory), the products summed per row in two chains (low and high nibbles).
 * Making each block's scale in the loop instead (scalar, then a register broadcast) took 45 % longer on
 * 2880x2880 experts. */
#define MXFP4_ROW(J)                                                                                        \
    do {                                                                                                    \
        const __m512 table = _mm512_mul_ps(codes, _mm512_set1_ps(sf[J][g]));                                \
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q##J + (size_t)g * 16))); \
        r##J = _mm512_fmadd_ps(_mm512_permutexvar_ps(bytes, table), _mm512_loadu_ps(x[J] + (size_t)g * 32), r##J); \
        h##J = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table),                   \
                               _mm512_loadu_ps(x[J] + (size_t)g * 32 + 16), h##J);                         \
    } while (0)
AVX512_TARGET static void rows4_mxfp4(const char *const *rows, const void *const *scales, int group,
                                      const float *const *x, int n, float *const *res) {
    (void)group;
    const uint8_t *q0 = (const uint8_t *)rows[0], *q1 = (const uint8_t *)rows[1], *q2 = (const uint8_t *)rows[2];
    const uint8_t *q3 = (const uint8_t *)rows[3];
    const int groups = n / 32;
    float sf[4][groups];
    for (int j = 0; j < 4; j++) e8m0_halves((const uint8_t *)scales[j], groups, sf[j]);
    const __m512 codes = _mm512_loadu_ps(E2M1X2);
    __m512 r0 = _mm512_setzero_ps(), r1 = r0, r2 = r0, r3 = r0, h0 = r0, h1 = r0, h2 = r0, h3 = r0;
    for (int g = 0; g < groups; g++) {
        if (g % 4 == 0) {  /* each line prefetched once, as the other four-row kernels do */
            const size_t o = (size_t)g * 16;
            PREFETCH_AHEAD(q0 + o); PREFETCH_AHEAD(q1 + o); PREFETCH_AHEAD(q2 + o); PREFETCH_AHEAD(q3 + o);
        }
        MXFP4_ROW(0); MXFP4_ROW(1); MXFP4_ROW(2); MXFP4_ROW(3);
    }
    *res[0] = _mm512_reduce_add_ps(_mm512_add_ps(r0, h0));
    *res[1] = _mm512_reduce_add_ps(_mm512_add_ps(r1, h1));
    *res[2] = _mm512_reduce_add_ps(_mm512_add_ps(r2, h2));
    *res[3] = _mm512_reduce_add_ps(_mm512_add_ps(r3, h3));
}


/* GGUF block kinds, one token, four rows: per chunk of 256 values, each row's blocks unpacked into L1 (blocks.h)
 * and FMA'd against its input in two chains; each line of the rows asked for ROWS4_PREFETCH bytes ahead. */
#define DEFINE_BLOCK_ROWS4(NAME, V, B)                                                                      \
AVX512_TARGET static void rows4_##NAME(const char *const *rows, const void *const *scales, int group,       \
                                       const float *const *x, int n, float *const *res) {                   \
    (void)scales, (void)group;                                                                              \
    float buf[CHUNK];                                                                                       \
    __m512 a[4][2];                                                                                         \
    for (int j = 0; j < 4; j++) a[j][0] = a[j][1] = _mm512_setzero_ps();                                    \
    for (int k0 = 0; k0 < n; k0 += CHUNK) {                                                                 \
        const int c = n - k0 < CHUNK ? n - k0 : CHUNK;                                                      \
        const size_t at = (size_t)k0 / (V) * (B), len = (size_t)c / (V) * (B);                              \
        for (int j = 0; j < 4; j++) {                                                                       \
            const uint8_t *w = (const uint8_t *)rows[j];                                                    \
            for (size_t o = (at + 63) / 64 * 64; o < at + len; o += 64) PREFETCH_AHEAD(w + o);              \
            UNPACK_CHUNK(unpack_##NAME, V, B, w, k0, c, buf);                                               \
            for (int k = 0; k < c; k += 32) {                                                               \
                a[j][0] = _mm512_fmadd_ps(_mm512_loadu_ps(buf + k), _mm512_loadu_ps(x[j] + k0 + k), a[j][0]); \
                a[j][1] = _mm512_fmadd_ps(_mm512_loadu_ps(buf + k + 16), _mm512_loadu_ps(x[j] + k0 + k + 16), \
                                          a[j][1]);                                                         \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    for (int j = 0; j < 4; j++) *res[j] = _mm512_reduce_add_ps(_mm512_add_ps(a[j][0], a[j][1]));            \
}
DEFINE_BLOCK_DOTS(avx512, AVX512_TARGET)
DEFINE_BLOCK_ROWS4(q8_0, 32, 34)
DEFINE_BLOCK_ROWS4(q4_0, 32, 18)
DEFINE_BLOCK_ROWS4(q4_1, 32, 20)
DEFINE_BLOCK_ROWS4(q5_0, 32, 22)
DEFINE_BLOCK_ROWS4(q5_1, 32, 24)
DEFINE_BLOCK_ROWS4(q4_k, 256, 144)
DEFINE_BLOCK_ROWS4(q5_k, 256, 176)
DEFINE_BLOCK_ROWS4(q6_k, 256, 210)
DEFINE_BLOCK_ROWS4(gmxfp4, 32, 17)
/* Every kind's four-row kernel, by kind. */
static const rows4_fn FOUR[KINDS] = {rows4_fp32, rows4_bf16, rows4_fp16, rows4_int8, rows4_int4, rows4_mxfp4,
                                     rows4_q8_0, rows4_q4_0, rows4_q4_1, rows4_q5_0, rows4_q5_1, rows4_q4_k,
                                     rows4_q5_k, rows4_q6_k, rows4_gmxfp4};
rows4_fn rows4_avx512(int kind) { return kind >= 0 && kind < KINDS ? FOUR[kind] : NULL; }
