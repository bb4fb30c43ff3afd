/* Tandem CPU expert kernels: what every file of the library shares.
 *
 * One SwiGLU expert, out = down(silu(gate x) * up x), for a few tokens. Decode is bound by how fast the weights
 * stream from DRAM, so every weight row is read once, as one sequential stream, and reused for all tokens of the
 * call while it sits in L1. The whole expert runs in one OpenMP region: gate and up rows (one fused pass over 2I
 * rows), then the activation, then down rows.
 *
 * Weight kinds: fp32, bf16, fp16 (row-major [rows, cols]); int8 with one float scale per row; int4 with one
 * bf16 scale per group of `group` values, stored as bytes whose low nibble is element j and high nibble
 * element j + group/2 of the group (values offset by 8); MXFP4 (gpt-oss): blocks of 32 FP4 (E2M1) values in
 * 16 bytes laid out as int4's groups of 32, with one E8M0 scale byte per block (its value 2^(e-127)); and GGUF's
 * block formats (Q8_0 ... Q6_K, MXFP4) with their scales inside the rows (blocks.h). Activations are float32.
 *
 * The activation is SwiGLU, or gpt-oss's clamped SwiGLU (`act_kind`, with `alpha` and `limit`); gate, up and down may
 * have biases (float32), added where the reference adds them: gate and up before the activation, down to the result.
 *
 * ISA variants are separate functions compiled with target attributes (every file gets the same compile flags),
 * chosen at run time from what the CPU supports (or forced by the caller), one file each:
 *   base.c        plain C for any x86-64 CPU, and the drivers every variant's dot products share
 *                 (expert_generic, linear_rows); RMSNorm; the bandwidth probe's loop
 *   avx2.c        the same C loops compiled for AVX2+FMA+F16C, MXFP4 with pshufb lookups, and one token as
 *                 four rows at a time (every weight kind's float path) with the SwiGLU activation 8 lanes at a time
 *   avx512.c      AVX-512: rows against up to 8 tokens; one token four rows at a time for every weight kind
 *   rows.c        one token's rows as four long runs per thread (stream_rows) through a variant's four-row kernels,
 *                 experts (experts_one_token) and dense matrices (linear_one_token), AVX2 and AVX-512 alike
 *   avx512bf16.c  bf16 weights against bf16 activations with vdpbf16ps; one token of MXFP4 likewise (vpermw
 *                 lookups of the codes' bf16 values)
 *   amx.c         AMX tiles for 2-16 tokens: bf16 weights, and int8/int4 in the block layout of
 *                 kernels/quant.py against 16-bit fixed-point activations
 *   vnni.c        on AMX machines, one token of int8/int4 (block layout) with AVX512-VNNI, 15-bit fixed point
 *   blocks.h      GGUF's block formats: each block unpacked into L1, the dot products every variant compiles
 *   q8.c          GGUF blocks (and several tokens of MXFP4 experts) against int8 activations, one token or many
 *                 (AVX-512 BW and VNNI; the AVX512_BF16 variant)
 *   q8avx2.c      the same sums for every GGUF format but MXFP4 in 256-bit vectors (the AVX2 variant), one token
 *                 four rows at a time too
 *   attend.c      one new token per sequence through attention (RoPE, the KV cache write, an online softmax),
 *                 its loops compiled for base, AVX2 and AVX-512
 *   step.c        one decode token through a run of planned layers (norms, projections, attention, routing,
 *                 experts) in one call
 *   api.c         what Python calls through ctypes: the ISA mask, the checks, the choice of variant, several
 *                 experts in shared parallel regions (tk_experts), a whole MoE layer (tk_moe), dense matrices
 *                 (tk_linear), the argument struct sizes, and the module init that makes it importable
 * Functions one file gives another are declared here, hidden from the library's exported symbols (TK_INTERNAL).
 *
 * Letters: T tokens, H hidden size, I expert width, K values per row.
 */
#ifndef TANDEM_KERNELS_COMMON_H
#define TANDEM_KERNELS_COMMON_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <immintrin.h>

enum { K_FP32 = 0, K_BF16 = 1, K_FP16 = 2, K_INT8 = 3, K_INT4 = 4, K_MXFP4 = 5,
       /* GGUF's block formats, rows as the file stores them (blocks.h) */
       K_Q8_0 = 6, K_Q4_0 = 7, K_Q4_1 = 8, K_Q5_0 = 9, K_Q5_1 = 10, K_Q4_K = 11, K_Q5_K = 12, K_Q6_K = 13,
       K_GMXFP4 = 14, KINDS };
#define IS_BLOCK_KIND(k) ((k) >= K_Q8_0 && (k) < KINDS)
/* silu(g) * u; gpt-oss: g' = min(g, limit), (clamp(u) + 1) * g' sigmoid(alpha g'); Gemma: gelu_tanh(g) * u */
enum { ACT_SILU = 0, ACT_CLAMPED = 1, ACT_GELU_TANH = 2 };
enum { ISA_BASE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3, ISA_AMX = 4 };

