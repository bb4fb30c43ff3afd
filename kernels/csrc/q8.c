/* One token of GGUF blocks against int8 activations, as llama.cpp computes them: the token's values quantized per
 * block (Q8_0: 32 values and a float scale; the K formats: 256 values, a float scale and the sums of each 16), then
 * integer products of the codes (vpmaddubsw: unsigned codes by signed activations, pairs summed into 16 bits;
 * vpmaddwd by the sub-block scales into 32 bits), one float multiply per block or superblock. Per 64 weights a few
 * integer instructions, against the float path's unpacking of each value (blocks.h), which cannot keep up with the
 * memory on two cores. Taken by the AVX512_BF16 variant, where activations are bf16 (rounded) anyway; the
 * instructions themselves are AVX-512 BW. Q4_K, Q5_K, Q6_K and Q8_0 (the formats of Q4_K_M, Q5_K_M, Q6_K and Q8_0
 * files); the others keep the float path.
 *
 * Activations (`q8_inputs`, into the caller's scratch): int8 q[n], then (64-byte aligned) float d[n / block], then
 * for the K formats int16 bsums[n / 16] (the sum of each 16 codes, for the formats' offsets).
 *
 * Letters: S superblocks (256 values) of a row, P pairs of 16-bit products.
 */
#include "common.h"
#include "blocks.h"

#define Q8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

static inline size_t align64(size_t n) { return (n + 63) / 64 * 64; }

/* Where the parts of a quantized input lie. */
typedef struct { const int8_t *q; const float *d; const int16_t *bsums; } q8_view;
static inline q8_view q8_at(const void *buf, int n, int block) {
    const char *b = (const char *)buf;
    const q8_view v = {(const int8_t *)b, (const float *)(b + align64((size_t)n)),
                       (const int16_t *)(b + align64((size_t)n) + align64((size_t)(n / block) * 4))};
    return v;
}

int q8_block(int kind) { return kind == K_Q8_0 ? 32 : 256; }
int q8_serves(int kind) { return kind == K_Q4_K || kind == K_Q5_K || kind == K_Q6_K || kind == K_Q8_0; }

/* x [n] -> buf: per block of `block` values, d = max|x| / 127 and q = round(x / d) (as llama.cpp's quantize_row_q8_K
 * and q8_0); bsums per 16 for the K formats. */
Q8_TARGET void q8_inputs(int kind, const float *x, int n, void *buf) {
    const int block = q8_block(kind);
    char *b = (char *)buf;
    int8_t *q = (int8_t *)b;
    float *d = (float *)(b + align64((size_t)n));
    int16_t *bsums = (int16_t *)(b + align64((size_t)n) + align64((size_t)(n / block) * 4));
    for (int k = 0; k < n / block; k++) {
        const float *xs = x + (size_t)k * block;
        __m512 m = _mm512_setzero_ps();
        for (int j = 0; j < block; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xs + j)));
        const float amax = _mm512_reduce_max_ps(m);
        const float scale = amax / 127.f, inv = amax > 0 ? 127.f / amax : 0.f;
        d[k] = scale;
        for (int j = 0; j < block; j += 16) {
            const __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs + j), _mm512_set1_ps(inv)),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i *)(q + (size_t)k * block + j), _mm512_cvtsepi32_epi8(v));
            if (block == 256) bsums[(size_t)k * 16 + j / 16] = (int16_t)_mm512_reduce_add_epi32(v);
        }
    }
}

/* 16-bit lanes 0-15 a, 16-31 b. */
Q8_TARGET static inline __m512i halves16(int a, int b) {
    return _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)a), _mm512_set1_epi16((short)b));
}
/* Two 32-byte runs as one vector. */
Q8_TARGET static inline __m512i two256(const void *lo, const void *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}

/* ---- Q4_K: superblock = d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (bytes 32i..32i+31:
 * sub-block 2i low, 2i + 1 high). sum = d dx sum_j sc_j (q_j . x_j) - dmin dx sum_j m_j bsum_j. Q5_K (`five`): the
 * same with qh[32] before the nibbles, bit i of byte l the fifth bit of sub-block i's value l ---------------- */
