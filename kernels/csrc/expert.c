/* Tandem CPU expert kernels: one SwiGLU expert, out = down(silu(gate x) * up x), for a few tokens.
 *
 * Decode is bound by how fast the weights stream from DRAM, so every weight row is read once, as one
 * sequential stream, and reused for all tokens of the call while it sits in L1. The whole expert runs in
 * one OpenMP region: gate and up rows (one fused pass over 2I rows), then the activation, then down rows.
 *
 * Weight kinds: fp32, bf16, fp16 (row-major [rows, cols]); int8 with one float scale per row; int4 with one
 * bf16 scale per group of `group` values, stored as bytes whose low nibble is element j and high nibble
 * element j + group/2 of the group (values offset by 8). Activations are float32.
 *
 * ISA variants are separate functions compiled with target attributes, chosen at run time from what the
 * CPU supports (or forced by the caller): baseline C, AVX2+FMA+F16C, AVX-512, and for bf16 weights with
 * bf16 activations AVX512_BF16 (vdpbf16ps) and AMX tiles (which keep 2-16 tokens near the roofline). One token of
 * fp32, bf16 or fp16 weights goes through AVX-512 rows, four long runs per thread (stream_rows). On AMX
 * machines int8 and int4 (in the block layout of kernels/quant.py) run on integer tiles against 16-bit
 * fixed-point activations, and one token of either on AVX512-VNNI against 15-bit fixed point.
 * Several experts of a layer can run in one parallel region (tk_experts), and dense matrices through the same
 * kernels (tk_linear).
 * Loaded through ctypes; the tiny Python module init below only makes it an importable extension.
 */
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { K_FP32 = 0, K_BF16 = 1, K_FP16 = 2, K_INT8 = 3, K_INT4 = 4 };
enum { ISA_BASE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3, ISA_AMX = 4 };

typedef struct {
    int kind, isa, tokens, hidden, inter, threads, group;
    const void *gate, *up, *down;        /* [I, H], [I, H], [H, I] */
    const void *gate_scale, *up_scale, *down_scale;  /* int8: float per row; int4: bf16 [rows, groups] */
    const float *x;                      /* [T, H] */
    float *out;                          /* [T, H] */
    float *act;                          /* scratch [T, 2I] */
    uint16_t *xb;                        /* scratch of 32 max(H, I) bytes (AVX512_BF16, AMX and VNNI paths) */
} tk_args;

static inline float bf16f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t bf16_of(float f) {  /* round to nearest even; NaN -> quiet NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ---- row dot products, generic C (vectorised by the compiler for each target) ---------------------- */
#define DOT_BODY(WT, CONV)                                                                          \
    const WT *w = (const WT *)wrow;                                                                \
    for (int t = 0; t < nt; t++) {                                                                 \
        const float *xt = x + (size_t)t * ldx;                                                     \
        float a = 0.f;                                                                             \
        _Pragma("omp simd reduction(+:a)")                                                         \
        for (int k = 0; k < n; k++) a += CONV(w[k]) * xt[k];                                       \
        res[(size_t)t * ldr] = a * scale;                                                          \
    }

#define INT4_BODY                                                                                  \
    const uint8_t *w = (const uint8_t *)wrow;                                                      \
    const int half = group / 2, ngroups = n / group;                                               \
    for (int t = 0; t < nt; t++) {                                                                 \
        const float *xt = x + (size_t)t * ldx;                                                     \
        float total = 0.f;                                                                         \
        for (int g = 0; g < ngroups; g++) {                                                        \
            const uint8_t *q = w + (size_t)g * half;                                               \
            const float *xg = xt + (size_t)g * group;                                              \
            float a = 0.f;                                                                         \
            _Pragma("omp simd reduction(+:a)")                                                     \
            for (int j = 0; j < half; j++)                                                         \
                a += (float)((int)(q[j] & 15) - 8) * xg[j] + (float)((int)(q[j] >> 4) - 8) * xg[j + half]; \
            total += a * bf16f(gscale[g]);                                                         \
        }                                                                                          \
        res[(size_t)t * ldr] = total;                                                              \
    }

#define IDENT(v) (v)
#define I8(v) ((float)(v))
#define F16(v) ((float)(v))

#define DEFINE_DOTS(SUFFIX, ATTR)                                                                  \
ATTR static void dot_fp32_##SUFFIX(const void *wrow, float scale, const uint16_t *gscale, int group,   \
        const float *x, int ldx, int nt, int n, float *res, int ldr) { (void)gscale; (void)group; DOT_BODY(float, IDENT) } \
ATTR static void dot_bf16_##SUFFIX(const void *wrow, float scale, const uint16_t *gscale, int group,   \
        const float *x, int ldx, int nt, int n, float *res, int ldr) { (void)gscale; (void)group; DOT_BODY(uint16_t, bf16f) } \
ATTR static void dot_fp16_##SUFFIX(const void *wrow, float scale, const uint16_t *gscale, int group,   \
        const float *x, int ldx, int nt, int n, float *res, int ldr) { (void)gscale; (void)group; DOT_BODY(_Float16, F16) } \
ATTR static void dot_int8_##SUFFIX(const void *wrow, float scale, const uint16_t *gscale, int group,   \
        const float *x, int ldx, int nt, int n, float *res, int ldr) { (void)gscale; (void)group; DOT_BODY(int8_t, I8) } \
ATTR static void dot_int4_##SUFFIX(const void *wrow, float scale, const uint16_t *gscale, int group,   \
        const float *x, int ldx, int nt, int n, float *res, int ldr) { (void)scale; INT4_BODY }

DEFINE_DOTS(base, )
DEFINE_DOTS(avx2, __attribute__((target("avx2,fma,f16c"))))

/* ---- AVX-512: convert 16 weights once, FMA them into up to 8 token accumulators -------------------- */
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define LOAD_FP32(p) _mm512_loadu_ps((const float *)(p))
#define LOAD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define LOAD_FP16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LOAD_INT8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
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
AVX512_TARGET static void NAME(const void *wrow, float scale, const uint16_t *gscale, int group,               \
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
AVX512_TARGET static inline __attribute__((always_inline)) void int4_m(const uint8_t *w, const uint16_t *gscale,
        int group, const float *x, int ldx, int m, int n, float *res, int ldr) {
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

AVX512_TARGET static void fma_int4(const void *wrow, float scale, const uint16_t *gscale, int group,
                                   const float *x, int ldx, int nt, int n, float *res, int ldr) {
    (void)scale;
    const uint8_t *w = (const uint8_t *)wrow;
    for (int t = 0; t < nt; t += 8) {
        const int m = nt - t < 8 ? nt - t : 8;
        const float *xs = x + (size_t)t * ldx;
        float *r = res + (size_t)t * ldr;
        switch (m) {
            case 1: int4_m(w, gscale, group, xs, ldx, 1, n, r, ldr); break;
            case 2: int4_m(w, gscale, group, xs, ldx, 2, n, r, ldr); break;
            case 3: int4_m(w, gscale, group, xs, ldx, 3, n, r, ldr); break;
            case 4: int4_m(w, gscale, group, xs, ldx, 4, n, r, ldr); break;
            case 5: int4_m(w, gscale, group, xs, ldx, 5, n, r, ldr); break;
            case 6: int4_m(w, gscale, group, xs, ldx, 6, n, r, ldr); break;
            case 7: int4_m(w, gscale, group, xs, ldx, 7, n, r, ldr); break;
            default: int4_m(w, gscale, group, xs, ldx, 8, n, r, ldr); break;
        }
    }
}

typedef void (*dot_fn)(const void *, float, const uint16_t *, int, const float *, int, int, int, float *, int);

static dot_fn pick_dot(int kind, int isa) {
    static const dot_fn table[3][5] = {
        {dot_fp32_base, dot_bf16_base, dot_fp16_base, dot_int8_base, dot_int4_base},
        {dot_fp32_avx2, dot_bf16_avx2, dot_fp16_avx2, dot_int8_avx2, dot_int4_avx2},
        {fma_fp32, fma_bf16, fma_fp16, fma_int8, fma_int4},
    };
    int row = isa >= ISA_AVX512 ? 2 : isa;
    return table[row][kind];
}

/* ---- AVX512_BF16: vdpbf16ps on bf16 weights and bf16-rounded activations -------------------------- */
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

BF16_TARGET static void to_bf16(const float *src, uint16_t *dst, int n) {
    int k = 0;
    for (; k + 32 <= n; k += 32) {
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
        _mm512_storeu_si512((void *)(dst + k), (__m512i)v);
    }
    for (; k < n; k++) dst[k] = bf16_of(src[k]);  /* round to nearest even, like the vector path */
}

/* M tokens (1..8) share every loaded weight vector; one token splits the row over 4 accumulators. */
#define DP_STEP(J) a##J = _mm512_dpbf16_ps(a##J, wv, (__m512bh)_mm512_loadu_si512((const void *)(xb + (size_t)(J) * ldx + k)))
BF16_TARGET static inline __attribute__((always_inline)) void dp_tokens(const uint16_t *w, const uint16_t *xb, int ldx,
                                                                        int m, int n, float *res, int ldr) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    int k = 0;
    if (m == 1) {
        for (; k + 128 <= n; k += 128) {
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(w + k)),
                                  (__m512bh)_mm512_loadu_si512((const void *)(xb + k)));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(w + k + 32)),
                                  (__m512bh)_mm512_loadu_si512((const void *)(xb + k + 32)));
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512((const void *)(w + k + 64)),
                                  (__m512bh)_mm512_loadu_si512((const void *)(xb + k + 64)));
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512((const void *)(w + k + 96)),
                                  (__m512bh)_mm512_loadu_si512((const void *)(xb + k + 96)));
        }
        a0 = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
    }
    for (; k + 32 <= n; k += 32) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + k));
        DP_STEP(0);
        if (m > 1) DP_STEP(1);
        if (m > 2) DP_STEP(2);
        if (m > 3) DP_STEP(3);
        if (m > 4) DP_STEP(4);
        if (m > 5) DP_STEP(5);
        if (m > 6) DP_STEP(6);
        if (m > 7) DP_STEP(7);
    }
    __m512 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int j = 0; j < m; j++) {
        float sum = _mm512_reduce_add_ps(acc[j]);
        const uint16_t *xt = xb + (size_t)j * ldx;
        for (int kk = k; kk < n; kk++) sum += bf16f(w[kk]) * bf16f(xt[kk]);
        res[(size_t)j * ldr] = sum;
    }
}

