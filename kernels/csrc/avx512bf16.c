/* The AVX512_BF16 variant (ISA_AVX512BF16): bf16 weights against bf16 activations with vdpbf16ps, rows in pairs;
 * the expert (expert_bf16dp) and, through linear_rows (base.c), dense matrices. */
#include "common.h"

/* ---- AVX512_BF16: vdpbf16ps on bf16 weights and bf16-rounded activations -------------------------- */

BF16_TARGET void to_bf16(const float *src, uint16_t *dst, int n) {
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
 * `split`, each token's activations are hi + lo pairs (lo at xlo, same layout) and both go into its sums. Each line
 * of the two rows is asked for DP2_PREFETCH bytes ahead: 2 KB, the best of 1, 2 and 4 KB and 13-18 % faster than
 * none at 4-8 tokens (docs/bench/kernels.md). */
#ifndef DP2_PREFETCH
#define DP2_PREFETCH 2048
#endif
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
        if (DP2_PREFETCH) {
            _mm_prefetch((const char *)(r0 + k) + DP2_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)(r1 + k) + DP2_PREFETCH, _MM_HINT_T0);
        }
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
BF16_TARGET void dot2_bf16_dp(const uint16_t *r0, const uint16_t *r1, const uint16_t *xb, const uint16_t *xlo,
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

BF16_TARGET void expert_bf16dp(const tk_args *a) {
    const int T = a->tokens, H = a->hidden, I = a->inter, ld = H > I ? H : I, split = T <= 8;
    const uint16_t *gate = a->gate, *up = a->up, *down = a->down;
    uint16_t *xlo = a->xb + (size_t)T * ld;  /* the lo halves of hi + lo activations (to_bf16_split) */
    #pragma omp parallel num_threads(a->threads)
    {
        #pragma omp for schedule(static)
        for (int t = 0; t < T; t++) to_bf16(a->x + (size_t)t * H, a->xb + (size_t)t * ld, H);
        #pragma omp for schedule(static)
        for (int r = 0; r < 2 * I; r += 2) {  /* I is even (checked), so a pair never straddles gate/up */
            const uint16_t *w = r < I ? gate + (size_t)r * H : up + (size_t)(r - I) * H;
            dot2_bf16_dp(w, w + H, a->xb, NULL, ld, T, H, a->act + r, 2 * I);
        }
        swiglu_rows(a);
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

/* ---- MXFP4, one token, with vdpbf16ps ------------------------------------------------------------------
 * Where activations are bf16 anyway, an MXFP4 row is read 64 bytes (four blocks, 128 values) at a time as 32 words
 * of four nibbles each: word w, shifted right by 4s, indexes a table of the 16 codes' bf16 values (twice over, so
 * the bit above the nibble does not matter) with vpermw, 32 weights per lookup, and vdpbf16ps multiplies them by
 * the activations of those positions, which `mxfp4_inputs_bf16` laid out in that order once per call. Lane i of
 * the sums covers bytes 4i..4i+3, so block i/4: one FMA by the four blocks' scales (each over four lanes) ends the
 * chunk. Per 128 values 4 lookups and 6 multiply-adds, against 12 and 12 for the float path (rows4_mxfp4), whose
 * shuffles bound it below the bandwidth. Values: the codes and scales exact, the activations rounded to bf16. */
#define CHUNK 128  /* values a step reads: four blocks */

/* bf16 of each E2M1 value (kernels/quant.py E2M1 and negatives), for codes 0-15 and again for 16-31 */
static const uint16_t E2M1_BF16[32] = {
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
    0x0000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0,
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
    0x0000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0,
};

/* x [n] (n a multiple of 32) as bf16 in the order the MXFP4 rows read it: per chunk of 128 values, for each nibble
 * position s of a word (0-3), word w's value: byte B = 2w + s/2 of the chunk, its low (s even) or high nibble, so
 * value 32 (B / 16) + B % 16 + 16 (s % 2). A last partial chunk is padded with zeros (ceil(n / 128) * 128 words). */
static inline int mxfp4_input_at(int s, int w) {  /* the value of a chunk that word w of nibble position s reads */
    const int B = 2 * w + s / 2;
    return 32 * (B / 16) + B % 16 + 16 * (s % 2);
}

BF16_TARGET void mxfp4_inputs_bf16(const float *x, uint16_t *xp, int n) {
    uint16_t at[4][32];  /* each output word's source within the chunk's 128 */
    for (int s = 0; s < 4; s++)
        for (int w = 0; w < 32; w++) at[s][w] = (uint16_t)mxfp4_input_at(s, w);
    int c = 0;
    for (; (c + 1) * CHUNK <= n; c++) {  /* whole chunks: rounded 32 at a time, then each word picked from them */
        const float *src = x + (size_t)c * CHUNK;
        __m512i v[4];
        for (int r = 0; r < 4; r++)
            v[r] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 32 * r + 16), _mm512_loadu_ps(src + 32 * r));
        for (int s = 0; s < 4; s++) {
            const __m512i idx = _mm512_loadu_si512((const void *)at[s]);
            const __mmask32 upper = _mm512_cmpge_epu16_mask(idx, _mm512_set1_epi16(64));
            const __m512i lo = _mm512_permutex2var_epi16(v[0], idx, v[1]), hi = _mm512_permutex2var_epi16(v[2], idx, v[3]);
            _mm512_storeu_si512((void *)(xp + (size_t)c * CHUNK + 32 * s), _mm512_mask_blend_epi16(upper, lo, hi));
        }
    }
    if (c * CHUNK < n)  /* a partial last chunk, padded with zeros */
        for (int s = 0; s < 4; s++)
            for (int w = 0; w < 32; w++) {
                const int v = c * CHUNK + at[s][w];
                xp[(size_t)c * CHUNK + s * 32 + w] = v < n ? bf16_of(x[v]) : 0;
            }
}

/* Sixteen blocks' scales 2^(e-127) from their E8M0 bytes (fewer: `mask`, the rest 0): the bits e << 23, and for
 * e = 0 the subnormal 2^-127 (the larger of the two, since e >= 1 gives at least 2^-126). Exact, as the reference. */
BF16_TARGET static inline __m512 e8m0_scales16(const uint8_t *e, __mmask16 mask) {
    const __m512i u = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, e));
    const __m512i bits = _mm512_max_epu32(_mm512_slli_epi32(u, 23), _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(_mm512_maskz_mov_epi32(mask, bits));
}

