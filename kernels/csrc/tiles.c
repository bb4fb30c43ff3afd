/* Many tokens through one expert with float weights (fp32, bf16, fp16) or GGUF blocks on the AVX2 and AVX-512
 * variants: a register-tiled product, compute-bound where the row kernels (avx2.c's fma8, up to 8 tokens against
 * each weight row, a horizontal sum per row and token) are bound by their loads and sums.
 *
 * Per phase (gate and up, then down) the inputs are laid out once, transposed: xt [K][Tp] (Tp the tokens rounded up
 * to 16, the padding zero). Each thread takes whole panels of TILE_ROWS weight rows, converts a panel to float32
 * once (rows of K values, as they lie: no transpose; blocks unpacked to the reference dequantizer's values), and
 * runs it against every 16 tokens: per k, two vectors of 16 tokens' inputs, one broadcast weight per row,
 * TILE_ROWS x 2 FMAs into 12 accumulators. The sums are float32, in k order, one per output (the reference sums in
 * another order: equal within float32 rounding).
 *
 * Letters: T tokens, Tp T rounded up to 16, K a product's inner width (H for gate and up, I for down), H hidden
 * size, I expert width. */
#include "common.h"
#include "blocks.h"

#define TILE_ATTR __attribute__((target("avx2,fma,f16c")))
enum { TILE_ROWS = 6, TILE_TOKENS = 16 };  /* tile's shape: six rows' and two vectors' sums */

/* A row of K values of GGUF blocks (whole blocks) as float32: the reference dequantizer's values (blocks.h). */
#define UNPACK_ROW(UNPACK, V, B) for (int k = 0; k < K; k += (V)) UNPACK(src + (size_t)(k / (V)) * (B), d + k)
TILE_ATTR static void unpack_row(int kind, const uint8_t *src, int K, float *d) {
    switch (kind) {
        case K_Q8_0: UNPACK_ROW(unpack_q8_0, 32, 34); break;
        case K_Q4_0: UNPACK_ROW(unpack_q4_0, 32, 18); break;
        case K_Q4_1: UNPACK_ROW(unpack_q4_1, 32, 20); break;
        case K_Q5_0: UNPACK_ROW(unpack_q5_0, 32, 22); break;
        case K_Q5_1: UNPACK_ROW(unpack_q5_1, 32, 24); break;
        case K_Q4_K: UNPACK_ROW(unpack_q4_k, 256, 144); break;
        case K_Q5_K: UNPACK_ROW(unpack_q5_k, 256, 176); break;
        case K_Q6_K: UNPACK_ROW(unpack_q6_k, 256, 210); break;
        default: UNPACK_ROW(unpack_gmxfp4, 32, 17); break;
    }
}
#undef UNPACK_ROW

/* Rows [r0, r0 + n) of a [rows, K] matrix of `kind` as float32 into dst [TILE_ROWS][K]; rows past n repeat the
 * first (their sums are computed and dropped). */
TILE_ATTR static void panel_f32(const void *w, int kind, int K, int r0, int n, float *dst) {
    for (int i = 0; i < TILE_ROWS; i++) {
        const size_t r = (size_t)(r0 + (i < n ? i : 0)), row = r * (size_t)K;
        float *d = dst + (size_t)i * K;
        int k = 0;
        if (IS_BLOCK_KIND(kind)) {
            unpack_row(kind, (const uint8_t *)w + r * row_bytes(kind, K, 0), K, d);
            continue;
        }
        if (kind == K_FP32) {
            memcpy(d, (const float *)w + row, (size_t)K * sizeof(float));
            continue;
        }
        if (kind == K_BF16) {
            const uint16_t *s = (const uint16_t *)w + row;
            for (; k + 8 <= K; k += 8)
                _mm256_storeu_ps(d + k, _mm256_castsi256_ps(_mm256_slli_epi32(
                                            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + k))), 16)));
            for (; k < K; k++) d[k] = bf16f(s[k]);
        } else {
            const uint16_t *s = (const uint16_t *)w + row;
            for (; k + 8 <= K; k += 8) _mm256_storeu_ps(d + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + k))));
            for (; k < K; k++) d[k] = _cvtsh_ss(s[k]);
        }
    }
}

/* Inside a parallel region: x [T, K] (rows ldx apart) into xt [K][Tp], shared out by k. */
static void transpose_in(const float *x, int ldx, int T, int Tp, int K, float *xt) {
    #pragma omp for schedule(static)
    for (int k = 0; k < K; k++) {
        float *d = xt + (size_t)k * Tp;
        for (int t = 0; t < T; t++) d[t] = x[(size_t)t * ldx + k];
        for (int t = T; t < Tp; t++) d[t] = 0.f;
    }
}

/* One panel's TILE_ROWS rows (wp [TILE_ROWS][K] float32) against tokens [t0, t0 + 16) of xt: res[t][r] for the
 * panel's first n rows and the tokens below T (results ldr apart per token). The twelve sums are named variables,
 * not an array: with an array the compiler kept a copy in memory up to date on every k. */
#define TILE_STEP(I, A, B) {                                            \
        const __m256 w = _mm256_broadcast_ss(wp + (size_t)(I) * K + k); \
        A = _mm256_fmadd_ps(w, x0, A);                                  \
        B = _mm256_fmadd_ps(w, x1, B);                                  \
    }