BF16_TARGET static void dot_bf16_dp(const uint16_t *w, const uint16_t *xb, int ldx, int nt, int n, float *res, int ldr) {
    for (int t = 0; t < nt; t += 8) {
        const int m = nt - t < 8 ? nt - t : 8;
        const uint16_t *xs = xb + (size_t)t * ldx;
        float *r = res + (size_t)t * ldr;
        switch (m) {  /* constant m per case: the compiler drops the unused accumulators */
            case 1: dp_tokens(w, xs, ldx, 1, n, r, ldr); break;
            case 2: dp_tokens(w, xs, ldx, 2, n, r, ldr); break;
            case 3: dp_tokens(w, xs, ldx, 3, n, r, ldr); break;
            case 4: dp_tokens(w, xs, ldx, 4, n, r, ldr); break;
            case 5: dp_tokens(w, xs, ldx, 5, n, r, ldr); break;
            case 6: dp_tokens(w, xs, ldx, 6, n, r, ldr); break;
            case 7: dp_tokens(w, xs, ldx, 7, n, r, ldr); break;
            default: dp_tokens(w, xs, ldx, 8, n, r, ldr); break;
        }
    }
}

/* float32 values as hi + lo, two bf16 each (hi = the value rounded, lo = what is left, rounded): 16 significant
 * bits, so a dot product against both is as close to float32's as makes no difference at bf16 weights. */
BF16_TARGET static void to_bf16_split(const float *src, uint16_t *hi, uint16_t *lo, int n) {
    int k = 0;
    for (; k + 16 <= n; k += 16) {
        const __m512 v = _mm512_loadu_ps(src + k);
        const __m256bh h = _mm512_cvtneps_pbh(v);
        const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
        _mm256_storeu_si256((__m256i *)(hi + k), (__m256i)h);
        _mm256_storeu_si256((__m256i *)(lo + k), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back)));
    }
    for (; k < n; k++) { hi[k] = bf16_of(src[k]); lo[k] = bf16_of(src[k] - bf16f(hi[k])); }
}

/* Two weight rows x m tokens: each loaded activation vector feeds two rows, halving activation loads. With
 * `split`, each token's activations are hi + lo pairs (lo at xlo, same layout) and both go into its sums. */
#define DP2_X(P, J) ((__m512bh)_mm512_loadu_si512((const void *)((P) + (size_t)(J) * ldx + k)))
#define DP2_STEP(J) do { __m512bh xv = DP2_X(xb, J);                                                             \
    b##J = _mm512_dpbf16_ps(b##J, w0, xv); c##J = _mm512_dpbf16_ps(c##J, w1, xv);                              \
    if (split) { xv = DP2_X(xlo, J); b##J = _mm512_dpbf16_ps(b##J, w0, xv); c##J = _mm512_dpbf16_ps(c##J, w1, xv); } \
} while (0)
BF16_TARGET static inline __attribute__((always_inline)) void dp2_tokens(const uint16_t *r0, const uint16_t *r1,
        const uint16_t *xb, const uint16_t *xlo, int split, int ldx, int m, int n, float *res, int ldr) {
    __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0, b4 = b0, b5 = b0, b6 = b0, b7 = b0;
    __m512 c0 = b0, c1 = b0, c2 = b0, c3 = b0, c4 = b0, c5 = b0, c6 = b0, c7 = b0;
    int k = 0;
    for (; k + 32 <= n; k += 32) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(r0 + k));
        __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(r1 + k));
        DP2_STEP(0);
        if (m > 1) DP2_STEP(1);
        if (m > 2) DP2_STEP(2);
        if (m > 3) DP2_STEP(3);
        if (m > 4) DP2_STEP(4);
        if (m > 5) DP2_STEP(5);
        if (m > 6) DP2_STEP(6);
        if (m > 7) DP2_STEP(7);
    }
    __m512 bs[8] = {b0, b1, b2, b3, b4, b5, b6, b7}, cs[8] = {c0, c1, c2, c3, c4, c5, c6, c7};
    for (int j = 0; j < m; j++) {
        float s0 = _mm512_reduce_add_ps(bs[j]), s1 = _mm512_reduce_add_ps(cs[j]);
        const uint16_t *xt = xb + (size_t)j * ldx, *xl = split ? xlo + (size_t)j * ldx : NULL;
        for (int kk = k; kk < n; kk++) {
            const float v = bf16f(xt[kk]) + (split ? bf16f(xl[kk]) : 0.f);
            s0 += bf16f(r0[kk]) * v;
            s1 += bf16f(r1[kk]) * v;
        }
        res[(size_t)j * ldr] = s0;
        res[(size_t)j * ldr + 1] = s1;
    }
}

/* Rows r and r+1 (adjacent in the output: res[t*ldr + 0/1]) for nt tokens, DP2_TOKENS at a time; xlo: NULL, or
 * the lo halves of hi + lo activations (to_bf16_split), laid out as xb. */
#ifndef DP2_TOKENS
#define DP2_TOKENS 8
#endif
#define DP2_CASE(M, SPLIT) case M: dp2_tokens(r0, r1, xs, xl, SPLIT, ldx, M, n, r, ldr); break
#define DP2_SWITCH(SPLIT) switch (m) {                                                                        \
    DP2_CASE(1, SPLIT); DP2_CASE(2, SPLIT); DP2_CASE(3, SPLIT); DP2_CASE(4, SPLIT);                          \
    DP2_CASE(5, SPLIT); DP2_CASE(6, SPLIT); DP2_CASE(7, SPLIT); default: DP2_CASE(8, SPLIT);                   \
}
BF16_TARGET static void dot2_bf16_dp(const uint16_t *r0, const uint16_t *r1, const uint16_t *xb, const uint16_t *xlo,
                                     int ldx, int nt, int n, float *res, int ldr) {
    for (int t = 0; t < nt; t += DP2_TOKENS) {
        const int m = nt - t < DP2_TOKENS ? nt - t : DP2_TOKENS;
        const uint16_t *xs = xb + (size_t)t * ldx, *xl = xlo ? xlo + (size_t)t * ldx : NULL;
        float *r = res + (size_t)t * ldr;
        if (xlo) DP2_SWITCH(1)
        else if (m == 1) {  /* one token: each row over four accumulators */
            dot_bf16_dp(r0, xs, ldx, 1, n, r, ldr);
            dot_bf16_dp(r1, xs, ldx, 1, n, r + 1, ldr);
        } else DP2_SWITCH(0)
    }
}

static inline float silu(float g) { return g / (1.f + expf(-g)); }

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

AVX512_TARGET static void swiglu512(float *g, int I, int lo, int hi) {
    int i = lo;
    for (; i + 16 <= hi; i += 16) {
        const __m512 v = _mm512_loadu_ps(g + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), v));
        const __m512 s = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(s, _mm512_loadu_ps(g + I + i)));
    }
    for (; i < hi; i++) g[i] = silu(g[i]) * g[I + i];
}

/* Inside a parallel region: the SwiGLU activation of act [T, 2I] (gate then up per token), in place,
 * split across threads in blocks of 512 values. */
static inline void swiglu_rows(float *act, int T, int I, int isa) {
    const int blocks = (I + 511) / 512;
    #pragma omp for schedule(static)
    for (int b = 0; b < T * blocks; b++) {
        float *g = act + (size_t)(b / blocks) * 2 * I;
        const int lo = (b % blocks) * 512, hi = lo + 512 < I ? lo + 512 : I;
        if (isa >= ISA_AVX512) swiglu512(g, I, lo, hi);
        else for (int i = lo; i < hi; i++) g[i] = silu(g[i]) * g[I + i];
    }
}

static size_t row_bytes(int kind, int n, int group) {
    switch (kind) {
        case K_FP32: return (size_t)n * 4;
        case K_BF16: case K_FP16: return (size_t)n * 2;
        case K_INT8: return (size_t)n;
        default: (void)group; return (size_t)n / 2;
    }
}

static const uint16_t *row_scales(const void *s, int kind, int row, int n, int group) {
    if (kind != K_INT4 || !s) return NULL;
    return (const uint16_t *)s + (size_t)row * (n / group);
}

static float row_scale(const void *s, int kind, int row) {
    return (kind == K_INT8 && s) ? ((const float *)s)[row] : 1.f;
}

BF16_TARGET static void expert_bf16dp(const tk_args *a) {
    const int T = a->tokens, H = a->hidden, I = a->inter, ld = H > I ? H : I, split = T <= 8;
    const uint16_t *gate = a->gate, *up = a->up, *down = a->down, *xlo = a->xb + (size_t)T * ld;
    #pragma omp parallel num_threads(a->threads)
    {
        #pragma omp for schedule(static)
        for (int t = 0; t < T; t++) to_bf16(a->x + (size_t)t * H, a->xb + (size_t)t * ld, H);
        #pragma omp for schedule(static)
        for (int r = 0; r < 2 * I; r += 2) {  /* I is even (checked), so a pair never straddles gate/up */
            const uint16_t *w = r < I ? gate + (size_t)r * H : up + (size_t)(r - I) * H;
            dot2_bf16_dp(w, w + H, a->xb, NULL, ld, T, H, a->act + r, 2 * I);
        }
        swiglu_rows(a->act, T, I, a->isa);
        /* x was bf16 already; the activations are not, and rounding them is the one rounding this path would add
         * to the float32 ones: up to 8 tokens they go in as hi + lo (the scratch holds 16 rows), more are rounded */
        #pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            const float *act = a->act + (size_t)t * 2 * I;
            if (split) to_bf16_split(act, a->xb + (size_t)t * ld, xlo + (size_t)t * ld, I);
            else to_bf16(act, a->xb + (size_t)t * ld, I);
        }
        #pragma omp for schedule(static)
        for (int h = 0; h < H - 1; h += 2) {
            const uint16_t *r0 = down + (size_t)h * I, *r1 = r0 + I;
            dot2_bf16_dp(r0, r1, a->xb, split ? xlo : NULL, ld, T, I, a->out + h, H);
        }
        if (H % 2) {  /* the last row alone (once, by one thread) */
            #pragma omp single
            {
                const uint16_t *row = down + (size_t)(H - 1) * I;
                dot_bf16_dp(row, a->xb, ld, T, I, a->out + H - 1, H);
                if (split) {
                    float rest[8];
                    dot_bf16_dp(row, xlo, ld, T, I, rest, 1);
                    for (int t = 0; t < T; t++) a->out[(size_t)t * H + H - 1] += rest[t];
                }
            }
        }
    }
}