/* Called from another file of the library, not exported: only the tk_ functions of api.c and base.c are. */
#define TK_INTERNAL __attribute__((visibility("hidden")))

/* Instruction sets per function (the AVX2 loops name theirs where they are instantiated, avx2.c). */
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512bf16")))
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

/* ---- argument structs, filled by kernels/library.py's structures through ctypes (tk_struct_size reports their sizes) --- */
/* One new token per sequence through attention (tk_attend_one, attend.c). */
typedef struct {
    int batch, heads, kv_heads, dim, rot;  /* B, Hq, Hkv, D, R */
    int bf16;                              /* 1: q, k, v, cos, sin, the cache, sinks and out are bf16; 0: float32 */
    int threads, isa;                      /* isa: ISA_BASE, ISA_AVX2 or ISA_AVX512 (the loops' compiled variant) */
    int start, first;                      /* the new token's position; the first position read (a sliding window) */
    long long ld_q, ld_k, ld_v;            /* values from one sequence's q (k, v) to the next's; heads are D apart */
    long long context;                     /* positions in a cache row */
    const void *q, *k, *v;                 /* [B, Hq * D], [B, Hkv * D], [B, Hkv * D] */
    const void *cos, *sin;                 /* [R] at `start`; with `starts`, the tables [positions, R] */
    void *kcache, *vcache;                 /* this layer's [B, Hkv, context, D], contiguous */
    const void *sinks;                     /* NULL, or [Hq] */
    float scale;                           /* multiplies q . k (1/sqrt(D)) */
    void *out;                             /* [B, Hq * D] */
    /* Sequences at positions of their own (continuous batching), or NULL: sequence b is cache row b at `start`,
     * reading from `first`. Else sequence b is cache row rows[b] (distinct rows) at position starts[b], its RoPE
     * row starts[b] of the tables, and reads from starts[b] + 1 - window (0 without a window), or from the start
     * of its chunk of `chunk` positions (Llama 4's chunked attention; 0: none). */
    const int *rows, *starts;
    int window, chunk;
} tk_attend_args;

/* One expert call (tk_expert; tk_experts takes an array of them). */
typedef struct {
    int kind, isa, tokens, hidden, inter, threads, group;
    const void *gate, *up, *down;        /* [I, H], [I, H], [H, I] */
    const void *gate_scale, *up_scale, *down_scale;  /* int8: float per row; int4: bf16 [rows, groups]; MXFP4:
                                                      * E8M0 bytes [rows, blocks] */
    const float *x;                      /* [T, H] */
    float *out;                          /* [T, H] */
    float *act;                          /* scratch [T, 2I] */
    uint16_t *xb;                        /* scratch: max(T, 16) rows of max(H, I) + XB_EXTRA 16-bit values (AVX512_BF16,
                                          * AMX and VNNI paths) */
    const float *gate_bias, *up_bias, *down_bias;  /* NULL, or [I], [I], [H] */
    int act_kind;                        /* ACT_SILU or ACT_CLAMPED */
    float alpha, limit;                  /* ACT_CLAMPED's */
    int down_kind;                       /* down's kind: `kind`, or another block kind when gate and up are blocks
                                          * (GGUF's Q4_K_M keeps some down matrices in Q6_K) */
} tk_args;

/* One expert of a MoE layer (tk_moe). */
typedef struct {
    const void *gate, *up, *down;
    const void *gate_scale, *up_scale, *down_scale;  /* as in tk_args */
    const float *gate_bias, *up_bias, *down_bias;    /* as in tk_args */
} tk_weights;

typedef struct {
    int tokens, top_k, experts, slots;   /* T, K, experts in the layer, arena slots (<= AMX_BATCH) */
    int chunk;                           /* tokens per expert call at most (<= BLOCK_TOKENS) */
    const int64_t *ids;                  /* [T, K] chosen experts */
    const float *weights;                /* [T, K] their routing weights */
    const float *x;                      /* [T, H] */
    float *out;                          /* [T, H] */
    const tk_weights *table;             /* [experts] */
    char *arena;                         /* slots * tk_moe_slot_bytes(H, I, chunk) */
    tk_args proto;                       /* kind, isa, hidden, inter, threads, group of every expert call */
    const uint16_t *x_bf16;              /* NULL, or [T, H] bf16: read instead of x (no float copy made first) */
} tk_moe_args;

/* A dense matrix for a few tokens (attention projections, routers, lm_head in decode and beams): y [T, O] =
 * x [T, I] . W^T, W [O, I] row-major, through the same kernels as the experts (one token: AVX-512 rows; more: AMX
 * tiles; without those, rows through the dot products of the variant). bf16, or a GGUF block kind (its rows as
 * stored; AVX-512 rows at most). */