Q8_TARGET static inline void q4k_super(const uint8_t *blk, const int8_t *xq, float dx, const int16_t *bs,
                                       __m512 *acc, float *offset, int five) {
    /* the 12 bytes as three words a, b, c: scales 0-3 the low 6 bits of a's bytes, mins 0-3 of b's; scales 4-7 the
     * low nibbles of c's bytes with a's top two bits above them, mins 4-7 c's high nibbles with b's top bits */
    uint32_t w[3];
    memcpy(w, blk + 4, 12);
    const uint32_t six = 0x3f3f3f3fu, nib = 0x0f0f0f0fu, top = 0x03030303u;
    const uint32_t sw[2] = {w[0] & six, (w[2] & nib) | ((w[0] >> 6) & top) << 4};
    const uint32_t mw[2] = {w[1] & six, ((w[2] >> 4) & nib) | ((w[1] >> 6) & top) << 4};
    uint8_t sc[8];
    memcpy(sc, sw, 8);
    /* sum_i m_i (bsum_2i + bsum_2i+1): each min over its two 16-value sums */
    const __m128i m8 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)mw));  /* 8 mins, 16-bit */
    const __m256i m16 = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
    const __m256i mins = _mm256_madd_epi16(m16, _mm256_loadu_si256((const __m256i *)bs));
    const __m512i low = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    const uint8_t *qs = blk + (five ? 48 : 16);
    __m512i qh = _mm512_setzero_si512();
    if (five) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
        qh = _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
    }
    __m512i isum = _mm512_setzero_si512();
    for (int p = 0; p < 2; p++) {  /* 64 bytes: sub-blocks 4p (low nibbles of bytes 0-31), 4p + 1 (their high),
                                    * 4p + 2 (low of bytes 32-63), 4p + 3 (high) */
        const __m512i v = _mm512_loadu_si512((const void *)(qs + 64 * p));
        __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if (five) {  /* each half's sub-block's bit of qh, as bit 4 */
            const __m512i s_lo = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(4 * p)),
                                                         _mm512_set1_epi16((short)(4 * p + 2)));
            const __m512i s_hi = _mm512_add_epi16(s_lo, _mm512_set1_epi16(1));
            lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, s_lo), one), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, s_hi), one), 4));
        }
        const int8_t *x = xq + 128 * p;
        const __m512i plo = _mm512_maddubs_epi16(lo, two256(x, x + 64));      /* sub-blocks 4p, 4p + 2 */
        const __m512i phi = _mm512_maddubs_epi16(hi, two256(x + 32, x + 96)); /* 4p + 1, 4p + 3 */
        isum = _mm512_add_epi32(isum, _mm512_madd_epi16(plo, halves16(sc[4 * p], sc[4 * p + 2])));
        isum = _mm512_add_epi32(isum, _mm512_madd_epi16(phi, halves16(sc[4 * p + 1], sc[4 * p + 3])));
    }
    const float d = f16f(blk) * dx;
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d), *acc);
    /* the mins' 8 lanes into the accumulator too, times -dmin dx */
    const __m512 m = _mm512_castps256_ps512(_mm256_cvtepi32_ps(mins));
    *acc = _mm512_mask3_fmadd_ps(m, _mm512_set1_ps(-f16f(blk + 2) * dx), *acc, 0xFF);
    (void)offset;
}

/* ---- Q6_K: superblock = ql[128], qh[64], int8 scales[16] (one per 16 values), d. Per half of 128 values, ql's 64
 * bytes' low nibbles are values 0-63 in order and their high nibbles 64-127; qh's 32 bytes give 2 bits to each of
 * four values. Codes are q + 32 (0-63, unsigned for vpmaddubsw): sum = d dx (sum_g sc_g (q'_g . x_g) - 32 sum_g
 * sc_g bsum_g) ---------------------------------------------------------------------------------------------- */