/* ---- One token, four rows at a time (AVX-512) ---------------------------------------------------------
 * With a single token there is no reuse to exploit, only bandwidth: four rows are streamed side by side,
 * two vectors of each per step, which keeps eight independent FMA chains and four memory streams in flight
 * per thread. Row j: weights rows[j], scales scales[j] (int8: the row's, int4: its groups'), input x[j] (the
 * rows may belong to different experts), result *res[j]. */
#define FMA_ROW(J) a##J = _mm512_fmadd_ps(LOADW(w##J + k), _mm512_loadu_ps(x[J] + k), a##J);                 \
                   b##J = _mm512_fmadd_ps(LOADW(w##J + k + 16), _mm512_loadu_ps(x[J] + k + 16), b##J)
/* The four rows lie far apart (stream_rows), each the head of a long sequential run: asking for each line
 * 2 KB ahead of the four measured 0.93-0.95 of the probe's bandwidth on 2048x768 and 4096x14336 experts (bf16
 * and fp16), against 0.80 with none and 0.90 at 512 bytes or 4 KB. Two vectors per row per step (two chains
 * each): fp16 +1-3 %. */
#define ROWS4_PREFETCH 2048
#define PREFETCH_AHEAD(p) _mm_prefetch((const char *)(p) + ROWS4_PREFETCH, _MM_HINT_T0)
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
            const size_t o = (size_t)g * half + j;  /* each line once, as in the other four-row kernels: 10 % faster */
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

typedef void (*rows4_fn)(const char *const *, const void *const *, int, const float *const *, int, float *const *);

/* Row q of a one-token phase over n experts: gate and up rows (q < n * 2I, expert by expert, gate then up),
 * or down rows; where its weights, scales (int8: the row's, int4: its groups', else NULL), input and result lie. */
typedef struct { const char *w; const void *s; const float *x; float *res; int e; } row_ref;
static inline row_ref one_token_row(const tk_args *a, int down, int q) {
    const int H = a->hidden, I = a->inter, kind = a->kind;
    row_ref r;
    if (down) {
        const tk_args *e = a + q / H;
        const int row = q % H;
        r.w = (const char *)e->down + (size_t)row * row_bytes(kind, I, a->group);
        r.s = kind == K_INT8 ? (const float *)e->down_scale + row
                             : (const void *)row_scales(e->down_scale, kind, row, I, a->group);
        r.x = e->act, r.res = e->out + row, r.e = q / H;
    } else {
        const tk_args *e = a + q / (2 * I);
        const int up = q % (2 * I) >= I, row = q % I;
        const void *s = up ? e->up_scale : e->gate_scale;
        r.w = (const char *)(up ? e->up : e->gate) + (size_t)row * row_bytes(kind, H, a->group);
        r.s = kind == K_INT8 ? (const float *)s + row : (const void *)row_scales(s, kind, row, H, a->group);
        r.x = e->x, r.res = e->act + (up ? I : 0) + row, r.e = q / (2 * I);
    }
    return r;
}

/* Inside a parallel region: this thread's contiguous share [lo, hi) of `total` items, and the length of its
 * `parts` parts (item i of part j is lo + j * len + i, while below hi: the last part is the shortest). */
typedef struct { int lo, hi, len; } thread_run;
static inline thread_run this_threads_run(int total, int parts) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    thread_run r = {(int)((long)total * t / nt), (int)((long)total * (t + 1) / nt), 0};
    r.len = (r.hi - r.lo + parts - 1) / parts;
    return r;
}

/* Where row q of a one-token pass lies (see one_token_row); `src` is the caller's description of the rows. */
typedef row_ref (*row_lookup)(const void *src, int q);

/* Inside a parallel region: `total` one-token rows of K values, found through `find` (`per` rows a matrix), shared
 * out in one contiguous run per thread; each thread streams its run as four long sequences side by side (row i of
 * each quarter), as the bandwidth probe does. Measured on 2048x768 bf16 experts (with ROWS4_PREFETCH): 0.94 of
 * the probe's bandwidth, against 0.79 for four neighbouring rows at a time (four streams one row long) and 0.86
 * for eight quarters. */
static void stream_rows(row_lookup find, const void *src, int total, int per, int K, int kind, int group,
                        rows4_fn r4, dot_fn dot) {
    const thread_run run = this_threads_run(total, 4);
    const int lo = run.lo, hi = run.hi, len = run.len;
    const size_t rb = row_bytes(kind, K, group);
    const size_t s_step = kind == K_INT8   ? sizeof(float)  /* scale bytes per row */
                          : kind == K_INT4 ? K / group * sizeof(uint16_t) : 0;
    row_ref r[4];
    int left[4] = {0, 0, 0, 0};  /* rows left in the matrix each quarter is in (0: look the next row up) */
    for (int i = 0; i < len; i++) {
        int m = 0;  /* quarters still going: the first m (the last one is the shortest) */
        for (int j = 0; j < 4 && lo + j * len + i < hi; j++, m++)
            if (!left[j]) {  /* a quarter's first row, or the first of the next matrix */
                r[j] = find(src, lo + j * len + i);
                left[j] = per - (lo + j * len + i) % per;
            }
        if (m == 4) {
            const char *w[4] = {r[0].w, r[1].w, r[2].w, r[3].w};
            const void *s[4] = {r[0].s, r[1].s, r[2].s, r[3].s};
            const float *x[4] = {r[0].x, r[1].x, r[2].x, r[3].x};
            float *res[4] = {r[0].res, r[1].res, r[2].res, r[3].res};
            r4(w, s, group, x, K, res);
        } else {
            for (int j = 0; j < m; j++)
                dot(r[j].w, row_scale(r[j].s, kind, 0), kind == K_INT4 ? r[j].s : NULL, group, r[j].x, K, 1, K,
                    r[j].res, 1);
        }
        for (int j = 0; j < m; j++) {  /* each quarter's next row */
            r[j].w += rb, r[j].res++, left[j]--;
            if (s_step) r[j].s = (const char *)r[j].s + s_step;
        }
    }
}

typedef struct { const tk_args *a; int down; } phase_rows;
static row_ref phase_row(const void *src, int q) {
    const phase_rows *p = (const phase_rows *)src;
    return one_token_row(p->a, p->down, q);
}

/* Inside a parallel region: one phase of n one-token experts (gate and up, or down), the rows of all of them in
 * order through stream_rows. Ends with a barrier. */
static void one_token_phase(const tk_args *a, int n, int down, rows4_fn r4, dot_fn dot) {
    const int per = down ? a->hidden : a->inter;  /* rows per matrix */
    const phase_rows src = {a, down};
    stream_rows(phase_row, &src, n * (down ? per : 2 * per), per, down ? a->inter : a->hidden, a->kind, a->group,
                r4, dot);
    #pragma omp barrier
}

/* Inside a parallel region, the SwiGLU phase of n experts: each one's act [tokens, 2I] (gate then up per token)
 * in place, split across threads in blocks of 512 values (AVX-512). */
static inline void experts_swiglu(const tk_args *a, int n) {
    const int I = a->inter, blocks = (I + 511) / 512;
    #pragma omp for schedule(static)
    for (int j = 0; j < n * 16 * blocks; j++) {
        const tk_args *e = a + j / (16 * blocks);
        const int t = j % (16 * blocks) / blocks, lo = j % blocks * 512, hi = lo + 512 < I ? lo + 512 : I;
        if (t < e->tokens) swiglu512(e->act + (size_t)t * 2 * I, I, lo, hi);
    }
}

/* n one-token experts of one layer (one alone: n = 1) in one parallel region, AVX-512 rows four at a time,
 * phase by phase over all of them: gate and up rows, SwiGLU, down rows. Every entry has the same kind and shape
 * and its own buffers. */
static void experts_one_token(const tk_args *a, int n) {
    static const rows4_fn four[5] = {rows4_fp32, rows4_bf16, rows4_fp16, rows4_int8, rows4_int4};
    const rows4_fn r4 = four[a->kind];
    const dot_fn dot = pick_dot(a->kind, a->isa);
    #pragma omp parallel num_threads(a->threads)
    {
        one_token_phase(a, n, 0, r4, dot);
        experts_swiglu(a, n);
        one_token_phase(a, n, 1, r4, dot);
    }
}

static void expert_generic(const tk_args *a) {
    const int T = a->tokens, H = a->hidden, I = a->inter, kind = a->kind, g = a->group;
    const dot_fn dot = pick_dot(kind, a->isa);
    const char *gate = a->gate, *up = a->up, *down = a->down;
    const size_t in_row = row_bytes(kind, H, g), down_row = row_bytes(kind, I, g);
    #pragma omp parallel num_threads(a->threads)
    {
        #pragma omp for schedule(static)
        for (int r = 0; r < 2 * I; r++) {
            const int gate_part = r < I, row = gate_part ? r : r - I;
            const void *s = gate_part ? a->gate_scale : a->up_scale;
            dot((gate_part ? gate : up) + (size_t)row * in_row, row_scale(s, kind, row),
                row_scales(s, kind, row, H, g), g, a->x, H, T, H, a->act + r, 2 * I);
        }
        swiglu_rows(a->act, T, I, a->isa);
        #pragma omp for schedule(static)
        for (int h = 0; h < H; h++)
            dot(down + (size_t)h * down_row, row_scale(a->down_scale, kind, h),
                row_scales(a->down_scale, kind, h, I, g), g, a->act, 2 * I, T, I, a->out + h, H);
    }
}


/* ---- AMX tiles: 2-16 tokens --------------------------------------------------------------------------------
 * bf16: C[rows, tokens] += W[rows, 32 k] . X^T[32 k, tokens], the weight tile loaded straight from the row-major
 * matrix (16 rows, stride = row bytes), activations packed once per call in the pair-interleaved layout the
 * second operand needs (tokens padded to 16 with stale values). Tiles: 0,1 accumulators, 2,3 weights, 4
 * activations; widths a multiple of 32. int8 and int4: C[tokens, rows] against the block layout (below). */
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512bf16")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

