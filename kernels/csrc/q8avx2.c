/* GGUF blocks against int8 activations on AVX2 (q8.c's integer sums in 256-bit vectors, as llama.cpp's AVX2 path
 * computes them): the inputs quantized per block (q8_inputs_avx2: the layout of q8.c's, codes in value order),
 * then per 32 values vpmaddubsw (unsigned codes by signed activations; Q8_0 and the formats with an offset: |w|
 * against x signed as w) and vpmaddwd by the sub-block's scale or by ones, one float multiply-add per block or
 * superblock. The AVX2 variant takes this path for every format but MXFP4 (common.h q8_path): CPUs without
 * AVX512_BF16, whose compute is bf16 for such models (runtime/options.py default_dtype), so activations are rounded
 * anyway. One token and several alike: each row's step unpacked once for up to Q8A_TOKENS tokens.
 *
 * Letters: M tokens a call (at most Q8A_TOKENS at a time), S steps a row (superblocks, or blocks of 32). */
#include "common.h"
#include "blocks.h"

#define Q8A_TARGET __attribute__((target("avx2,fma,f16c")))
/* Tokens whose dot products share each unpacked step of a row: eight, as q8.c's. A 240-token prefill of the 4-layer
 * OLMoE shape as Q4_K_M (AVX2 mask, 2 threads) took 0.63-0.67 s against 0.73-0.77 s with four; twelve, 0.65-0.67 s. */
#define Q8A_TOKENS 8

static inline int k_kind(int kind) { return kind == K_Q4_K || kind == K_Q5_K || kind == K_Q6_K; }
static inline int with_min(int kind) { return kind == K_Q4_1 || kind == K_Q5_1; }
static inline int avx2_block(int kind) { return k_kind(kind) ? 256 : 32; }

int q8_avx2_serves(int kind) {
    return k_kind(kind) || kind == K_Q8_0 || kind == K_Q4_0 || kind == K_Q4_1 || kind == K_Q5_0 || kind == K_Q5_1;
}

Q8A_TARGET static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
Q8A_TARGET static inline int hsum8i(__m256i v) {
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}

/* x [n] -> buf: as q8.c's q8_inputs (d = max|x| / 127, q = round(x / d), the sums of each 16 for the K formats and
 * those with mins, bx per 32 for those with mins), codes in value order. */
Q8A_TARGET void q8_inputs_avx2(int kind, const float *x, int n, void *buf) {
    const int block = avx2_block(kind);
    const q8_view at = q8_at(buf, n, block);
    int8_t *q = (int8_t *)at.q;
    float *d = (float *)at.d, *bx = (float *)at.bx;
    int16_t *bsums = (int16_t *)at.bsums;
    const int sums = block == 256 || with_min(kind);
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int k = 0; k < n / block; k++) {
        const float *xs = x + (size_t)k * block;
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < block; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xs + j)));
        const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        const float inv = amax > 0 ? 127.f / amax : 0.f;
        d[k] = amax / 127.f;
        for (int j = 0; j < block; j += 32) {  /* 32 codes: four vectors of 8, packed with saturation */
            __m256i v[4];
            for (int i = 0; i < 4; i++)  /* (nearest even: MXCSR's rounding, as q8.c's explicit one) */
                v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + j + 8 * i), _mm256_set1_ps(inv)));
            if (sums) {
                bsums[((size_t)k * block + j) / 16] = (int16_t)hsum8i(_mm256_add_epi32(v[0], v[1]));
                bsums[((size_t)k * block + j) / 16 + 1] = (int16_t)hsum8i(_mm256_add_epi32(v[2], v[3]));
            }
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(q + (size_t)k * block + j), ordered);
        }
    }
    if (with_min(kind) || kind == K_Q4_K || kind == K_Q5_K)
        for (int i = 0; i < n / 32; i++) bx[i] = d[i * 32 / block] * (float)(bsums[2 * i] + bsums[2 * i + 1]);
}