typedef struct {
    int tokens, in, out, threads;
    const void *w;
    const float *x;                      /* [T, I] */
    float *y;                            /* [T, O] */
    uint16_t *xb;                        /* scratch: max(T, 16) rows of I + XB_EXTRA 16-bit values */
    uint16_t *yb;                        /* NULL, or [T, O]: y rounded to bf16 as well (nearest even) */
    int isa;                             /* the variant to use, or -1: the best for this CPU and token count */
    int kind;                            /* K_BF16 or a block kind */
} tk_linear_args;

/* One decoder layer of one decode token (tk_decode_layers, step.c), planned once: weights, buffers, variants. The
 * compute dtype is bf16 (f32 = 0: activations rounded to bf16 where the torch path rounds them, as the types below
 * say) or float32 (f32 = 1: every one of them float32, norms' weights and the KV cache too; h unused). */
typedef struct {
    int hidden, n_qkv;                   /* H; q, k and v as 1 stacked matrix or 3 (formats that differ) */
    int qk_norm;                         /* QK_NORM_NONE, _FULL (over all heads: OLMoE) or _HEAD (per head: Qwen3) */
    int scoring, normalize, window;      /* SCORE_SOFTMAX, _SOFTMAX_TOPK or _SIGMOID; weights scaled to sum to 1;
                                          * 0 or a sliding window's length */
    float eps, scaling;                  /* the norms' epsilon; the routing weights' factor */
    const void *input_norm, *post_norm, *q_norm, *k_norm;  /* bf16: [H], [H], the q/k norms' ([Hq*D] or [D]) */
    uint16_t *h;                         /* [H] bf16: the normed residual stream */
    float *hf;                           /* [H] the same as float32: the projections' and the router's input */
    void *qkv_out;                       /* [(Hq + 2 Hkv) * D] bf16: q, k, v (attend.q, .k, .v point into it) */
    void *attend_out;                    /* [Hq * D] bf16: attend.out */
    const void *qkv_bias, *router_bias;  /* NULL, or bf16 [qkv_rows], [E]: added to the rounded outputs */
    const float *o_bias;                 /* NULL, or [H]: added to o's float32 sums */
    tk_linear_args qkv[4], o, router;    /* o.x: attend_out as float32 (a mixer's output); o.y: [H] float32;
                                          * router.yb: [E] bf16. q, k, v and gates: 1 stacked matrix, or parts */
    tk_attend_args attend;               /* start and first are set per token */
    tk_moe_args moe;                     /* x_bf16: h; ids, weights: [K] chosen here; out: [H] float32 */
    int f32;                             /* 1: float32 compute */
    const float *correction;             /* NULL, or [E]: added to the scores for choosing only (DeepSeek-V3's) */
    /* The layer's own SwiGLU: FFN_ROUTED (none), FFN_SHARED (a shared expert beside the routed ones) or FFN_DENSE
     * (the layer's only feed-forward: no router, no experts). gate and up read hf into mlp_gate, mlp_up ([I] bf16;
     * float32 under f32), down reads mlp_h ([I] float32: silu(gate) * up as the torch path rounds it) into mlp_out
     * ([H] bf16; float32 under f32). */
    int ffn, mlp_inter;
    tk_linear_args mlp[3];
    void *mlp_gate, *mlp_up, *mlp_out;
    float *mlp_h;
    /* A shared expert behind a gate (Qwen2-MoE, Qwen3-Next): NULL, or [H] float32; its SwiGLU's output times
     * sigmoid(gate . hf), rounded where the torch path rounds (bf16: the sum, the sigmoid, the product). */
    const float *shared_gate;
    float residual;                      /* each output times this as it joins the stream (muP's; else 1) */
    int qkv_rows, attn_gate;             /* q, k, v (and gates) in qkv_out; 1: gated attention, each query value's
                                          * output times sigmoid(its gate), the gates after v */
    /* The token mixer: MIX_ATTENTION (the fields above), or a recurrent one (MIX_DELTANET, _SSM, _SHORTCONV):
     * its input projection (n_proj parts side by side into mix_p: bf16, or float32 under f32; proj_rows of them
     * read, proj_bias added), the step over its state (recur: the kind's tk_*_args, reading mix_pf, [proj_rows]
     * float32, writing mix_out, [mix_inner] float32), then o reading it (rounded to bf16 first under bf16). */
    int mixer, n_proj, proj_rows, mix_inner;
    tk_linear_args proj[4];
    const void *proj_bias;
    void *mix_p;
    float *mix_pf, *mix_out;
    const void *recur;
} tk_layer_args;

/* One token of the hybrids' recurrent mixers per sequence (recur.c): float32 throughout; row b's projections at
 * p + b * ld_p, its states contiguous after row b - 1's, `work` [B, channels] scratch. */
typedef struct {
    int batch, key_heads, value_heads, key_dim, value_dim, conv_k, tiled, threads, isa;
    float eps;
    long long ld_p;
    const float *p, *conv_w, *A, *dt_bias, *norm_w;
    float *conv, *ssm, *work, *out;
} tk_deltanet_args;