static int amx_usable(void) {
    static int state = -1;
    if (state >= 0) return state;
    unsigned a, b, c, d;
    state = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && (d & (1u << 24)) && (d & (1u << 25))
        && (c & (1u << 11)))  /* AMX-BF16, AMX-TILE, AMX-INT8; AVX512-VNNI (the one-token int8 and int4 kernels) */
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;  /* ask Linux for tile state */
    return state;
}

/* Tiles 0-7 at their full 16 rows x 64 bytes. A constant: GCC 12 does not treat ldtilecfg as reading its operand,
 * and a configuration built on the stack lost its row and column stores when the function was not inlined. */
static const tile_config AMX_CONFIG = {
    .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};
/* int4 in groups of 32 values: tile products of 32 values (tokens 4, 7: 32 bytes; weights 5, 6: 8 quads). */
static const tile_config AMX_CONFIG_32 = {
    .palette = 1, .colsb = {64, 64, 64, 64, 32, 64, 64, 32}, .rows = {16, 16, 16, 16, 16, 8, 8, 16}};

AMX_TARGET static void amx_begin(const tile_config *config) { _tile_loadconfig(config); }

/* Chunk c of X [T, K] (row stride ldx) -> packed [16 k-pairs][16 tokens][2] bf16. Columns of tokens >= T keep
 * stale values: they only reach result columns that are never read (so nothing is cleared per call).
 * Called for every chunk inside the parallel region (omp for), so packing is split across threads. */
AMX_TARGET static inline void amx_pack_chunk(const float *x, int ldx, int T, int c, uint16_t *xp) {
    uint16_t *dst = xp + (size_t)c * 512;
    const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));  /* k-pair j -> dword j * 16 */
    for (int t = 0; t < T; t++) {
        const float *src = x + (size_t)t * ldx + c * 32;
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));  /* 16 pairs */
        _mm512_i32scatter_epi32((void *)(dst + t * 2), stride, (__m512i)v, 4);
    }
}

#define AMX_FIXED_TOP 32639.f  /* the token's largest value in the tiles' 16-bit fixed point: hi stays a signed byte */

/* int8 and int4 weights meet the activations as 16-bit fixed point: each token is scaled so its largest value is
 * AMX_FIXED_TOP and rounded (about as fine as bf16 for every value within 2^7 of the largest, finer above), then
 * split into signed bytes x = 256 hi + lo. One tile holds 8 tokens' hi bytes (rows 0-7) and their lo bytes (rows
 * 8-15), so one integer tile product per weight tile gives W.x exactly up to that rounding, for up to 8 tokens:
 * result rows t and 8 + t. Packed chunk c (64 values), 2 KiB: that tile for tokens 0-7, then for 8-15 (tokens
 * >= T: stale, their results never read). */
AMX_TARGET static inline void amx_pack_fixed_chunk(const float *x, int ldx, int T, const float *inv, int c,
                                                   int8_t *xp) {
    int8_t *dst = xp + (size_t)c * 2048;
    for (int t = 0; t < T; t++) {
        const float *src = x + (size_t)t * ldx + c * 64;
        __m128i hq[4], lq[4];
        for (int j = 0; j < 4; j++) {  /* 16 values: rounded to int16, split into bytes */
            const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + j * 16), _mm512_set1_ps(inv[t])));
            const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(v, _mm512_set1_epi32(128)), 8);
            hq[j] = _mm512_cvtepi32_epi8(h);
            lq[j] = _mm512_cvtepi32_epi8(_mm512_sub_epi32(v, _mm512_slli_epi32(h, 8)));
        }
        const __m512i hv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(hq[1], hq[0])),
                                              _mm256_set_m128i(hq[3], hq[2]), 1);
        const __m512i lv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(lq[1], lq[0])),
                                              _mm256_set_m128i(lq[3], lq[2]), 1);
        int8_t *tile = dst + (t / 8) * 1024 + (t % 8) * 64;
        _mm512_storeu_si512((void *)tile, hv);
        _mm512_storeu_si512((void *)(tile + 512), lv);
    }
}

/* Per-token scales for fixed-point activations (AMX int8 and int4, VNNI): scale[t] = max |x_t| / top,
 * inv[t] = 1 / scale[t]. K is a multiple of 16. */
AVX512_TARGET static void token_scales(const float *x, int ldx, int T, int K, float top_value, float *scale,
                                    float *inv) {
    for (int t = 0; t < T; t++) {
        __m512 m = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + (size_t)t * ldx + k)));
        const float top = _mm512_reduce_max_ps(m);
        scale[t] = top >= FLT_MIN * top_value ? top / top_value : 1.f;  /* tinier: inv would overflow; all round to 0 */
        inv[t] = 1.f / scale[t];
    }
}

#define AMX_BATCH 64  /* experts per region at most (their per-token scales live on the stack) */
#define BLOCK_ROWS 16  /* rows per block of the int8/int4 layout: must equal kernels/quant.py BLOCK_ROWS */
_Static_assert(BLOCK_ROWS == 16, "the tile kernels and VNNI lines take blocks of 16 rows");

/* Inside a parallel region: block i of each of the `parts` parts of this thread's run of 16-row blocks in a
 * one-phase pass (gate and up, or down) of quantized experts: k[0..parts), where the missing ones (past the run's
 * end: the last part is the shortest) repeat the first. Returns how many are real (at least 1 for i < run.len). */
static int blocks_of_parts(const tk_args *a, int down, thread_run run, int i, int parts, row_ref *k) {
    int m = 0;
    for (int j = 0; j < parts && run.lo + j * run.len + i < run.hi; j++)
        k[m++] = one_token_row(a, down, (run.lo + j * run.len + i) * BLOCK_ROWS);
    for (int j = m; j < parts; j++) k[j] = k[0];
    return m;
}
#define BLOCK_PREFETCH 1024  /* bytes ahead in each stream of blocks, into L1 (int4 tiles: 2-8 KB, or into L2, no faster) */

/* int4 chunk c of a block (512 bytes: 64 values of its 16 rows, kernels/quant.py) -> dst, the int8 order of a
 * tile's second operand: low nibbles quad l, high nibbles quad l + 8, each q + 8 - 8. */
AMX_TARGET static inline void int4_unpack_chunk(const uint8_t *blk, int c, int8_t dst[16][64]) {
    const __m512i low = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
    for (int l = 0; l < 8; l++) {
        const uint8_t *line = blk + (size_t)c * 512 + l * 64;
        _mm_prefetch((const char *)line + BLOCK_PREFETCH, _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512((const void *)line);
        _mm512_store_si512((void *)dst[l], _mm512_sub_epi8(_mm512_and_si512(v, low), eight));
        _mm512_store_si512((void *)dst[8 + l], _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), eight));
    }
}

/* One 16-row block of an int8 or int4 tile pass for up to 8 tokens: its weights and scales (int8: the rows',
 * int4: [group][row]), the tokens' packed tile (xp) and scales, how many (0-8), and where row i of token t goes
 * (res[t * ldr + i]). */
typedef struct { const void *w, *s; const int8_t *xp; const float *xscale; int T; float *res; } tile_block;
typedef void (*tile_blocks_fn)(const tile_block b[2], int group, int K, int ldr);

/* Two int8 blocks of K values per row (K a multiple of 64) in the block layout (kernels/quant.py), each against its
 * own tokens: res = row scale * token scale * W.x. Each 1 KiB chunk (16 rows x 64 values stored by 4-value column)
 * is a tile's second operand as it lies, loaded with its lines prefetched a little ahead. Tiles: results 0 and 1,
 * tokens 4 and 7, weights 5 and 6. */
AMX_TARGET static void amx_int8_blocks2(const tile_block b[2], int group, int K, int ldr) {
    (void)group;
    int32_t acc[2][16][16] __attribute__((aligned(64)));  /* [block]: rows t (hi sums), 8 + t (lo) */
    const int8_t *w0 = (const int8_t *)b[0].w, *w1 = (const int8_t *)b[1].w;
    const int two = b[1].T > 0;  /* else the second block has no tokens: skipped */
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < K / 64; c++) {
        for (int i = 0; i < 16; i++) {  /* past a block's end: the next block of its stream */
            _mm_prefetch((const char *)w0 + (size_t)c * 1024 + BLOCK_PREFETCH + i * 64, _MM_HINT_T0);
            if (two) _mm_prefetch((const char *)w1 + (size_t)c * 1024 + BLOCK_PREFETCH + i * 64, _MM_HINT_T0);
        }
        _tile_loadd(5, w0 + (size_t)c * 1024, 64);
        _tile_loadd(4, b[0].xp + (size_t)c * 2048, 64);
        _tile_dpbssd(0, 4, 5);
        if (two) {
            _tile_loadd(6, w1 + (size_t)c * 1024, 64);
            _tile_loadd(7, b[1].xp + (size_t)c * 2048, 64);
            _tile_dpbssd(1, 7, 6);
        }
    }
    _tile_stored(0, acc[0], 64);  /* tile numbers are immediates */
    _tile_stored(1, acc[1], 64);
    for (int j = 0; j < 2; j++) {
        const __m512 scale = _mm512_loadu_ps((const float *)b[j].s);
        for (int t = 0; t < b[j].T; t++) {
            const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)acc[j][t])),
                                             _mm512_set1_ps(256.f),
                                             _mm512_cvtepi32_ps(_mm512_load_si512((const void *)acc[j][8 + t])));
            const __m512 both = _mm512_mul_ps(scale, _mm512_set1_ps(b[j].xscale[t]));  /* row and token scales */
            _mm512_storeu_ps(b[j].res + (size_t)t * ldr, _mm512_mul_ps(v, both));
        }
    }
}

/* One group's integer sums of the two blocks (acc: [block][hi rows, lo rows][row]) into f, times their group
 * scales. */