/* 16 bytes of nibbles as 32 codes in value order (low nibbles values 0-15, high 16-31). */
Q8A_TARGET static inline __m256i nibbles32(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}
/* The 32 bits at p as 32 bytes: 16 where the value's bit is set (Q5_0's and Q5_1's fifth bits), else 0. */
Q8A_TARGET static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t h;
    memcpy(&h, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), _mm256_setr_epi64x(
        0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

/* Q4_K's and Q5_K's 8 scales (bytes 0-7) and 8 mins (8-15), as q8.c's q4k_scales_mins (SSE4.1 blends). */
Q8A_TARGET static inline __m128i scales_mins(const uint8_t *blk) {
    const __m128i s = _mm_loadu_si128((const __m128i *)blk), m4 = _mm_set1_epi8(15);
    const __m128i ab = _mm_shuffle_epi8(s, _mm_setr_epi8(4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 10, 11, 8, 9, 10, 11));
    const __m128i c = _mm_shuffle_epi8(s, _mm_setr_epi8(12, 13, 14, 15, 12, 13, 14, 15, 12, 13, 14, 15, 12, 13, 14, 15));
    const __m128i hi_c = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1);
    const __m128i c4 = _mm_blendv_epi8(_mm_and_si128(c, m4), _mm_and_si128(_mm_srli_epi16(c, 4), m4), hi_c);
    const __m128i top = _mm_and_si128(_mm_srli_epi16(ab, 2), _mm_set1_epi8(0x30));
    const __m128i upper = _mm_setr_epi8(0, 0, 0, 0, -1, -1, -1, -1, 0, 0, 0, 0, -1, -1, -1, -1);
    return _mm_blendv_epi8(_mm_and_si128(ab, _mm_set1_epi8(63)), _mm_or_si128(c4, top), upper);
}

/* ---- one step of a row (a superblock, or a block of 32) against M inputs' codes, into their accumulators.
 * mf: the row's floats for the offsets summed apart (Q4_K's and Q5_K's -dmin m per 32 values, Q4_1's and Q5_1's
 * m per block), against each input's bx in row_end. */
Q8A_TARGET static inline __attribute__((always_inline)) void step_avx2(int kind, const uint8_t *w, int s, int M,
                                                                       const q8_view *xv, __m256 *acc, float *mf) {
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
    if (kind == K_Q4_K || kind == K_Q5_K) {
        const int five = kind == K_Q5_K;
        const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(w[0] | w[1] << 8 | w[2] << 16 | w[3] << 24));
        const __m128i sm = scales_mins(w);
        const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
        _mm256_storeu_ps(mf + 8 * (size_t)s, _mm256_mul_ps(mins, _mm256_set1_ps(-_mm_cvtss_f32(_mm_movehdup_ps(d_dmin)))));
        const uint8_t *qs = w + (five ? 48 : 16);
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
        __m256i isum[Q8A_TOKENS];
        for (int j = 0; j < M; j++) isum[j] = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {  /* bytes 32i..32i+31: sub-block 2i (low nibbles), 2i + 1 (high) */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
            __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if (five) {
                const __m256i one = _mm256_set1_epi8(1);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i + 1), one), 4));
            }
            const __m256i s_lo = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * i))));
            const __m256i s_hi = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * i + 1))));
            for (int j = 0; j < M; j++) {
                const int8_t *x = xv[j].q + (size_t)s * 256 + 64 * i;
                const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)), s_lo);
                const __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32))), s_hi);
                isum[j] = _mm256_add_epi32(isum[j], _mm256_add_epi32(p_lo, p_hi));
            }
        }
        const float d = _mm_cvtss_f32(d_dmin);
        for (int j = 0; j < M; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_set1_ps(d * xv[j].d[s]), acc[j]);
        return;
    }
    if (kind == K_Q6_K) {  /* codes q + 32 (0-63); less 32 times each scale over its 16 codes' sum */
        const int8_t *scales = (const int8_t *)(w + 192);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scales));
        const float d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(w[208] | w[209] << 8)));
        const __m256i three = _mm256_set1_epi8(3);
        __m256i isum[Q8A_TOKENS];
        for (int j = 0; j < M; j++)
            isum[j] = _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(xv[j].bsums + 16 * (size_t)s))), 5);
        for (int j = 0; j < M; j++) isum[j] = _mm256_sub_epi32(_mm256_setzero_si256(), isum[j]);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = w + 64 * half, *qhp = w + 128 + 32 * half;
            const __m256i qa = _mm256_loadu_si256((const __m256i *)ql), qb = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)qhp);
            const __m256i codes[4] = {  /* values 0-31, 32-63, 64-95, 96-127 of the half */
                _mm256_or_si256(_mm256_and_si256(qa, low), _mm256_slli_epi16(_mm256_and_si256(h, three), 4)),
                _mm256_or_si256(_mm256_and_si256(qb, low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), three), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), three), 4))};
            for (int c = 0; c < 4; c++) {
                const int g = 8 * half + 2 * c;  /* the scales of the vector's two runs of 16 */
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(scales[g + 1]), _mm_set1_epi16(scales[g]));
                for (int j = 0; j < M; j++) {
                    const int8_t *x = xv[j].q + (size_t)s * 256 + 128 * half + 32 * c;
                    isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(_mm256_maddubs_epi16(codes[c], _mm256_loadu_si256((const __m256i *)x)), scv));
                }
            }
        }
        for (int j = 0; j < M; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_set1_ps(d * xv[j].d[s]), acc[j]);
        return;
    }
    /* a block of 32: Q8_0 (d, int8 codes), Q4_0 / Q5_0 (codes q - 8, q - 16), Q4_1 / Q5_1 (q d + m) */
    const int mins = with_min(kind), five = kind == K_Q5_0 || kind == K_Q5_1, at_h = 2 + 2 * mins;
    const float d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(w[0] | w[1] << 8)));
    __m256i c;
    if (kind == K_Q8_0) c = _mm256_loadu_si256((const __m256i *)(w + 2));
    else {
        c = nibbles32(w + at_h + 4 * five);
        if (five) c = _mm256_or_si256(c, fifth_bits(w + at_h));
        if (!mins) c = _mm256_sub_epi8(c, _mm256_set1_epi8(five ? 16 : 8));
    }
    if (mins) mf[s] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(w[2] | w[3] << 8)));
    const __m256i u = mins ? c : _mm256_sign_epi8(c, c);  /* |w| (unsigned codes as they are) */
    for (int j = 0; j < M; j++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xv[j].q + 32 * (size_t)s));
        const __m256i sx = mins ? x : _mm256_sign_epi8(x, c);  /* x signed as w (0 where w is) */
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, sx), ones);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xv[j].d[s]), acc[j]);
    }
}