typedef struct {
    int batch, heads, head_dim, state, groups, conv_k, threads, isa;
    float eps, dt_min, dt_max;
    long long ld_p;
    const float *p, *conv_w, *conv_b, *A, *dt_bias, *D, *norm_w;
    float *conv, *ssm, *work, *out;
} tk_ssm_args;

typedef struct {
    int batch, hidden, conv_k, threads;
    long long ld_p;
    const float *p, *conv_w, *conv_b;
    float *conv, *out;
} tk_shortconv_args;

/* ---- values: bf16, weight kinds to float32 -------------------------------------------------------------- */
static inline float bf16f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t bf16_of(float f) {  /* round to nearest even; NaN -> quiet NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#define IDENT(v) (v)
#define I8(v) ((float)(v))
#define F16(v) ((float)(v))
#define LOAD_FP32(p) _mm512_loadu_ps((const float *)(p))
#define LOAD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define LOAD_FP16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LOAD_INT8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
static inline float silu(float g) { return g / (1.f + expf(-g)); }
#define GELU_2C 1.5957691216057308f  /* 2 sqrt(2 / pi) */
/* GELU with tanh's approximation, 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), as g sigmoid(2 sqrt(2/pi) (...)) */
static inline float gelu_tanh(float g) { return g / (1.f + expf(-GELU_2C * (g + 0.044715f * g * g * g))); }

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
    const uint16_t *gs = (const uint16_t *)gscale;                                                 \
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
            total += a * bf16f(gs[g]);                                                             \
        }                                                                                          \
        res[(size_t)t * ldr] = total;                                                              \
    }

/* MXFP4: a block's 32 values, twice their E2M1 value, as small integers (0.5 steps are whole here), and half its
 * E8M0 scale, 2^(e-128) (subnormal below e = 2): so value = E2M1X2[code] * e8m0_half(e), the product the GGUF
 * reference computes, exactly (both factors are exact in float32 and their product is a power of two times a small
 * integer). */
static const float E2M1X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static inline float e8m0_half(uint8_t e) {
    const uint32_t u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#define MXFP4_BODY                                                                                 \
    const uint8_t *w = (const uint8_t *)wrow, *gs = (const uint8_t *)gscale;                       \
    (void)group;                                                                                   \
    for (int t = 0; t < nt; t++) {                                                                 \
        const float *xt = x + (size_t)t * ldx;                                                     \
        float total = 0.f;                                                                         \
        for (int g = 0; g < n / 32; g++) {                                                         \
            const uint8_t *q = w + (size_t)g * 16;                                                 \
            const float *xg = xt + (size_t)g * 32;                                                 \
            float a = 0.f;                                                                         \
            _Pragma("omp simd reduction(+:a)")                                                     \
            for (int j = 0; j < 16; j++) a += E2M1X2[q[j] & 15] * xg[j] + E2M1X2[q[j] >> 4] * xg[j + 16]; \
            total += a * e8m0_half(gs[g]);                                                         \
        }                                                                                          \
        res[(size_t)t * ldr] = total;                                                              \
    }

/* dot_fn: one weight row against nt tokens (row stride ldx), result t at res[t * ldr]: scale * (w . x_t) (int8; 1
 * for float weights), or the sum over groups of the group's scale (gscale: int4's bf16 scales, MXFP4's E8M0 bytes)
 * times (w_g . x_t,g). */
typedef void dot_kernel(const void *wrow, float scale, const void *gscale, int group, const float *x, int ldx,
                        int nt, int n, float *res, int ldr);
typedef dot_kernel *dot_fn;
#define DEFINE_DOTS(SUFFIX, ATTR)                                                                  \
ATTR void dot_fp32_##SUFFIX(const void *wrow, float scale, const void *gscale, int group,              \
        const float *x, int ldx, int nt, int n, float *res, int ldr) { (void)gscale; (void)group; DOT_BODY(float, IDENT) } \
ATTR void dot_bf16_##SUFFIX(const void *wrow, float scale, const void *gscale, int group,              \
        const float *x, int ldx, int nt, int n, float *res, int ldr) { (void)gscale; (void)group; DOT_BODY(uint16_t, bf16f) } \
ATTR void dot_fp16_##SUFFIX(const void *wrow, float scale, const void *gscale, int group,              \
        const float *x, int ldx, int nt, int n, float *res, int ldr) { (void)gscale; (void)group; DOT_BODY(_Float16, F16) } \
ATTR void dot_int8_##SUFFIX(const void *wrow, float scale, const void *gscale, int group,              \
        const float *x, int ldx, int nt, int n, float *res, int ldr) { (void)gscale; (void)group; DOT_BODY(int8_t, I8) } \
ATTR void dot_int4_##SUFFIX(const void *wrow, float scale, const void *gscale, int group,              \
        const float *x, int ldx, int nt, int n, float *res, int ldr) { (void)scale; INT4_BODY }