AMX_TARGET static inline void int4_group_sums(int32_t acc[2][16][16], const tile_block b[2], int g, __m512 f[2][8]) {
    for (int j = 0; j < 2; j++) {
        const __m512 scale = LOAD_BF16((const uint16_t *)b[j].s + (size_t)g * BLOCK_ROWS);
        for (int t = 0; t < b[j].T; t++) {
            const __m512i v = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void *)acc[j][t]), 8),
                                               _mm512_load_si512((const void *)acc[j][8 + t]));
            f[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), scale, f[j][t]);
        }
    }
}

/* The int4 result tiles of one group set (odd: 2, 3; even: 0, 1) -> acc; `zero`: cleared for the group after
 * next. Tile numbers are immediates, hence the branches. */
AMX_TARGET static inline void int4_read_out(int odd, int zero, int32_t acc[2][16][16]) {
    if (odd) {
        _tile_stored(2, acc[0], 64);
        _tile_stored(3, acc[1], 64);
        if (zero) {
            _tile_zero(2);
            _tile_zero(3);
        }
    } else {
        _tile_stored(0, acc[0], 64);
        _tile_stored(1, acc[1], 64);
        if (zero) {
            _tile_zero(0);
            _tile_zero(1);
        }
    }
}

/* Two int4 blocks of K values per row (K a multiple of 64), each against its own tokens: res = token scale *
 * Σ over groups of group scale * W.x. Each chunk of the two blocks is unpacked (int4_unpack_chunk) one chunk ahead
 * of the tile products that take it, and each group's products go to one of two pairs of result tiles in turn,
 * read out while the next group's run. Group 32 takes tiles of 32 values (AMX_CONFIG_32: a chunk's low nibbles
 * are one group, its high nibbles the next). Tiles: results 0, 1 (even groups) and 2, 3 (odd), tokens 4 and 7,
 * weights 5 and 6. Measured from DRAM against the bf16 tiles through per-group tables this replaced: 2048x768
 * experts (a layer of 8) at 2, 4 and 8 tokens 0.167 -> 0.109, 0.178 -> 0.121 and 0.187 -> 0.14 ms per expert;
 * 4096x14336 at 8 tokens 5.5 -> 3.9 ms. In L2 the tile products, the unpacking and the group read-outs each take
 * a share; none alone dominates. */
AMX_TARGET static void amx_int4_blocks2(const tile_block b[2], int group, int K, int ldr) {
    const int span = group < 64 ? group : 64, groups = K / group;  /* values per tile product */
    int32_t acc[2][16][16] __attribute__((aligned(64)));
    int8_t wq[2][2][16][64] __attribute__((aligned(64)));  /* [chunk parity][block]: unpacked */
    __m512 f[2][8];  /* [block][token]: 16 rows' sums */
    const int two = b[1].T > 0;  /* else the second block has no tokens: skipped */
    for (int t = 0; t < 8; t++) f[0][t] = f[1][t] = _mm512_setzero_ps();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    int4_unpack_chunk((const uint8_t *)b[0].w, 0, wq[0][0]);
    if (two) int4_unpack_chunk((const uint8_t *)b[1].w, 0, wq[0][1]);
    for (int c = 0; c < K / 64; c++) {
        if (c + 1 < K / 64) {
            int4_unpack_chunk((const uint8_t *)b[0].w, c + 1, wq[(c + 1) & 1][0]);
            if (two) int4_unpack_chunk((const uint8_t *)b[1].w, c + 1, wq[(c + 1) & 1][1]);
        }
        for (int o = 0; o < 64; o += span) {  /* one or two tile products */
            const int g = (c * 64 + o) / group;
            _tile_loadd(5, wq[c & 1][0][o / 4], 64);
            _tile_loadd(4, b[0].xp + (size_t)c * 2048 + o, 64);
            if (two) {
                _tile_loadd(6, wq[c & 1][1][o / 4], 64);
                _tile_loadd(7, b[1].xp + (size_t)c * 2048 + o, 64);
            }
            if (g & 1) {  /* tile numbers are immediates */
                _tile_dpbssd(2, 4, 5);
                if (two) _tile_dpbssd(3, 7, 6);
            } else {
                _tile_dpbssd(0, 4, 5);
                if (two) _tile_dpbssd(1, 7, 6);
            }
            if ((c * 64 + o + span) % group || g == 0) continue;
            int4_read_out(!(g & 1), 1, acc);  /* group g is complete: read out g - 1, whose products are long done */
            int4_group_sums(acc, b, g - 1, f);
        }
    }
    int4_read_out((groups - 1) & 1, 0, acc);  /* the last group */
    int4_group_sums(acc, b, groups - 1, f);
    for (int j = 0; j < 2; j++)
        for (int t = 0; t < b[j].T; t++)
            _mm512_storeu_ps(b[j].res + (size_t)t * ldr, _mm512_mul_ps(f[j][t], _mm512_set1_ps(b[j].xscale[t])));
}

/* Inside a parallel region: one phase of n int8 or int4 experts on AMX tiles (gate and up, or down), their tokens
 * packed (experts_amx). Each thread streams its run of 16-row blocks as two halves side by side, block i of each:
 * on 2048x768 int4 experts at 8 tokens, only streaming and unpacking the blocks that way reached 0.80 of the
 * probe's bandwidth, against 0.61 for neighbouring blocks in pairs. Tokens 8-15 take a second pass, which finds
 * the blocks in cache; a block without tokens there is skipped. Ends with a barrier. */
AMX_TARGET static void fixed_amx_phase(const tk_args *a, int n, int down, float (*xscale)[16]) {
    const int K = down ? a->inter : a->hidden, ldr = down ? a->hidden : 2 * a->inter;
    const tile_blocks_fn blocks2 = a->kind == K_INT8 ? amx_int8_blocks2 : amx_int4_blocks2;
    const thread_run run = this_threads_run(n * ldr / BLOCK_ROWS, 2);
    for (int i = 0; i < run.len; i++) {
        row_ref r[2];
        const int m = blocks_of_parts(a, down, run, i, 2, r);
        for (int h = 0; h < 2; h++) {  /* tokens 0-7, 8-15 */
            tile_block b[2];
            int any = 0;
            for (int j = 0; j < 2; j++) {
                const row_ref *q = r + j;
                const int T = j < m ? a[q->e].tokens - 8 * h : 0;  /* a missing second block: no tokens */
                b[j] = (tile_block){q->w, q->s, (const int8_t *)a[q->e].xb + h * 1024, xscale[q->e] + 8 * h,
                                    T < 0 ? 0 : T > 8 ? 8 : T, q->res + (size_t)8 * h * ldr};
                any |= b[j].T > 0;
            }
            if (any) blocks2(b, a->group, K, ldr);
        }
    }
    #pragma omp barrier
}

/* ---- one token of int8 or int4 on a CPU with AMX: AVX512-VNNI ---------------------------------------------
 * The weights are in the block layout of the AMX tiles (kernels/quant.py): each 64-byte line holds one 4-value
 * column (quad) of a block's 16 rows (int4: two, in the low and high nibbles), and one vpdpbusd multiplies it by
 * that quad of the token, broadcast, into the 16 rows' sums. The token is in 15-bit fixed point x = 128 hi + lo
 * (hi a signed byte, lo in [0, 127]); the weights are made unsigned (int8: w + 128, one xor; int4: the stored
 * q + 8), and the offset is taken off exactly per token (int8: 128 Σ hi and 128 Σ lo) or per group (int4:
 * 8 Σ x). A block needs two accumulators (int4: four), so each thread streams four quarters of its run of blocks
 * side by side (as stream_rows does), every line prefetched a little ahead. Measured on 2048x768 experts, a layer
 * of 8 from DRAM: int8 0.174 -> 0.163 ms per expert against the integer tiles it replaced (0.86 -> 0.91 of the
 * probe), about the speed of a loop that only loads the lines in that order (tiles with the same prefetch gained
 * 1 %); int4 0.103 -> 0.093 ms against the row-major nibbles of each group, one block at a time, it replaced
 * (13 vector operations per 64 weight bytes there, 7 here). */
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define VNNI_TOP 16383.f  /* the token's largest value in fixed point: hi = x >> 7 stays a signed byte */

/* x [K] -> hi bytes [K], lo bytes [K], then {Σ hi, Σ lo} (int32) of each `span` values, at xp. */
VNNI_TARGET static void vnni_pack(const float *x, int K, int span, float inv, int8_t *xp) {
    int32_t *sums = (int32_t *)(xp + 2 * (size_t)K);
    for (int s0 = 0; s0 < K; s0 += span) {
        __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
        for (int k = s0; k < s0 + span; k += 16) {
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), _mm512_set1_ps(inv)));
            const __m512i hi = _mm512_srai_epi32(q, 7), lo = _mm512_and_si512(q, _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(xp + k), _mm512_cvtepi32_epi8(hi));
            _mm_storeu_si128((__m128i *)(xp + K + k), _mm512_cvtepi32_epi8(lo));
            sh = _mm512_add_epi32(sh, hi);
            sl = _mm512_add_epi32(sl, lo);
        }
        sums[2 * (s0 / span)] = _mm512_reduce_add_epi32(sh);
        sums[2 * (s0 / span) + 1] = _mm512_reduce_add_epi32(sl);
    }
}

/* Four blocks (blocks_of_parts: the first m real, the rest repeat the first and are not stored), each found by its
 * first row, of K values per row against their experts' packed tokens (in each one's xb, vnni_pack):
 * res = scale * token scale * W.x. */
typedef void (*vnni_blocks_fn)(const row_ref *, int, int, int, const tk_args *, const float *);