/* m rows (1-4) of one token: rows[j] against the laid-out activations x[j] (mxfp4_inputs_bf16), into *res[j]. The
 * scales of 16 blocks (4 chunks) are made at once, and spread over each chunk's lanes by a permute. */
BF16_TARGET static inline __attribute__((always_inline)) void mxfp4_dp_rows(
        int m, const char *const *rows, const void *const *scales, const uint16_t *const *x, int n, float *const *res) {
    const int groups = n / 32, chunks = (groups + 3) / 4;
    const __m512i table = _mm512_loadu_si512((const void *)E2M1_BF16);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512 scale16[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int c = 0; c < chunks; c++) {
        if (c % 4 == 0) {
            const int left = groups - 4 * c;
            const __mmask16 blocks = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            for (int j = 0; j < m; j++) scale16[j] = e8m0_scales16((const uint8_t *)scales[j] + 4 * c, blocks);
        }
        const __m512i quads = _mm512_add_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                               _mm512_set1_epi32(4 * (c % 4)));
        const int words = c * 4 + 4 <= groups ? 32 : (groups - c * 4) * 8;  /* the last chunk may hold 1-3 blocks */
        const __mmask32 mask = words == 32 ? 0xffffffffu : (1u << words) - 1;
        for (int j = 0; j < m; j++) {
            const char *q = rows[j] + (size_t)c * 64;
            PREFETCH_AHEAD(q);
            const __m512i v = _mm512_maskz_loadu_epi16(mask, q);
            const uint16_t *xs = x[j] + (size_t)c * CHUNK;
            __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_permutexvar_epi16(v, table),
                                        (__m512bh)_mm512_loadu_si512((const void *)xs));
            __m512 u = _mm512_dpbf16_ps(_mm512_setzero_ps(),
                                        (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table),
                                        (__m512bh)_mm512_loadu_si512((const void *)(xs + 32)));
            t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table),
                                 (__m512bh)_mm512_loadu_si512((const void *)(xs + 64)));
            u = _mm512_dpbf16_ps(u, (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table),
                                 (__m512bh)_mm512_loadu_si512((const void *)(xs + 96)));
            acc[j] = _mm512_fmadd_ps(_mm512_add_ps(t, u), _mm512_permutexvar_ps(quads, scale16[j]), acc[j]);
        }
    }
    for (int j = 0; j < m; j++) *res[j] = _mm512_reduce_add_ps(acc[j]);
}

BF16_TARGET void rows4_mxfp4_dp(const char *const *rows, const void *const *scales, int group, const float *const *x,
                                int n, float *const *res) {
    (void)group;
    mxfp4_dp_rows(4, rows, scales, (const uint16_t *const *)x, n, res);
}

/* One row of one token (stream_rows' rows beyond the last four; nt is 1 there). */
BF16_TARGET void dot_mxfp4_dp(const void *wrow, float scale, const void *gscale, int group, const float *x, int ldx,
                              int nt, int n, float *res, int ldr) {
    (void)scale, (void)group, (void)ldx, (void)nt, (void)ldr;
    const char *rows[1] = {(const char *)wrow};
    const void *scales[1] = {gscale};
    const uint16_t *xs[1] = {(const uint16_t *)x};
    float *out[1] = {res};
    mxfp4_dp_rows(1, rows, scales, xs, n, out);
}