/* The bandwidth probe's loop (tk_read_sum): sums n floats with `threads` threads, each reading its share as
 * `streams` streams side by side (1 to PROBE_STREAMS). Plain C that the compiler vectorises for the target (8 lanes:
 * one AVX2 vector, two SSE2 ones), so that without AVX2 the probe still measures the memory, not a chain of
 * dependent scalar adds. The stream count is a constant in each copy of the loop (SUM_LOOP), so each keeps its
 * sums in registers. */
#define PROBE_STREAMS 8
#define SUM_LOOP(S)                                                                                         \
    {                                                                                                       \
        const size_t seg = (hi - lo) / (S) / 8 * 8;  /* floats per stream, whole groups of 8 */             \
        float acc[S][8] = {{0}};                                                                            \
        for (size_t i = 0; i < seg; i += 8)                                                                 \
            for (int s = 0; s < (S); s++)                                                                   \
                for (int j = 0; j < 8; j++) acc[s][j] += p[lo + s * seg + i + j];                           \
        for (int s = 0; s < (S); s++)                                                                       \
            for (int j = 0; j < 8; j++) total += acc[s][j];                                                 \
        for (size_t i = lo + (S) * seg; i < hi; i++) total += p[i];  /* the tail */                         \
    }
#define DEFINE_SUM(NAME, ATTR)                                                                              \
ATTR double NAME(const float *p, size_t n, int threads, int streams) {                                      \
    double total = 0;                                                                                       \
    _Pragma("omp parallel num_threads(threads) reduction(+:total)")                                         \
    {                                                                                                       \
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();                                     \
        const size_t lo = n / nt * t, hi = t == nt - 1 ? n : n / nt * (t + 1);                              \
        switch (streams) {                                                                                  \
            case 1: SUM_LOOP(1) break;                                                                      \
            case 2: SUM_LOOP(2) break;                                                                      \
            case 4: SUM_LOOP(4) break;                                                                      \
            default: SUM_LOOP(PROBE_STREAMS) break;                                                         \
        }                                                                                                   \
    }                                                                                                       \
    return total;                                                                                           \
}

/* One token's rows four at a time (avx512.c stream_rows): rows[j] against x[j] into *res[j], with their scales. */
typedef void (*rows4_fn)(const char *const *, const void *const *, int, const float *const *, int, float *const *);
/* The four-row kernels ask for each line this many bytes ahead: 2 KB was the best of none, 512 bytes, 2 KB and 4 KB
 * on 2048x768 and 4096x14336 experts (bf16 and fp16). Figures: docs/bench/kernels.md. */
#define ROWS4_PREFETCH 2048
#define PREFETCH_AHEAD(p) _mm_prefetch((const char *)(p) + ROWS4_PREFETCH, _MM_HINT_T0)

/* ---- exported: what kernels/library.py loads through ctypes (api.c; RMSNorm in base.c) ----------------------- */
void tk_limit_isas(int allowed);
int tk_isa_mask(void);
int tk_expert(const tk_args *a);
int tk_experts(const tk_args *a, int n);
size_t tk_moe_slot_bytes(int hidden, int inter, int tokens);
int tk_moe(const tk_moe_args *m);
int tk_linear(const tk_linear_args *a);
void tk_rms_norm_bf16(const uint16_t *x, size_t ldx, const uint16_t *w, uint16_t *y, int rows, int n, float eps);
void tk_rms_norm_f32(const float *x, size_t ldx, const uint16_t *w, uint16_t *y, int rows, int n, float eps);
void tk_rms_norm_float(const float *x, size_t ldx, const float *w, float *y, int rows, int n, float eps);
int tk_dequantize_rows(int kind, const uint8_t *data, int64_t rows, const int64_t *ids, int n, int cols,
                       float *out);
int tk_attend_one(const tk_attend_args *a);
int tk_deltanet_step(const tk_deltanet_args *a);
int tk_ssm_step(const tk_ssm_args *a);
int tk_shortconv_step(const tk_shortconv_args *a);
int tk_decode_layers(tk_layer_args *layers, int n, float *x, int start, const void *cos, const void *sin);
size_t tk_struct_size(int which);
double tk_read_sum(const float *p, size_t n, int threads, int streams);