VNNI_TARGET static void int8_vnni_blocks4(const row_ref *k, int m, int K, int group, const tk_args *a,
                                          const float *xscale) {
    (void)group;
    const int8_t *w[4], *xh[4], *xl[4];
    for (int j = 0; j < 4; j++) w[j] = (const int8_t *)k[j].w, xh[j] = (const int8_t *)a[k[j].e].xb, xl[j] = xh[j] + K;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i h[4], l[4];
    for (int j = 0; j < 4; j++) h[j] = l[j] = _mm512_setzero_si512();
    for (int c = 0; c < K / 64; c++) {
        #pragma GCC unroll 16
        for (int q = 0; q < 16; q++) {
            const size_t o = (size_t)c * 1024 + q * 64;
            #pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                int32_t th, tl;
                memcpy(&th, xh[j] + c * 64 + q * 4, 4);
                memcpy(&tl, xl[j] + c * 64 + q * 4, 4);
                _mm_prefetch((const char *)w[j] + o + BLOCK_PREFETCH, _MM_HINT_T0);
                const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w[j] + o)), flip);
                h[j] = _mm512_dpbusd_epi32(h[j], wu, _mm512_set1_epi32(th));
                l[j] = _mm512_dpbusd_epi32(l[j], wu, _mm512_set1_epi32(tl));
            }
        }
    }
    for (int j = 0; j < m; j++) {  /* 128 (Σ w hi) + Σ w lo, each part exact in int32 */
        const int e = k[j].e;
        const int32_t *sums = (const int32_t *)(xh[j] + 2 * (size_t)K);
        const __m512 hs = _mm512_cvtepi32_ps(_mm512_sub_epi32(h[j], _mm512_set1_epi32(128 * sums[0])));
        const __m512 ls = _mm512_cvtepi32_ps(_mm512_sub_epi32(l[j], _mm512_set1_epi32(128 * sums[1])));
        const __m512 v = _mm512_fmadd_ps(hs, _mm512_set1_ps(128.f), ls);
        const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps((const float *)k[j].s), _mm512_set1_ps(xscale[e]));
        _mm512_storeu_ps(k[j].res, _mm512_mul_ps(v, scale));
    }
}

/* Group g's share of an int4 block's sums: 128 (Σ u hi) + Σ u lo - 8 Σ x, exact in int32, times the 16 rows'
 * group scales (sc: the block's scales, [group][row]). */
VNNI_TARGET static inline __m512 int4_group(__m512 f, __m512i h, __m512i l, const int32_t *sums, const uint16_t *sc,
                                           int g) {
    const __m512i d = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(h, 7), l),
                                       _mm512_set1_epi32(8 * (128 * sums[2 * g] + sums[2 * g + 1])));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), LOAD_BF16(sc + (size_t)g * BLOCK_ROWS), f);
}

VNNI_TARGET static void int4_vnni_blocks4(const row_ref *k, int m, int K, int group, const tk_args *a,
                                          const float *xscale) {
    const uint8_t *w[4];
    const int8_t *xh[4], *xl[4];
    const uint16_t *sc[4];
    for (int j = 0; j < 4; j++) {
        w[j] = (const uint8_t *)k[j].w, sc[j] = (const uint16_t *)k[j].s;
        xh[j] = (const int8_t *)a[k[j].e].xb, xl[j] = xh[j] + K;
    }
    const __m512i low = _mm512_set1_epi8(15);
    __m512 f[4];
    __m512i hA[4], lA[4], hB[4], lB[4];  /* the low nibbles' sums, the high nibbles' */
    for (int j = 0; j < 4; j++) {
        f[j] = _mm512_setzero_ps();
        hA[j] = lA[j] = hB[j] = lB[j] = _mm512_setzero_si512();
    }
    for (int c = 0; c < K / 64; c++) {
        #pragma GCC unroll 8
        for (int q = 0; q < 8; q++) {
            const size_t o = (size_t)c * 512 + q * 64;
            #pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                int32_t ha, la, hb, lb;  /* the token's quads q and q + 8 of this chunk */
                memcpy(&ha, xh[j] + c * 64 + q * 4, 4);
                memcpy(&la, xl[j] + c * 64 + q * 4, 4);
                memcpy(&hb, xh[j] + c * 64 + 32 + q * 4, 4);
                memcpy(&lb, xl[j] + c * 64 + 32 + q * 4, 4);
                _mm_prefetch((const char *)w[j] + o + BLOCK_PREFETCH, _MM_HINT_T0);
                const __m512i v = _mm512_loadu_si512((const void *)(w[j] + o));
                const __m512i ua = _mm512_and_si512(v, low), ub = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                hA[j] = _mm512_dpbusd_epi32(hA[j], ua, _mm512_set1_epi32(ha));
                lA[j] = _mm512_dpbusd_epi32(lA[j], ua, _mm512_set1_epi32(la));
                hB[j] = _mm512_dpbusd_epi32(hB[j], ub, _mm512_set1_epi32(hb));
                lB[j] = _mm512_dpbusd_epi32(lB[j], ub, _mm512_set1_epi32(lb));
            }
        }
        if (group > 32 && (c + 1) * 64 % group) continue;  /* no group ends in this chunk */
        for (int j = 0; j < 4; j++) {
            const int32_t *sums = (const int32_t *)(xh[j] + 2 * (size_t)K);
            if (group == 32) {  /* the low nibbles are one group, the high nibbles the next */
                f[j] = int4_group(f[j], hA[j], lA[j], sums, sc[j], 2 * c);
                f[j] = int4_group(f[j], hB[j], lB[j], sums, sc[j], 2 * c + 1);
            } else {
                f[j] = int4_group(f[j], _mm512_add_epi32(hA[j], hB[j]), _mm512_add_epi32(lA[j], lB[j]), sums, sc[j],
                                  c * 64 / group);
            }
            hA[j] = lA[j] = hB[j] = lB[j] = _mm512_setzero_si512();
        }
    }
    for (int j = 0; j < m; j++) _mm512_storeu_ps(k[j].res, _mm512_mul_ps(f[j], _mm512_set1_ps(xscale[k[j].e])));
}

/* Inside a parallel region: one phase of n one-token int8 or int4 experts in their AMX layout (gate and up, or
 * down): each one's token packed into its scratch (xb), then the blocks of all. Ends with a barrier. */
VNNI_TARGET static void vnni_one_token_phase(const tk_args *a, int n, int down, float *xscale) {
    const int K = down ? a->inter : a->hidden;
    const vnni_blocks_fn blocks4 = a->kind == K_INT8 ? int8_vnni_blocks4 : int4_vnni_blocks4;
    #pragma omp for schedule(static)
    for (int e = 0; e < n; e++) {
        const float *x = down ? a[e].act : a[e].x;
        float inv;
        token_scales(x, K, 1, K, VNNI_TOP, &xscale[e], &inv);
        vnni_pack(x, K, a->kind == K_INT8 ? K : a->group, inv, (int8_t *)a[e].xb);
    }
    const thread_run run = this_threads_run(n * (down ? a->hidden : 2 * a->inter) / BLOCK_ROWS, 4);
    for (int i = 0; i < run.len; i++) {  /* block i of each quarter of this thread's run */
        row_ref k[4];
        const int m = blocks_of_parts(a, down, run, i, 4, k);
        blocks4(k, m, K, a->group, a, xscale);
    }
    #pragma omp barrier
}

/* n one-token int8 or int4 experts of one layer in their AMX layout, in one parallel region (one alone: n = 1). */
static void experts_vnni_one_token(const tk_args *a, int n) {
    float xscale[AMX_BATCH];
    #pragma omp parallel num_threads(a->threads)
    {
        vnni_one_token_phase(a, n, 0, xscale);
        experts_swiglu(a, n);
        vnni_one_token_phase(a, n, 1, xscale);
    }
}

/* bf16 rows [r0, r0 + 32) of W [*, K] (row-major, tile-loaded as they lie) against packed bf16 activations:
 * res[t * ldr + r] for t < T. */
AMX_TARGET static void amx_rows32(const uint16_t *w, int r0, int K, const uint16_t *xp, int T, float *res, int ldr) {
    float tmp[2][16][16] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    const uint16_t *a0 = w + (size_t)r0 * K, *a1 = a0 + (size_t)16 * K;
    for (int c = 0; c < K / 32; c++) {
        _tile_loadd(2, a0 + (size_t)c * 32, K * 2);
        _tile_loadd(3, a1 + (size_t)c * 32, K * 2);
        _tile_loadd(4, xp + (size_t)c * 512, 64);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 4);
    }
    _tile_stored(0, tmp[0], 64);
    _tile_stored(1, tmp[1], 64);
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 16; i++)
            for (int t = 0; t < T; t++) res[(size_t)t * ldr + r0 + h * 16 + i] = tmp[h][i][t];
}

/* Bitmask of usable ISA variants: bit ISA_AVX2, ISA_AVX512, ISA_AVX512BF16, ISA_AMX (baseline always works), within
 * the limit set by tk_limit_isas. Every choice and check in this file goes through it, so a limit makes the
 * kernels behave as on a CPU without the features left out. */
static int isa_limit = ~0;

void tk_limit_isas(int allowed) { isa_limit = allowed | (1 << ISA_BASE); }

int tk_isa_mask(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        int m = 1 << ISA_BASE;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) m |= 1 << ISA_AVX2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl"))
            m |= 1 << ISA_AVX512;
        if ((m & (1 << ISA_AVX512)) && __builtin_cpu_supports("avx512bf16")) m |= 1 << ISA_AVX512BF16;
        if ((m & (1 << ISA_AVX512BF16)) && __builtin_cpu_supports("avx512vnni") && amx_usable()) m |= 1 << ISA_AMX;
        cached = m;
    }
    return cached & isa_limit;
}

AMX_TARGET static void experts_amx(const tk_args *a, int n);

/* 0 when the kernel can serve these arguments, else a negative code. */
static int expert_checks(const tk_args *a) {
    if (a->threads < 1 || a->hidden < 1 || a->inter < 1 || a->tokens < 0) return -7;  /* (Python checks first) */
    if (a->kind < K_FP32 || a->kind > K_INT4) return -1;
    if (!(tk_isa_mask() & (1 << a->isa))) return -2;
    if (a->kind == K_INT4 && ((a->group != 32 && a->group != 64 && a->group != 128) || a->hidden % a->group ||
                              a->inter % a->group)) return -3;
    if (a->isa == ISA_AVX512BF16 && (a->kind != K_BF16 || !a->xb || a->inter % 2)) return -4;
    if (a->isa == ISA_AMX) {
        if ((a->kind != K_BF16 && a->kind != K_INT8 && a->kind != K_INT4) || !a->xb || a->tokens > 16 ||
            a->hidden % 32 || a->inter % 32) return -5;
        if (a->kind != K_BF16 && (a->hidden % 64 || a->inter % 64)) return -5;  /* chunks of 64 values */
    }
    return 0;
}