TILE_ATTR static void tile(const float *wp, const float *xt, int Tp, int K, int t0, int T, int n, float *res,
                           int ldr) {
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0,
           b4 = a0, a5 = a0, b5 = a0;
    const float *xk = xt + t0;
    for (int k = 0; k < K; k++, xk += Tp) {
        const __m256 x0 = _mm256_loadu_ps(xk), x1 = _mm256_loadu_ps(xk + 8);
        TILE_STEP(0, a0, b0) TILE_STEP(1, a1, b1) TILE_STEP(2, a2, b2)
        TILE_STEP(3, a3, b3) TILE_STEP(4, a4, b4) TILE_STEP(5, a5, b5)
    }
    float v[TILE_ROWS][TILE_TOKENS];
    _mm256_storeu_ps(v[0], a0), _mm256_storeu_ps(v[0] + 8, b0), _mm256_storeu_ps(v[1], a1);
    _mm256_storeu_ps(v[1] + 8, b1), _mm256_storeu_ps(v[2], a2), _mm256_storeu_ps(v[2] + 8, b2);
    _mm256_storeu_ps(v[3], a3), _mm256_storeu_ps(v[3] + 8, b3), _mm256_storeu_ps(v[4], a4);
    _mm256_storeu_ps(v[4] + 8, b4), _mm256_storeu_ps(v[5], a5), _mm256_storeu_ps(v[5] + 8, b5);
    const int m = T - t0 < TILE_TOKENS ? T - t0 : TILE_TOKENS;
    for (int t = 0; t < m; t++)
        for (int i = 0; i < n; i++) res[(size_t)(t0 + t) * ldr + i] = v[i][t];
}

/* Inside a parallel region: res[t][r] = w[r] . x[t] for rows [0, rows) of w [rows, K], every token of xt. */
TILE_ATTR static void tiled_rows(const void *w, int kind, int rows, int K, const float *xt, int T, int Tp,
                                 float *res, int ldr, float *wp) {
    const int panels = (rows + TILE_ROWS - 1) / TILE_ROWS;
    #pragma omp for schedule(static)
    for (int p = 0; p < panels; p++) {
        const int r0 = p * TILE_ROWS, n = rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS;
        panel_f32(w, kind, K, r0, n, wp);
        for (int t0 = 0; t0 < T; t0 += TILE_TOKENS) tile(wp, xt, Tp, K, t0, T, n, res + r0, ldr);
    }
}

/* GGUF blocks whose AVX2 int8 path (q8avx2.c) was measured behind the tiled product at BLOCK_TOKENS tokens (Q8_0,
 * Q5_0, Q5_1; the K formats and Q4_0/Q4_1 were not), or that have none (MXFP4); on AVX-512, every format (its block
 * rows unpack each chunk once per 16 tokens): docs/bench/kernels.md. */
static int tiled_blocks(int kind, int isa) {
    return IS_BLOCK_KIND(kind) && (isa == ISA_AVX512 || (isa == ISA_AVX2 && (kind == K_Q8_0 || kind == K_Q5_0 ||
                                                                            kind == K_Q5_1 || kind == K_GMXFP4)));
}

/* Float weights from TILED_TOKENS tokens on AVX2 and from twice that on AVX-512, whose own row kernels hold their own
 * up to there (docs/bench/kernels.md: the tiled product is AVX2 code on both); GGUF blocks (tiled_blocks) from
 * BLOCK_TOKENS, a whole call of the kernel's. */
int tiled_serves(const tk_args *a) {
    const int floats = (a->kind == K_FP32 || a->kind == K_BF16 || a->kind == K_FP16) && a->down_kind == a->kind;
    if (tiled_blocks(a->kind, a->isa) && tiled_blocks(a->down_kind, a->isa)) return a->tokens >= BLOCK_TOKENS;
    return floats && ((a->isa == ISA_AVX2 && a->tokens >= TILED_TOKENS) ||
                      (a->isa == ISA_AVX512 && a->tokens >= 2 * TILED_TOKENS));
}

/* Returns 0, or -9 where its scratch could not be allocated. */
int expert_tiled(const tk_args *a) {
    const int T = a->tokens, H = a->hidden, I = a->inter, Tp = (T + TILE_TOKENS - 1) / TILE_TOKENS * TILE_TOKENS;
    const int K = H > I ? H : I, most = (K + TILE_ROWS - 1) / TILE_ROWS;  /* panels in the widest phase */
    const int threads = a->threads < most ? a->threads : most;  /* more would have no panel to take */
    float *xt = aligned_alloc(64, ((size_t)K * Tp * sizeof(float) + 63) / 64 * 64);
    float *panels = aligned_alloc(64, ((size_t)threads * TILE_ROWS * K * sizeof(float) + 63) / 64 * 64);
    if (!xt || !panels) {
        free(xt), free(panels);
        return -9;
    }
    #pragma omp parallel num_threads(threads)
    {
        float *wp = panels + (size_t)omp_get_thread_num() * TILE_ROWS * K;
        transpose_in(a->x, H, T, Tp, H, xt);  /* (its loop's barrier: every column laid out before the rows run) */
        tiled_rows(a->gate, a->kind, I, H, xt, T, Tp, a->act, 2 * I, wp);
        tiled_rows(a->up, a->kind, I, H, xt, T, Tp, a->act + I, 2 * I, wp);  /* (barrier: xt read by all) */
        swiglu_rows(a);
        transpose_in(a->act, 2 * I, T, Tp, I, xt);
        tiled_rows(a->down, a->down_kind, H, I, xt, T, Tp, a->out, H, wp);
    }
    free(xt), free(panels);
    return 0;
}