/* ---- what each file gives the others --------------------------------------------------------------- */
/* base.c */
TK_INTERNAL dot_kernel dot_fp32_base, dot_bf16_base, dot_fp16_base, dot_int8_base, dot_int4_base, dot_mxfp4_base;
TK_INTERNAL void expert_generic(const tk_args *a);
TK_INTERNAL void linear_round(const tk_linear_args *a, int lo, int hi);
TK_INTERNAL void linear_rows(const tk_linear_args *a, int isa);
TK_INTERNAL double sum_base(const float *p, size_t n, int threads, int streams);
/* avx2.c */
TK_INTERNAL dot_kernel dot_fp32_avx2, dot_bf16_avx2, dot_fp16_avx2, dot_int8_avx2, dot_int4_avx2, dot_mxfp4_avx2;
TK_INTERNAL double sum_avx2(const float *p, size_t n, int threads, int streams);
TK_INTERNAL rows4_fn rows4_avx2(int kind);
TK_INTERNAL dot_kernel fma8_fp32, fma8_bf16, fma8_fp16, fma8_int8;
TK_INTERNAL __attribute__((target("avx2,fma,f16c"))) void swiglu256(float *g, int I, int lo, int hi);
TK_INTERNAL __attribute__((target("avx2,fma,f16c"))) void geglu256(float *g, int I, int lo, int hi);
/* avx512.c */
TK_INTERNAL dot_kernel fma_fp32, fma_bf16, fma_fp16, fma_int8, fma_int4, fma_mxfp4;
TK_INTERNAL AVX512_TARGET void swiglu512(float *g, int I, int lo, int hi);
TK_INTERNAL AVX512_TARGET void geglu512(float *g, int I, int lo, int hi);
TK_INTERNAL AVX512_TARGET void clamped512(float *g, const float *gate_bias, const float *up_bias, float alpha, float limit,
                                           int I, int lo, int hi);
TK_INTERNAL AVX512_TARGET void e8m0_halves(const uint8_t *e, int n, float *out);
TK_INTERNAL rows4_fn rows4_avx512(int kind);
/* rows.c */
TK_INTERNAL void experts_one_token(const tk_args *a, int n);
TK_INTERNAL void linear_one_token(const tk_linear_args *a, int isa);
TK_INTERNAL void expert_streamed(const tk_args *a);
/* tiles.c: from this many tokens, float weights on AVX2 and AVX-512 take the tiled product (kernels/choice.py
 * TILED_TOKENS) */
#define TILED_TOKENS 16
TK_INTERNAL int tiled_serves(const tk_args *a);
TK_INTERNAL int expert_tiled(const tk_args *a);
/* avx512bf16.c */
TK_INTERNAL BF16_TARGET void to_bf16(const float *src, uint16_t *dst, int n);
TK_INTERNAL BF16_TARGET void dot2_bf16_dp(const uint16_t *r0, const uint16_t *r1, const uint16_t *xb,
                                          const uint16_t *xlo, int ldx, int nt, int n, float *res, int ldr);
TK_INTERNAL BF16_TARGET void expert_bf16dp(const tk_args *a);
TK_INTERNAL BF16_TARGET void mxfp4_inputs_bf16(const float *x, uint16_t *xp, int n);
TK_INTERNAL BF16_TARGET void rows4_mxfp4_dp(const char *const *rows, const void *const *scales, int group,
                                            const float *const *x, int n, float *const *res);
TK_INTERNAL dot_kernel dot_mxfp4_dp;
/* amx.c */
TK_INTERNAL AVX512_TARGET void token_scales(const float *x, int ldx, int T, int K, float top_value, float *scale,
                                            float *inv);
TK_INTERNAL AMX_TARGET void experts_amx(const tk_args *a, int n);
TK_INTERNAL AMX_TARGET void linear_amx(const tk_linear_args *a);
/* vnni.c */
TK_INTERNAL void experts_vnni_one_token(const tk_args *a, int n);
/* q8.c */
TK_INTERNAL int q8_block(int kind);
TK_INTERNAL int q8_serves(int kind);
TK_INTERNAL void q8_inputs(int kind, const float *x, int n, void *buf);
TK_INTERNAL rows4_fn q8_rows4(int kind);
TK_INTERNAL dot_fn q8_dot(int kind);
TK_INTERNAL void q8_rows(int kind, int isa, const float *x, size_t ldx, int T, int n, void *buf);
/* q8avx2.c */
TK_INTERNAL int q8_avx2_serves(int kind);
TK_INTERNAL void q8_inputs_avx2(int kind, const float *x, int n, void *buf);
TK_INTERNAL dot_fn q8_avx2_dot(int kind);
TK_INTERNAL rows4_fn q8_avx2_rows4(int kind);
/* 16-bit values a row of xb holds beyond the widest input (kernels/library.py XB_EXTRA): room for q8_stride. */
#define XB_EXTRA 192
/* Bytes between the quantized inputs of n values in a buffer of several (q8.c's layout: codes, block scales, sums
 * of 16, sums of 32 times their scale, each from a cache line): at most n + 3n/8 + 252, within the 2 (n + XB_EXTRA)
 * bytes a row of xb holds. */
static inline size_t q8_stride(int n) { return ((size_t)n + 63) / 64 * 64 + 3 * (((size_t)n / 8 + 63) / 64 * 64); }
/* Where the parts of one quantized input lie in its q8_stride bytes (q8.c's header says what they are). */
static inline size_t align64(size_t n) { return (n + 63) / 64 * 64; }
typedef struct { const int8_t *q; const float *d; const int16_t *bsums; const float *bx; } q8_view;
static inline q8_view q8_at(const void *buf, int n, int block) {
    const char *b = (const char *)buf;
    const size_t at_d = align64((size_t)n), at_bsums = at_d + align64((size_t)(n / block) * 4);
    const q8_view v = {(const int8_t *)b, (const float *)(b + at_d), (const int16_t *)(b + at_bsums),
                       (const float *)(b + at_bsums + align64((size_t)n / 16 * 2))};
    return v;
}
/* api.c */
TK_INTERNAL dot_fn pick_dot(int kind, int isa);