/* The shared parallel region an expert call can join (tk_experts): 0 none (it runs alone), else one of these. */
enum { REGION_NONE, REGION_ROWS, REGION_VNNI_ONE, REGION_AMX, REGIONS };
static int region_of(const tk_args *b) {
    if (b->isa == ISA_AVX512 && b->tokens == 1) return REGION_ROWS;  /* experts_one_token */
    if (b->isa != ISA_AMX) return REGION_NONE;
    if (b->tokens == 1 && b->kind != K_BF16) return REGION_VNNI_ONE;  /* int8, int4 */
    return REGION_AMX;
}

static void run_region(int region, const tk_args *a, int n) {
    switch (region) {
        case REGION_ROWS: experts_one_token(a, n); break;
        case REGION_VNNI_ONE: experts_vnni_one_token(a, n); break;
        default: experts_amx(a, n); break;
    }
}

/* Returns 0 on success, a negative code for arguments the kernel cannot serve. */
int tk_expert(const tk_args *a) {
    if (a->tokens <= 0) return 0;
    const int code = expert_checks(a);
    if (code) return code;
    const int region = region_of(a);
    if (region != REGION_NONE) run_region(region, a, 1);
    else if (a->isa == ISA_AVX512BF16) expert_bf16dp(a);
    else expert_generic(a);
    return 0;
}

/* One expert, or several experts of one layer in one parallel region (decode: the top-k experts of a token),
 * on AMX tiles. Each phase runs over all experts at once, so a layer pays one region and a handful of barriers
 * instead of one set per expert, and the threads stream one long run of rows. Every entry must be an AMX call
 * of the same kind and shape, each with its own buffers. Phases: pack the input, gate and up rows, SwiGLU,
 * pack the activation, down rows. */
AMX_TARGET static void experts_amx(const tk_args *a, int n) {
    const int H = a->hidden, I = a->inter, kind = a->kind, g = a->group;
    const int fixed = kind != K_BF16, step = fixed ? 64 : 32, gate_blocks = I / 32, down_blocks = H / 32;
    float xscale[AMX_BATCH][16], inv[AMX_BATCH][16];  /* int8, int4: per-token fixed-point scales */
    #pragma omp parallel num_threads(a->threads)
    {
        amx_begin(kind == K_INT4 && g == 32 ? &AMX_CONFIG_32 : &AMX_CONFIG);
        if (fixed) {
            #pragma omp for schedule(static)
            for (int e = 0; e < n; e++) token_scales(a[e].x, H, a[e].tokens, H, AMX_FIXED_TOP, xscale[e], inv[e]);
        }
        #pragma omp for schedule(static)
        for (int j = 0; j < n * (H / step); j++) {
            const tk_args *e = a + j / (H / step);
            if (fixed)
                amx_pack_fixed_chunk(e->x, H, e->tokens, inv[j / (H / step)], j % (H / step), (int8_t *)e->xb);
            else amx_pack_chunk(e->x, H, e->tokens, j % (H / step), e->xb);
        }
        if (fixed) fixed_amx_phase(a, n, 0, xscale);
        else {
            #pragma omp for schedule(static)
            for (int j = 0; j < n * 2 * gate_blocks; j++) {
                const tk_args *e = a + j / (2 * gate_blocks);
                const int b = j % (2 * gate_blocks), is_up = b >= gate_blocks, r0 = (is_up ? b - gate_blocks : b) * 32;
                amx_rows32(is_up ? e->up : e->gate, r0, H, e->xb, e->tokens, e->act + (is_up ? I : 0), 2 * I);
            }
        }
        experts_swiglu(a, n);
        if (fixed) {
            #pragma omp for schedule(static)
            for (int e = 0; e < n; e++) token_scales(a[e].act, 2 * I, a[e].tokens, I, AMX_FIXED_TOP, xscale[e], inv[e]);
        }
        #pragma omp for schedule(static)
        for (int j = 0; j < n * (I / step); j++) {
            const tk_args *e = a + j / (I / step);
            if (fixed)
                amx_pack_fixed_chunk(e->act, 2 * I, e->tokens, inv[j / (I / step)], j % (I / step), (int8_t *)e->xb);
            else amx_pack_chunk(e->act, 2 * I, e->tokens, j % (I / step), e->xb);
        }
        if (fixed) fixed_amx_phase(a, n, 1, xscale);
        else {
            #pragma omp for schedule(static)
            for (int j = 0; j < n * down_blocks; j++) {
                const tk_args *e = a + j / down_blocks;
                amx_rows32(e->down, j % down_blocks * 32, I, e->xb, e->tokens, e->out, H);
            }
        }
        _tile_release();
    }
}

/* n experts of one layer (same kind and shape), each with its own tokens and buffers: those that can share a
 * parallel region (region_of: one-token AVX-512 rows, one-token int4 or int8 on an AMX machine, AMX tiles) run
 * in one region per kind of region, AMX_BATCH at a time; the rest, or all when the shapes differ, one after
 * another. Returns 0, or the first negative code of the checks. */
int tk_experts(const tk_args *a, int n) {
    int alike = 1;
    for (int e = 0; e < n; e++) {
        const tk_args *b = a + e;
        if (b->tokens <= 0) continue;
        const int code = expert_checks(b);
        if (code) return code;
        alike = alike && b->kind == a->kind && b->hidden == a->hidden && b->inter == a->inter &&
                b->group == a->group && b->threads == a->threads;
    }
    tk_args group[AMX_BATCH];
    for (int region = REGION_NONE; region < REGIONS; region++) {
        int m = 0;
        for (int e = 0; e < n; e++) {
            if (a[e].tokens <= 0 || (alike ? region_of(a + e) : REGION_NONE) != region) continue;
            if (region == REGION_NONE) {
                tk_expert(a + e);
                continue;
            }
            group[m++] = a[e];
            if (m == AMX_BATCH) run_region(region, group, m), m = 0;
        }
        if (m) run_region(region, group, m);
    }
    return 0;
}

/* ---- a whole MoE layer for a few tokens -------------------------------------------------------------
 * From the router's choice to the weighted sum in one call: the tokens are grouped by expert (experts in id
 * order), each group's rows are copied into a slot of the caller's arena, the groups run through tk_experts
 * (shared parallel regions) `slots` at a time, and each output row, times its routing weight, is added into
 * out. What the decode loop would otherwise do per expert in Python (find the tokens, gather, scale, add). */
typedef struct {
    const void *gate, *up, *down;
    const void *gate_scale, *up_scale, *down_scale;  /* as in tk_args */
} tk_weights;

typedef struct {
    int tokens, top_k, experts, slots;   /* T <= 16, K, experts in the layer, arena slots (<= AMX_BATCH) */
    const int64_t *ids;                  /* [T, K] chosen experts */
    const float *weights;                /* [T, K] their routing weights */
    const float *x;                      /* [T, H] */
    float *out;                          /* [T, H] */
    const tk_weights *table;             /* [experts] */
    char *arena;                         /* slots * tk_moe_slot_bytes(H, I) */
    tk_args proto;                       /* kind, isa, hidden, inter, threads, group of every expert call */
    const uint16_t *x_bf16;              /* NULL, or [T, H] bf16: read instead of x (no float copy made first) */
} tk_moe_args;


/* Scratch per slot: x [16, H], out [16, H], act [16, 2I] float32, xb [16, max(H, I)] 16-bit. */
size_t tk_moe_slot_bytes(int hidden, int inter) {
    const size_t wide = hidden > inter ? hidden : inter;
    return 16 * ((size_t)hidden * 8 + (size_t)inter * 8 + wide * 2);
}

int tk_moe(const tk_moe_args *m) {
    const int T = m->tokens, K = m->top_k, H = m->proto.hidden, I = m->proto.inter;
    if (T <= 0) return 0;
    if (T > 16 || K < 1 || m->slots < 1 || m->slots > AMX_BATCH) return -6;
    if (m->proto.threads < 1 || H < 1 || I < 1) return -7;
    for (int i = 0; i < T * K; i++)
        if (m->ids[i] < 0 || m->ids[i] >= m->experts) return -6;
    memset(m->out, 0, sizeof(float) * (size_t)T * H);
    const size_t per = tk_moe_slot_bytes(H, I);
    tk_args a[AMX_BATCH];
    int rows[AMX_BATCH][16];
    float rw[AMX_BATCH][16];
    int n = 0, left = T * K;  /* jobs in the current round; routings not yet grouped */
    for (int e = 0; e < m->experts && left; e++) {
        int c = 0;
        for (int i = 0; i < T * K; i++) {
            if (m->ids[i] != e) continue;
            if (c == 16) return -6;  /* a token chose this expert twice */
            rows[n][c] = i / K;
            rw[n][c++] = m->weights[i];
        }
        if (!c) continue;
        left -= c;
        char *slot = m->arena + per * (size_t)n;
        a[n] = m->proto;
        a[n].tokens = c;
        a[n].gate = m->table[e].gate, a[n].up = m->table[e].up, a[n].down = m->table[e].down;
        a[n].gate_scale = m->table[e].gate_scale, a[n].up_scale = m->table[e].up_scale;
        a[n].down_scale = m->table[e].down_scale;
        float *x = (float *)slot;
        a[n].x = x, a[n].out = x + 16 * (size_t)H, a[n].act = x + 32 * (size_t)H;
        a[n].xb = (uint16_t *)(a[n].act + 32 * (size_t)I);
        for (int i = 0; i < c; i++) {
            float *dst = x + (size_t)i * H;
            if (m->x_bf16) {
                const uint16_t *src = m->x_bf16 + (size_t)rows[n][i] * H;
                for (int h = 0; h < H; h++) dst[h] = bf16f(src[h]);
            } else {
                memcpy(dst, m->x + (size_t)rows[n][i] * H, sizeof(float) * H);
            }
        }
        if (++n < m->slots && left) continue;
        const int code = tk_experts(a, n);
        if (code) return code;
        for (int j = 0; j < n; j++)
            for (int i = 0; i < a[j].tokens; i++) {
                float *dst = m->out + (size_t)rows[j][i] * H;
                const float *y = a[j].out + (size_t)i * H, w = rw[j][i];
                for (int h = 0; h < H; h++) dst[h] += w * y[h];
            }
        n = 0;
    }
    return 0;
}