/* An accumulator's sum, with the offsets summed apart: the row's mf against the input's bx. */
Q8A_TARGET static inline float row_end(int kind, const q8_view *x, int n, __m256 acc, const float *mf) {
    float s = hsum8(acc);
    if (kind == K_Q4_K || kind == K_Q5_K || with_min(kind)) {
        __m256 m = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= n / 32; i += 8) m = _mm256_fmadd_ps(_mm256_loadu_ps(mf + i), _mm256_loadu_ps(x->bx + i), m);
        s += hsum8(m);
        for (; i < n / 32; i++) s += mf[i] * x->bx[i];
    }
    return s;
}

Q8A_TARGET static inline __attribute__((always_inline)) void row_avx2(int kind, const uint8_t *w, const char *x,
                                                                      size_t stride, int M, int n, float *res,
                                                                      int ldr, float *mf) {
    q8_view xv[Q8A_TOKENS];
    __m256 acc[Q8A_TOKENS];
    const int block = avx2_block(kind), step_bytes = block_bytes(kind);
    for (int j = 0; j < M; j++) xv[j] = q8_at(x + (size_t)j * stride, n, block), acc[j] = _mm256_setzero_ps();
    for (int s = 0; s < n / block; s++) step_avx2(kind, w + (size_t)s * step_bytes, s, M, xv, acc, mf);
    for (int j = 0; j < M; j++) res[(size_t)j * ldr] = row_end(kind, &xv[j], n, acc[j], mf);
}

/* dot_fn: one row against nt inputs quantized at x (q8_stride(n) bytes apart: ldx floats), Q8A_TOKENS at a time. */
#define DEFINE_AVX2_DOT(NAME, KIND)                                                                             \
Q8A_TARGET static void dot_##NAME##_q8avx2(const void *wrow, float scale, const void *gscale, int group,        \
                                           const float *x, int ldx, int nt, int n, float *res, int ldr) {       \
    (void)scale, (void)gscale, (void)group;                                                                     \
    const uint8_t *w = (const uint8_t *)wrow;                                                                   \
    const size_t stride = (size_t)ldx * sizeof(float);                                                          \
    float mf[n / 32 > 0 ? n / 32 : 1];  /* the row's offsets (n / 32 floats at most) */                         \
    for (int t = 0; t < nt; t += Q8A_TOKENS) {                                                                  \
        const char *xs = (const char *)x + (size_t)t * stride;                                                  \
        float *r = res + (size_t)t * ldr;                                                                       \
        switch (nt - t < Q8A_TOKENS ? nt - t : Q8A_TOKENS) {  /* constant M per case */                        \
            case 1: row_avx2(KIND, w, xs, stride, 1, n, r, ldr, mf); break;                                      \
            case 2: row_avx2(KIND, w, xs, stride, 2, n, r, ldr, mf); break;                                      \
            case 3: row_avx2(KIND, w, xs, stride, 3, n, r, ldr, mf); break;                                      \
            case 4: row_avx2(KIND, w, xs, stride, 4, n, r, ldr, mf); break;                                      \
            case 5: row_avx2(KIND, w, xs, stride, 5, n, r, ldr, mf); break;                                      \
            case 6: row_avx2(KIND, w, xs, stride, 6, n, r, ldr, mf); break;                                      \
            case 7: row_avx2(KIND, w, xs, stride, 7, n, r, ldr, mf); break;                                      \
            default: row_avx2(KIND, w, xs, stride, 8, n, r, ldr, mf); break;                                     \
        }                                                                                                       \
    }                                                                                                           \
}
DEFINE_AVX2_DOT(q4_k, K_Q4_K)
DEFINE_AVX2_DOT(q5_k, K_Q5_K)
DEFINE_AVX2_DOT(q6_k, K_Q6_K)
DEFINE_AVX2_DOT(q8_0, K_Q8_0)
DEFINE_AVX2_DOT(q4_0, K_Q4_0)
DEFINE_AVX2_DOT(q4_1, K_Q4_1)
DEFINE_AVX2_DOT(q5_0, K_Q5_0)
DEFINE_AVX2_DOT(q5_1, K_Q5_1)