/* ---- helpers of more than one variant ----------------------------------------------------------------- */
/* The activation of one token's act row g [2I] (gate then up), for i in [lo, hi), in place: the biases added, then
 * silu(g) * u, or the clamped form (ACT_CLAMPED: g' = min(g, limit), u' = clamp(u, -limit, limit),
 * (u' + 1) * g' * sigmoid(alpha g'), gpt-oss's). 16 lanes at a time where AVX-512 is there. */
static inline void activate(const tk_args *e, float *g, int lo, int hi, int isa) {
    const int I = e->inter;
    if (e->act_kind == ACT_SILU && !e->gate_bias && !e->up_bias) {
        if (isa >= ISA_AVX512) swiglu512(g, I, lo, hi);
        else if (isa == ISA_AVX2) swiglu256(g, I, lo, hi);
        else for (int i = lo; i < hi; i++) g[i] = silu(g[i]) * g[I + i];
        return;
    }
    if (e->act_kind == ACT_GELU_TANH && !e->gate_bias && !e->up_bias) {
        if (isa >= ISA_AVX512) geglu512(g, I, lo, hi);
        else if (isa == ISA_AVX2) geglu256(g, I, lo, hi);
        else for (int i = lo; i < hi; i++) g[i] = gelu_tanh(g[i]) * g[I + i];
        return;
    }
    if (e->act_kind == ACT_CLAMPED && isa >= ISA_AVX512) {
        clamped512(g, e->gate_bias, e->up_bias, e->alpha, e->limit, I, lo, hi);
        return;
    }
    for (int i = lo; i < hi; i++) {
        float gv = g[i] + (e->gate_bias ? e->gate_bias[i] : 0.f), uv = g[I + i] + (e->up_bias ? e->up_bias[i] : 0.f);
        if (e->act_kind == ACT_CLAMPED) {
            gv = fminf(gv, e->limit), uv = fminf(fmaxf(uv, -e->limit), e->limit);
            g[i] = (uv + 1.f) * (gv / (1.f + expf(-e->alpha * gv)));
        } else {
            g[i] = (e->act_kind == ACT_GELU_TANH ? gelu_tanh(gv) : silu(gv)) * uv;
        }
    }
}

/* Inside a parallel region: the activation of one expert's act [T, 2I] (gate then up per token), in place, split
 * across threads in blocks of 512 values. */
static inline void swiglu_rows(const tk_args *a) {
    const int T = a->tokens, I = a->inter, blocks = (I + 511) / 512;
    #pragma omp for schedule(static)
    for (int b = 0; b < T * blocks; b++) {
        const int lo = (b % blocks) * 512, hi = lo + 512 < I ? lo + 512 : I;
        activate(a, a->act + (size_t)(b / blocks) * 2 * I, lo, hi, a->isa);
    }
}

/* A block kind's values and bytes a block (blocks.h; kernels/blocks.py FORMATS). */
static inline int block_values(int kind) { return kind >= K_Q4_K && kind <= K_Q6_K ? 256 : 32; }
static inline int block_bytes(int kind) {
    static const int bytes[KINDS] = {[K_Q8_0] = 34, [K_Q4_0] = 18, [K_Q4_1] = 20, [K_Q5_0] = 22, [K_Q5_1] = 24,
                                     [K_Q4_K] = 144, [K_Q5_K] = 176, [K_Q6_K] = 210, [K_GMXFP4] = 17};
    return bytes[kind];
}

static inline size_t row_bytes(int kind, int n, int group) {
    (void)group;
    if (IS_BLOCK_KIND(kind)) return (size_t)(n / block_values(kind)) * block_bytes(kind);
    switch (kind) {
        case K_FP32: return (size_t)n * 4;
        case K_BF16: case K_FP16: return (size_t)n * 2;
        case K_INT8: return (size_t)n;
        default: return (size_t)n / 2;  /* int4, MXFP4 */
    }
}

/* Bytes of a row's group scales: int4 bf16 per group, MXFP4 one E8M0 byte per 32 values; else none. */
static inline size_t row_scale_bytes(int kind, int n, int group) {
    return kind == K_INT4 ? (size_t)(n / group) * 2 : kind == K_MXFP4 ? (size_t)n / 32 : 0;
}

static inline const void *row_scales(const void *s, int kind, int row, int n, int group) {
    if ((kind != K_INT4 && kind != K_MXFP4) || !s) return NULL;
    return (const char *)s + (size_t)row * row_scale_bytes(kind, n, group);
}

static inline float row_scale(const void *s, int kind, int row) {
    return (kind == K_INT8 && s) ? ((const float *)s)[row] : 1.f;
}