/* A dense bf16 matrix for a few tokens (attention projections, routers, lm_head in decode and beams): y [T, O] =
 * x [T, I] . W^T, W [O, I] row-major, through the same kernels as the experts (one token: AVX-512 rows; more: AMX
 * tiles; without those, rows through the dot products of the variant). */
typedef struct {
    int tokens, in, out, threads;
    const uint16_t *w;
    const float *x;                      /* [T, I] */
    float *y;                            /* [T, O] */
    uint16_t *xb;                        /* scratch: 16 * I bf16 */
    uint16_t *yb;                        /* NULL, or [T, O]: y rounded to bf16 as well (nearest even) */
    int isa;                             /* the variant to use, or -1: the best for this CPU and token count */
} tk_linear_args;

/* Outputs [lo, hi) of every token rounded into yb (the same rounding either way). */
static void linear_round(const tk_linear_args *a, int lo, int hi) {
    if (!a->yb) return;
    for (int t = 0; t < a->tokens; t++) {
        const size_t at = (size_t)t * a->out + lo;
        if (tk_isa_mask() & (1 << ISA_AVX512BF16)) to_bf16(a->y + at, a->yb + at, hi - lo);
        else for (int r = 0; r < hi - lo; r++) a->yb[at + r] = bf16_of(a->y[at + r]);
    }
}

AMX_TARGET static void linear_amx(const tk_linear_args *a) {
    #pragma omp parallel num_threads(a->threads)
    {
        amx_begin(&AMX_CONFIG);
        #pragma omp for schedule(static)
        for (int c = 0; c < a->in / 32; c++) amx_pack_chunk(a->x, a->in, a->tokens, c, a->xb);
        #pragma omp for schedule(static)
        for (int b = 0; b < a->out / 32; b++) {
            amx_rows32(a->w, b * 32, a->in, a->xb, a->tokens, a->y, a->out);
            linear_round(a, b * 32, b * 32 + 32);  /* while the block is in cache: no separate pass over y */
        }
        _tile_release();
    }
}

static row_ref linear_row(const void *src, int q) {
    const tk_linear_args *a = (const tk_linear_args *)src;
    const row_ref r = {(const char *)a->w + (size_t)q * a->in * 2, NULL, a->x, a->y + q, 0};
    return r;
}

/* One token: the rows streamed as for one-token experts (stream_rows). Measured per call, Python included:
 * 2048x2048 bf16 0.31 ms, 50304x2048 7.0 ms (0.86 and 0.93 of the probe's bandwidth, against 0.74 and 0.86 on
 * the tiles). */
static void linear_one_token(const tk_linear_args *a) {
    #pragma omp parallel num_threads(a->threads)
    {
        stream_rows(linear_row, a, a->out, a->out, a->in, K_BF16, 0, rows4_bf16, fma_bf16);
        const thread_run run = this_threads_run(a->out, 4);  /* this thread's rows, as stream_rows shared them */
        linear_round(a, run.lo, run.hi);
    }
}

/* Any token count on any variant: pairs of rows, each read once for all tokens, through the experts' dot
 * products (AVX512_BF16: vdpbf16ps against x rounded to bf16, which is exact when x came from bf16). */
static void linear_rows(const tk_linear_args *a, int isa) {
    const int T = a->tokens, I = a->in, O = a->out;
    const dot_fn dot = pick_dot(K_BF16, isa);
    #pragma omp parallel num_threads(a->threads)
    {
        if (isa == ISA_AVX512BF16) {
            #pragma omp for schedule(static)
            for (int t = 0; t < T; t++) to_bf16(a->x + (size_t)t * I, a->xb + (size_t)t * I, I);
        }
        #pragma omp for schedule(static)
        for (int r = 0; r < O; r += 32) {  /* O is a multiple of 32 (checked) */
            for (int q = r; q < r + 32; q += 2) {
                const uint16_t *w = a->w + (size_t)q * I;
                if (isa == ISA_AVX512BF16) dot2_bf16_dp(w, w + I, a->xb, NULL, I, T, I, a->y + q, O);
                else for (int j = 0; j < 2; j++) dot(w + (size_t)j * I, 1.f, NULL, 0, a->x, I, T, I, a->y + q + j, O);
            }
            linear_round(a, r, r + 32);
        }
    }
}

/* The variant as asked (or, for -1, the best: one token on the AVX-512 rows, more on AMX tiles, else the rows of
 * the best dot product). Returns 0, or a negative code for arguments the kernel cannot serve. */
int tk_linear(const tk_linear_args *a) {
    if (a->tokens <= 0) return 0;
    if (a->tokens > 16 || a->in % 32 || a->out % 32) return -5;
    if (a->threads < 1 || a->in < 1 || a->out < 1) return -7;
    const int mask = tk_isa_mask();
    int isa = a->isa;
    if (isa < 0) {
        isa = ISA_BASE;
        while (isa < ISA_AMX && (mask & (1 << (isa + 1)))) isa++;
        if (a->tokens == 1 && isa >= ISA_AVX512) isa = ISA_AVX512;
    }
    if (isa < ISA_BASE || isa > ISA_AMX || !(mask & (1 << isa))) return -2;
    if (isa == ISA_AMX) linear_amx(a);
    else if (isa == ISA_AVX512 && a->tokens == 1) linear_one_token(a);
    else linear_rows(a, isa);
    return 0;
}

/* RMSNorm of bf16 or float32 rows exactly as the reference rounds it (runtime/model.py rms_norm), in float32:
 * bf16 x (q/k norms): h = bf16(x * 1/sqrt(mean(x^2) + eps)), y = bf16(h * w); float32 x (the residual stream):
 * y = bf16(x * 1/sqrt(...) * w), rounded once. One call instead of seven small torch ops per norm (the decode loop
 * runs two to four per layer). Row r of x starts at x + r * ldx (in elements); y is [rows, n]. */
static inline float norm_value(const void *x, int f32, size_t i) {
    return f32 ? ((const float *)x)[i] : bf16f(((const uint16_t *)x)[i]);
}

static void rms_norm_rows(const void *x, int f32, size_t ldx, const uint16_t *w, uint16_t *y, int rows, int n,
                          float eps) {
    for (int r = 0; r < rows; r++) {
        const size_t row = (size_t)r * ldx;
        float part[16] = {0};
        int i = 0;
        for (; i + 16 <= n; i += 16)
            for (int j = 0; j < 16; j++) { const float v = norm_value(x, f32, row + i + j); part[j] += v * v; }
        float ss = 0;
        for (; i < n; i++) { const float v = norm_value(x, f32, row + i); ss += v * v; }
        for (int j = 0; j < 16; j++) ss += part[j];
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
        uint16_t *yr = y + (size_t)r * n;
        for (i = 0; i < n; i++) {
            const float h = norm_value(x, f32, row + i) * inv;
            yr[i] = bf16_of((f32 ? h : bf16f(bf16_of(h))) * bf16f(w[i]));
        }
    }
}

void tk_rms_norm_bf16(const uint16_t *x, size_t ldx, const uint16_t *w, uint16_t *y, int rows, int n, float eps) {
    if (rows < 1 || n < 1) return;
    rms_norm_rows(x, 0, ldx, w, y, rows, n, eps);
}

void tk_rms_norm_f32(const float *x, size_t ldx, const uint16_t *w, uint16_t *y, int rows, int n, float eps) {
    if (rows < 1 || n < 1) return;
    rms_norm_rows(x, 1, ldx, w, y, rows, n, eps);
}

/* The size of each argument struct Python fills through ctypes (0 tk_args, 1 tk_weights, 2 tk_moe_args,
 * 3 tk_linear_args; 0 for any other): kernels/cpu.py compares them with its own structures when it loads the
 * library, so a layout that drifted on one side is refused before it can corrupt memory. */
size_t tk_struct_size(int which) {
    switch (which) {
        case 0: return sizeof(tk_args);
        case 1: return sizeof(tk_weights);
        case 2: return sizeof(tk_moe_args);
        case 3: return sizeof(tk_linear_args);
        default: return 0;
    }
}

/* Streaming read bandwidth probe: sums n floats with `threads` threads (the result defeats dead-code removal).
 * Each thread reads its share as 8 streams side by side: measured here, one stream per thread reaches only
 * about 0.75 of what the memory system delivers to the expert kernels, which keep many rows in flight. */
#define PROBE_STREAMS 8
/* Plain C that the compiler vectorises for the target (8 lanes: one AVX2 vector, two SSE2 ones), so that without
 * AVX2 the probe still measures the memory, not a chain of dependent scalar adds. */
#define DEFINE_SUM(NAME, ATTR)                                                                              \
ATTR static double NAME(const float *p, size_t n, int threads) {                                            \
    double total = 0;                                                                                       \
    _Pragma("omp parallel num_threads(threads) reduction(+:total)")                                         \
    {                                                                                                       \
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();                                     \
        const size_t lo = n / nt * t, hi = t == nt - 1 ? n : n / nt * (t + 1);                              \
        const size_t seg = (hi - lo) / PROBE_STREAMS / 8 * 8;  /* floats per stream, whole groups of 8 */   \
        float acc[PROBE_STREAMS][8] = {{0}};                                                                \
        for (size_t i = 0; i < seg; i += 8)                                                                 \
            for (int s = 0; s < PROBE_STREAMS; s++)                                                         \
                for (int j = 0; j < 8; j++) acc[s][j] += p[lo + s * seg + i + j];                           \
        for (int s = 0; s < PROBE_STREAMS; s++)                                                             \
            for (int j = 0; j < 8; j++) total += acc[s][j];                                                 \
        for (size_t i = lo + PROBE_STREAMS * seg; i < hi; i++) total += p[i];  /* the tail */               \
    }                                                                                                       \
    return total;                                                                                           \
}
DEFINE_SUM(sum_base, )
DEFINE_SUM(sum_avx2, __attribute__((target("avx2,fma"))))

double tk_read_sum(const float *p, size_t n, int threads) {
    if (threads < 1) threads = 1;
    return (tk_isa_mask() & (1 << ISA_AVX2)) ? sum_avx2(p, n, threads) : sum_base(p, n, threads);
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu", "Tandem CPU expert kernels (called via ctypes).", -1, NULL};
PyMODINIT_FUNC PyInit__cpu(void) { return PyModule_Create(&module); }