/* rows4_fn: one token, four rows against their inputs side by side, step by step (each row's lines asked for
 * ROWS4_PREFETCH bytes ahead), the same steps in the same order as the dot products (the same bits). */
#define DEFINE_AVX2_ROWS4(NAME, KIND)                                                                           \
Q8A_TARGET static void rows4_##NAME##_q8avx2(const char *const *rows, const void *const *scales, int group,      \
                                             const float *const *x, int n, float *const *res) {                 \
    (void)scales, (void)group;                                                                                  \
    const int block = avx2_block(KIND), step_bytes = block_bytes(KIND), per = n / 32 > 0 ? n / 32 : 1;          \
    q8_view xv[4];                                                                                              \
    __m256 acc[4];                                                                                              \
    float mf[4 * per];  /* each row's offsets */                                                                \
    for (int j = 0; j < 4; j++) xv[j] = q8_at(x[j], n, block), acc[j] = _mm256_setzero_ps();                   \
    for (int s = 0; s < n / block; s++)                                                                         \
        _Pragma("GCC unroll 4")  /* the accumulators in registers */                                            \
        for (int j = 0; j < 4; j++) {                                                                           \
            const uint8_t *w = (const uint8_t *)rows[j] + (size_t)s * step_bytes;                               \
            for (int o = 0; o < step_bytes; o += 64) PREFETCH_AHEAD(w + o);                                     \
            step_avx2(KIND, w, s, 1, &xv[j], &acc[j], mf + (size_t)j * per);                                   \
        }                                                                                                       \
    for (int j = 0; j < 4; j++) *res[j] = row_end(KIND, &xv[j], n, acc[j], mf + (size_t)j * per);               \
}
DEFINE_AVX2_ROWS4(q4_k, K_Q4_K)
DEFINE_AVX2_ROWS4(q5_k, K_Q5_K)
DEFINE_AVX2_ROWS4(q6_k, K_Q6_K)
DEFINE_AVX2_ROWS4(q8_0, K_Q8_0)
DEFINE_AVX2_ROWS4(q4_0, K_Q4_0)
DEFINE_AVX2_ROWS4(q4_1, K_Q4_1)
DEFINE_AVX2_ROWS4(q5_0, K_Q5_0)
DEFINE_AVX2_ROWS4(q5_1, K_Q5_1)

rows4_fn q8_avx2_rows4(int kind) {
    switch (kind) {
        case K_Q4_K: return rows4_q4_k_q8avx2;
        case K_Q5_K: return rows4_q5_k_q8avx2;
        case K_Q6_K: return rows4_q6_k_q8avx2;
        case K_Q4_0: return rows4_q4_0_q8avx2;
        case K_Q4_1: return rows4_q4_1_q8avx2;
        case K_Q5_0: return rows4_q5_0_q8avx2;
        case K_Q5_1: return rows4_q5_1_q8avx2;
        default: return rows4_q8_0_q8avx2;
    }
}

dot_fn q8_avx2_dot(int kind) {
    switch (kind) {
        case K_Q4_K: return dot_q4_k_q8avx2;
        case K_Q5_K: return dot_q5_k_q8avx2;
        case K_Q6_K: return dot_q6_k_q8avx2;
        case K_Q4_0: return dot_q4_0_q8avx2;
        case K_Q4_1: return dot_q4_1_q8avx2;
        case K_Q5_0: return dot_q5_0_q8avx2;
        case K_Q5_1: return dot_q5_1_q8avx2;
        default: return dot_q8_0_q8avx2;
    }
}