/* Row q of a one-token phase over n experts: gate and up rows (q < n * 2I, expert by expert, gate then up),
 * or down rows; where its weights, scales (int8: the row's, int4 and MXFP4: its groups', else NULL), input and
 * result lie. */
typedef struct { const char *w; const void *s; const float *x; float *res; int e; } row_ref;
/* MXFP4 on the AVX512_BF16 variant, one token: vdpbf16ps against the inputs laid out in xb (avx512bf16.c); it comes
 * before q8_path wherever both could serve. */
static inline int mxfp4_dp(const tk_args *a) { return a->kind == K_MXFP4 && a->isa == ISA_AVX512BF16; }
/* GGUF blocks of `kind`, and several tokens of MXFP4, on the AVX512_BF16 variant (q8.c), and every block format but
 * MXFP4 on the AVX2 variant (q8avx2.c): integer products against the inputs quantized to int8 in xb. */
static inline int q8_path(int kind, int isa) {
    return (isa == ISA_AVX512BF16 && q8_serves(kind)) || (isa == ISA_AVX2 && q8_avx2_serves(kind));
}
/* The dot product of such a path's variant. */
static inline dot_fn q8_dot_for(int kind, int isa) { return isa == ISA_AVX2 ? q8_avx2_dot(kind) : q8_dot(kind); }
/* Whether a phase's rows read their inputs from xb (laid out there first). */
static inline int reads_xb(const tk_args *a, int down) {
    return mxfp4_dp(a) || q8_path(down ? a->down_kind : a->kind, a->isa);
}

static inline row_ref one_token_row(const tk_args *a, int down, int q) {
    const int H = a->hidden, I = a->inter, kind = down ? a->down_kind : a->kind;
    row_ref r;
    if (down) {
        const tk_args *e = a + q / H;
        const int row = q % H;
        r.w = (const char *)e->down + (size_t)row * row_bytes(kind, I, a->group);
        r.s = kind == K_INT8 ? (const float *)e->down_scale + row : row_scales(e->down_scale, kind, row, I, a->group);
        r.x = reads_xb(a, 1) ? (const float *)e->xb : e->act, r.res = e->out + row, r.e = q / H;
    } else {
        const tk_args *e = a + q / (2 * I);
        const int up = q % (2 * I) >= I, row = q % I;
        const void *s = up ? e->up_scale : e->gate_scale;
        r.w = (const char *)(up ? e->up : e->gate) + (size_t)row * row_bytes(kind, H, a->group);
        r.s = kind == K_INT8 ? (const float *)s + row : row_scales(s, kind, row, H, a->group);
        r.x = reads_xb(a, 0) ? (const float *)e->xb : e->x, r.res = e->act + (up ? I : 0) + row, r.e = q / (2 * I);
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

/* Inside a parallel region, the activation phase of n experts: each one's act [tokens, 2I] (gate then up per token)
 * in place, split across threads in blocks of 512 values (in the experts' variant's vectors). */
static inline void experts_swiglu(const tk_args *a, int n) {
    const int I = a->inter, blocks = (I + 511) / 512;
    #pragma omp for schedule(static)
    for (int j = 0; j < n * 16 * blocks; j++) {
        const tk_args *e = a + j / (16 * blocks);
        const int t = j % (16 * blocks) / blocks, lo = j % blocks * 512, hi = lo + 512 < I ? lo + 512 : I;
        if (t < e->tokens) activate(e, e->act + (size_t)t * 2 * I, lo, hi, e->isa);
    }
}

#define BLOCK_TOKENS 32  /* tokens of GGUF blocks one tk_linear call takes at most: kernels/choice.py BLOCK_STEP */
#define AMX_BATCH 64  /* experts per region at most (their per-token scales live on the stack) */
#define BLOCK_ROWS 16  /* rows per block of the int8/int4 layout: must equal kernels/quant.py BLOCK_ROWS */
_Static_assert(BLOCK_ROWS == 16, "the tile kernels and VNNI lines take blocks of 16 rows");

/* Inside a parallel region: block i of each of the `parts` parts of this thread's run of 16-row blocks in a
 * one-phase pass (gate and up, or down) of quantized experts: k[0..parts), where the missing ones (past the run's
 * end: the last part is the shortest) repeat the first. Returns how many are real (at least 1 for i < run.len). */
static inline int blocks_of_parts(const tk_args *a, int down, thread_run run, int i, int parts, row_ref *k) {
    int m = 0;
    for (int j = 0; j < parts && run.lo + j * run.len + i < run.hi; j++)
        k[m++] = one_token_row(a, down, (run.lo + j * run.len + i) * BLOCK_ROWS);
    for (int j = m; j < parts; j++) k[j] = k[0];
    return m;
}
#define BLOCK_PREFETCH 1024  /* bytes ahead in each stream of blocks, into L1 (int4 tiles: 2-8 KB, or into L2, no faster) */

#endif