Q8_TARGET static inline void q6k_super(const uint8_t *blk, const int8_t *xq, float dx, const int16_t *bs,
                                       __m512 *acc, float *offset) {
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    /* the offsets' sum_g sc_g bsum_g, 8 lanes of pairs (summed with the products below) */
    const __m256i bias = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)bs));
    const __m512i scales = _mm512_castsi256_si512(sc16);
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3);
    const __m512i shift_a = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);  /* 0 | 2 */
    const __m512i shift_b = _mm512_add_epi16(shift_a, _mm512_set1_epi16(4));                     /* 4 | 6 */
    /* each 16 values' scale over its 8 lanes of products: groups 0-3, 4-7, 8-11, 12-15 */
    const __m512i ia = _mm512_set_epi16(
        3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i four = _mm512_set1_epi16(4);
    const __m512i s0 = _mm512_permutexvar_epi16(ia, scales), s1 = _mm512_permutexvar_epi16(_mm512_add_epi16(ia, four), scales);
    const __m512i ib = _mm512_add_epi16(ia, _mm512_set1_epi16(8));
    const __m512i s2 = _mm512_permutexvar_epi16(ib, scales), s3 = _mm512_permutexvar_epi16(_mm512_add_epi16(ib, four), scales);
    /* the products' sums less 32 times the offsets' (codes are q + 32): bias's 8 lanes, times -32, into lanes 0-7 */
    __m512i isum = _mm512_castsi256_si512(_mm256_mullo_epi32(bias, _mm256_set1_epi32(-32)));
    isum = _mm512_inserti64x4(isum, _mm256_setzero_si256(), 1);
    for (int half = 0; half < 2; half++) {
        const __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * half));
        const __m256i h256 = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
        const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(h256), h256, 1);
        const __m512i qa = _mm512_or_si512(_mm512_and_si512(v, low),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift_a), two), 4));
        const __m512i qb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift_b), two), 4));
        const int8_t *x = xq + 128 * half;
        const __m512i pa = _mm512_maddubs_epi16(qa, _mm512_loadu_si512((const void *)x));         /* values 0-63 */
        const __m512i pb = _mm512_maddubs_epi16(qb, _mm512_loadu_si512((const void *)(x + 64)));  /* 64-127 */
        isum = _mm512_add_epi32(isum, _mm512_madd_epi16(pa, half ? s2 : s0));
        isum = _mm512_add_epi32(isum, _mm512_madd_epi16(pb, half ? s3 : s1));
    }
    (void)offset;
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(f16f(blk + 208) * dx), *acc);
}

/* ---- Q8_0: blocks of d and 32 int8 codes; two blocks a step (signed by signed: |w| against x signed as w) ---- */
Q8_TARGET static inline void q8_0_pair(const uint8_t *b0, const int8_t *x, const float *dx, __m512 *acc) {
    const __m512i w = two256(b0 + 2, b0 + 36);
    const __m512i xs = _mm512_loadu_si512((const void *)x);
    const __mmask64 negative = _mm512_movepi8_mask(w);
    const __m512i sx = _mm512_mask_sub_epi8(xs, negative, _mm512_setzero_si512(), xs);
    const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), sx), _mm512_set1_epi16(1));
    const __m512 scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(f16f(b0) * dx[0]), _mm512_set1_ps(f16f(b0 + 34) * dx[1]));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, *acc);
}
Q8_TARGET static inline float q8_0_tail(const uint8_t *b, const int8_t *x, float dx) {  /* an odd last block */
    int s = 0;
    for (int j = 0; j < 32; j++) s += (int8_t)b[2 + j] * x[j];
    return f16f(b) * dx * (float)s;
}

/* A row's dot product with a quantized input (one token). */
Q8_TARGET static float row_q8(int kind, const uint8_t *w, const void *in, int n) {
    const q8_view x = q8_at(in, n, q8_block(kind));
    __m512 acc = _mm512_setzero_ps();
    float offset = 0.f;
    if (kind == K_Q8_0) {
        int b = 0;
        for (; b + 2 <= n / 32; b += 2) q8_0_pair(w + (size_t)b * 34, x.q + (size_t)b * 32, x.d + b, &acc);
        if (b < n / 32) offset += q8_0_tail(w + (size_t)b * 34, x.q + (size_t)b * 32, x.d[b]);
    } else {
        for (int s = 0; s < n / 256; s++) {
            if (kind == K_Q4_K || kind == K_Q5_K)
                q4k_super(w + (size_t)s * (kind == K_Q5_K ? 176 : 144), x.q + (size_t)s * 256, x.d[s],
                          x.bsums + 16 * s, &acc, &offset, kind == K_Q5_K);
            else q6k_super(w + (size_t)s * 210, x.q + (size_t)s * 256, x.d[s], x.bsums + 16 * s, &acc, &offset);
        }
    }
    return _mm512_reduce_add_ps(acc) + offset;
}

/* rows4_fn and dot_fn of each kind: four rows side by side, superblock by superblock (or two blocks at a time),
 * each row's lines asked for ROWS4_PREFETCH bytes ahead; the single-row form for a run's last rows. */
#define DEFINE_Q8_ROWS(NAME, KIND, STEP_VALUES, STEP_BYTES)                                                     \
Q8_TARGET void rows4_##NAME##_q8(const char *const *rows, const void *const *scales, int group,                 \
                                  const float *const *x, int n, float *const *res) {                             \
    (void)scales, (void)group;                                                                                  \
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};       \
    float offset[4] = {0, 0, 0, 0};                                                                             \
    q8_view xv[4];                                                                                              \
    for (int j = 0; j < 4; j++) xv[j] = q8_at(x[j], n, q8_block(KIND));                                        \
    const int steps = n / (STEP_VALUES);                                                                        \
    for (int s = 0; s < steps; s++) {                                                                           \
        for (int j = 0; j < 4; j++) {                                                                           \
            const uint8_t *w = (const uint8_t *)rows[j] + (size_t)s * (STEP_BYTES);                             \
            for (int o = 0; o < (STEP_BYTES); o += 64) PREFETCH_AHEAD(w + o);                                   \
            Q8_STEP_##NAME                                                                                      \
        }                                                                                                       \
    }                                                                                                           \
    for (int j = 0; j < 4; j++) {                                                                               \
        const int done = steps * (STEP_VALUES);                                                                 \
        float tail = 0.f;                                                                                       \
        if (done < n) tail = q8_0_tail((const uint8_t *)rows[j] + (size_t)done / 32 * 34, xv[j].q + done,       \
                                       xv[j].d[done / 32]);                                                     \
        *res[j] = _mm512_reduce_add_ps(acc[j]) + offset[j] + tail;                                              \
    }                                                                                                           \
}                                                                                                               \
Q8_TARGET void dot_##NAME##_q8(const void *wrow, float scale, const void *gscale, int group, const float *x,     \
                               int ldx, int nt, int n, float *res, int ldr) {                                    \
    (void)scale, (void)gscale, (void)group, (void)ldx, (void)nt, (void)ldr;                                     \
    *res = row_q8(KIND, (const uint8_t *)wrow, x, n);                                                           \
}
#define Q8_STEP_q4_k q4k_super(w, xv[j].q + (size_t)s * 256, xv[j].d[s], xv[j].bsums + 16 * s, &acc[j], &offset[j], 0);
#define Q8_STEP_q5_k q4k_super(w, xv[j].q + (size_t)s * 256, xv[j].d[s], xv[j].bsums + 16 * s, &acc[j], &offset[j], 1);
#define Q8_STEP_q6_k q6k_super(w, xv[j].q + (size_t)s * 256, xv[j].d[s], xv[j].bsums + 16 * s, &acc[j], &offset[j]);
#define Q8_STEP_q8_0 q8_0_pair(w, xv[j].q + (size_t)s * 64, xv[j].d + 2 * s, &acc[j]);
DEFINE_Q8_ROWS(q4_k, K_Q4_K, 256, 144)
DEFINE_Q8_ROWS(q5_k, K_Q5_K, 256, 176)
DEFINE_Q8_ROWS(q6_k, K_Q6_K, 256, 210)
DEFINE_Q8_ROWS(q8_0, K_Q8_0, 64, 68)
