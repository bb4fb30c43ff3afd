/* GGUF blocks against int8 activations, as llama.cpp computes them: each token's values quantized per block (32
 * values and a float scale; for the K formats 256, a float scale and the sums of each 16), then integer products of
 * the codes (vpmaddubsw: unsigned codes by signed activations, pairs summed into 16 bits; vpmaddwd by the sub-block
 * scales, or by ones, into 32 bits), one float multiply per block or superblock. Per 64 weights a few integer
 * instructions, against the float path's unpacking of each value (blocks.h), which cannot keep up with the memory on
 * two cores. Taken by the AVX512_BF16 variant, where activations are bf16 (rounded) anyway; the instructions
 * themselves are AVX-512 BW. Every GGUF format but MXFP4 blocks (the 32-value ones two blocks a step, as Q8_0's),
 * and several tokens of MXFP4 experts (gpt-oss). One token streams rows four at a time (rows4); several tokens
 * unpack each superblock of a row into registers once and multiply it with every token's codes (dot), which is where
 * a prompt's time goes.
 *
 * Activations (`q8_inputs`, into the caller's scratch): int8 q[n] (Q4_K's and Q5_K's in their nibbles' order,
 * NIBBLE_RUNS), then (64-byte aligned) float d[n / block], then
 * int16 bsums[n / 16] (the sum of each 16 codes, for the formats' offsets: the K formats and those with mins), then
 * float bx[n / 32] (each 32 values' code sum times its d: what a min multiplies, for the formats that sum their mins
 * apart). */
#include "common.h"
#include "blocks.h"

/* AVX512-VNNI too: vpdpwssd adds the scaled 16-bit products into 32 bits in one instruction (vpmaddwd and vpaddd
 * before), vpdpbusd multiplies Q8_0's bytes into 32 bits in one (vpmaddubsw and vpmaddwd by ones). The same sums:
 * no 16-bit pair of those products reaches saturation. Every CPU with AVX512_BF16 has it (api.c tk_isa_mask). */
#define Q8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
/* The odd last block's plain loops are compiled without VNNI, and not inlined: GCC 12 vectorises a signed-by-signed
 * byte dot product into vpdpbusd, which reads one side as unsigned (wrong sums, which the tests caught). */
#define Q8_TAIL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"), noinline))

/* The formats of 32-value blocks taken two at a time (Q8_0's step), and those of them with a min (value q d + m). */
static inline int pair_kind(int kind) {
    return kind == K_Q8_0 || kind == K_Q4_0 || kind == K_Q4_1 || kind == K_Q5_0 || kind == K_Q5_1 || kind == K_MXFP4;
}
static inline int has_min(int kind) { return kind == K_Q4_1 || kind == K_Q5_1; }
/* Formats whose offsets are summed once per row and token (row_sum): Q4_K's and Q5_K's mins, Q4_1's and Q5_1's. */
static inline int sums_mins(int kind) { return kind == K_Q4_K || kind == K_Q5_K || has_min(kind); }

int q8_block(int kind) { return kind == K_Q4_K || kind == K_Q5_K || kind == K_Q6_K ? 256 : 32; }
int q8_serves(int kind) { return pair_kind(kind) || kind == K_Q4_K || kind == K_Q5_K || kind == K_Q6_K; }

/* Where each run of 32 values of a Q4_K or Q5_K superblock lies in the quantized input: in the order a superblock's
 * nibbles hold them, 64 bytes of codes (low nibbles, high nibbles) holding runs 0, 2 | 1, 3 | 4, 6 | 5, 7. */
static const int8_t NIBBLE_RUNS[8] = {0, 2, 1, 3, 4, 6, 5, 7};  /* (its own inverse) */

/* x [n] -> buf: per block of `block` values, d = max|x| / 127 and q = round(x / d) (as llama.cpp's quantize_row_q8_K
 * and q8_0); bsums per 16 for the K formats and those with mins, bx per 32 for those that sum their mins apart. */
Q8_TARGET void q8_inputs(int kind, const float *x, int n, void *buf) {
    const int block = q8_block(kind);
    const q8_view at = q8_at(buf, n, block);
    int8_t *q = (int8_t *)at.q;
    float *d = (float *)at.d, *bx = (float *)at.bx;
    int16_t *bsums = (int16_t *)at.bsums;
    const int sums = block == 256 || has_min(kind), nibble_order = kind == K_Q4_K || kind == K_Q5_K;
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
            /* Q4_K's and Q5_K's codes in the order of the weights' nibbles (q4k_weights); the sums of 16 stay in
             * value order */
            const int at = nibble_order ? NIBBLE_RUNS[j / 32] * 32 + j % 32 : j;
            _mm_storeu_si128((__m128i *)(q + (size_t)k * block + at), _mm512_cvtsepi32_epi8(v));
            if (sums) bsums[(size_t)k * block / 16 + j / 16] = (int16_t)_mm512_reduce_add_epi32(v);
        }
    }
    if (sums_mins(kind))
        for (int i = 0; i < n / 32; i++) bx[i] = d[i * 32 / block] * (float)(bsums[2 * i] + bsums[2 * i + 1]);
}

/* Two 32-byte runs as one vector. */
Q8_TARGET static inline __m512i two256(const void *lo, const void *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}

/* One K superblock's weights, unpacked once for every token that meets them: four vectors of unsigned codes, each
 * against the next 64 of the input's codes as q8_inputs lays them (q), the 16-bit sub-block scales over each one's
 * products (sc), and d. Q6_K also its 16 scales (sc16), for the codes' offset of 32: sum = d dx (sum_i (q_i . x_i by sc_i) - 32 sc16 . bsums),
 * all of it in integers. Q4_K's and Q5_K's offsets, -dmin m_j times each sub-block's code sum, are summed apart:
 * the weights' side as floats into the row's `mf` (q4k_weights), once per row for all its tokens (row_sum). */
typedef struct { __m512i q[4], sc[4]; __m256i sc16; float d; } k_super;

Q8_TARGET static inline __m512 k_token(const k_super *w, int q6, const int8_t *x, float dx, const int16_t *bs,
                                       __m512 acc) {
    __m512i isum = _mm512_madd_epi16(_mm512_maddubs_epi16(w->q[0], _mm512_loadu_si512((const void *)x)), w->sc[0]);
    for (int i = 1; i < 4; i++)
        isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(w->q[i], _mm512_loadu_si512((const void *)(x + 64 * i))),
                                   w->sc[i]);
    if (q6) {  /* less 32 times each scale over its 16 codes' sum: 8 lanes of pairs */
        const __m256i o = _mm256_madd_epi16(w->sc16, _mm256_loadu_si256((const __m256i *)bs));
        isum = _mm512_sub_epi32(isum, _mm512_zextsi256_si512(_mm256_slli_epi32(o, 5)));
    }
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(w->d * dx), acc);
}

/* ---- Q4_K: superblock = d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (bytes 32i..32i+31:
 * sub-block 2i low, 2i + 1 high). sum = d dx sum_j sc_j (q_j . x_j) - dmin dx sum_j m_j bsum_j. Q5_K (`five`): the
 * same with qh[32] before the nibbles, bit i of byte l the fifth bit of sub-block i's value l ---------------- */

/* The 12 bytes at blk + 4 as the 8 scales (bytes 0-7) and the 8 mins (bytes 8-15). As three words a, b, c: scales
 * 0-3 the low 6 bits of a's bytes, mins 0-3 of b's; scales 4-7 the low nibbles of c's bytes with a's top two bits
 * above them, mins 4-7 c's high nibbles with b's top bits. */
Q8_TARGET static inline __m128i q4k_scales_mins(const uint8_t *blk) {
    const __m128i s = _mm_loadu_si128((const __m128i *)blk), m4 = _mm_set1_epi8(15);
    const __m128i ab = _mm_shuffle_epi8(s, _mm_setr_epi8(4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 10, 11, 8, 9, 10, 11));
    const __m128i c = _mm_shuffle_epi8(s, _mm_setr_epi8(12, 13, 14, 15, 12, 13, 14, 15, 12, 13, 14, 15, 12, 13, 14, 15));
    const __m128i c4 = _mm_mask_blend_epi8(0xF000, _mm_and_si128(c, m4), _mm_and_si128(_mm_srli_epi16(c, 4), m4));
    const __m128i top = _mm_and_si128(_mm_srli_epi16(ab, 2), _mm_set1_epi8(0x30));  /* bits 6-7 as 4-5 */
    return _mm_mask_blend_epi8(0xF0F0, _mm_and_si128(ab, _mm_set1_epi8(63)), _mm_or_si128(c4, top));
}

/* A 16-bit vpshufb control: word a of each 128-bit lane in the low 256 bits' lanes, word b in the high ones'. */
#define WORD_PICK(a, b) _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(0x0100 + 0x0202 * (a))), \
                                                _mm512_set1_epi16((short)(0x0100 + 0x0202 * (b))))

/* The four code vectors are the nibbles as they lie (the input's codes are in that order: NIBBLE_RUNS): low
 * nibbles of bytes 0-63 (sub-blocks 0 | 2), their high nibbles (1 | 3), then 4 | 6 and 5 | 7 from bytes 64-127;
 * each vector's scales over its 16-bit lanes by one vpshufb of the scales repeated in each 128-bit lane. */
Q8_TARGET static inline k_super q4k_weights(const uint8_t *blk, int five, float *mf) {
    k_super w;
    uint32_t dd;
    memcpy(&dd, blk, 4);
    const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd));  /* exact, as f16f */
    const __m128i sm = q4k_scales_mins(blk);
    const __m512i sc = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(sm));
    w.sc[0] = _mm512_shuffle_epi8(sc, WORD_PICK(0, 2)), w.sc[1] = _mm512_shuffle_epi8(sc, WORD_PICK(1, 3));
    w.sc[2] = _mm512_shuffle_epi8(sc, WORD_PICK(4, 6)), w.sc[3] = _mm512_shuffle_epi8(sc, WORD_PICK(5, 7));
    /* the 8 mins times -dmin, as floats: what each sub-block's code sum times dx is multiplied by */
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
    _mm256_storeu_ps(mf, _mm256_mul_ps(mins, _mm256_set1_ps(-_mm_cvtss_f32(_mm_movehdup_ps(d_dmin)))));
    const __m512i low = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    const uint8_t *qs = blk + (five ? 48 : 16);
    __m512i qh = _mm512_setzero_si512();
    if (five) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
        qh = _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
    }
    for (int p = 0; p < 2; p++) {  /* 64 bytes: sub-blocks 4p | 4p + 2 (low nibbles), 4p + 1 | 4p + 3 (high) */
        const __m512i v = _mm512_loadu_si512((const void *)(qs + 64 * p));
        __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if (five) {  /* each half's sub-block's bit of qh, as bit 4 */
            const __m512i s_lo = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(4 * p)),
                                                         _mm512_set1_epi16((short)(4 * p + 2)));
            const __m512i s_hi = _mm512_add_epi16(s_lo, _mm512_set1_epi16(1));
            lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, s_lo), one), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, s_hi), one), 4));
        }
        w.q[2 * p] = lo, w.q[2 * p + 1] = hi;
    }
    w.sc16 = _mm256_setzero_si256(), w.d = _mm_cvtss_f32(d_dmin);
    return w;
}

/* ---- Q6_K: superblock = ql[128], qh[64], int8 scales[16] (one per 16 values), d. Per half of 128 values, ql's 64
 * bytes' low nibbles are values 0-63 in order and their high nibbles 64-127; qh's 32 bytes give 2 bits to each of
 * four values. Codes are q + 32 (0-63, unsigned for vpmaddubsw): sum = d dx (sum_g sc_g (q'_g . x_g) - 32 sum_g
 * sc_g bsum_g) ---------------------------------------------------------------------------------------------- */
Q8_TARGET static inline k_super q6k_weights(const uint8_t *blk) {
    k_super w;
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    const __m512i scales = _mm512_castsi256_si512(sc16);
    const __m512i low = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30);
    /* each value's two bits of qh to bits 4-5, then masked: of the low nibbles' values (groups 0 | 1 of qh's bits)
     * shifted left 4 | 2, of the high nibbles' (groups 2 | 3) right 0 | 2 */
    const __m512i left = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(4), _mm512_set1_epi16(2));
    const __m512i right = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_setzero_si512(), _mm512_set1_epi16(2));
    /* each 16 values' scale over its 8 lanes of products: groups 0-3, 4-7, 8-11, 12-15 */
    const __m512i ia = _mm512_set_epi16(
        3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int i = 0; i < 4; i++)
        w.sc[i] = _mm512_permutexvar_epi16(_mm512_add_epi16(ia, _mm512_set1_epi16((short)(4 * i))), scales);
    for (int half = 0; half < 2; half++) {  /* values 0-63 of the half, then 64-127 */
        const __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * half));
        const __m256i h256 = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
        const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(h256), h256, 1);
        const __m512i h_lo = _mm512_and_si512(_mm512_sllv_epi16(h, left), bits45);
        const __m512i h_hi = _mm512_and_si512(_mm512_srlv_epi16(h, right), bits45);
        w.q[2 * half] = _mm512_ternarylogic_epi32(v, low, h_lo, 0xEA);  /* (v & low) | h_lo */
        w.q[2 * half + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low, h_hi, 0xEA);
    }
    w.sc16 = sc16;
    w.d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(blk[208] | blk[209] << 8)));  /* exact, as f16f */
    return w;
}

/* Two f16 fields (at a and b) as floats in lanes 0 and 1, exactly as f16f: F16C. */
Q8_TARGET static inline __m128 two_f16(const uint8_t *a, const uint8_t *b) {
    uint16_t ha, hb;
    memcpy(&ha, a, 2), memcpy(&hb, b, 2);
    return _mm_cvtph_ps(_mm_insert_epi16(_mm_cvtsi32_si128(ha), (short)hb, 1));
}
/* Lanes 0 and 1 of v over the low and high 8 lanes: a pair's two block scales over their products. */
Q8_TARGET static inline __m512 pair_spread(__m128 v) {
    const __m512i two_halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(two_halves, _mm512_castps128_ps512(v));
}

/* ---- Q8_0: blocks of d and 32 int8 codes; two blocks a step (signed by signed: |w| against x signed as w) ---- */
typedef struct { __m512i w; __mmask64 negative; __m128 d; } q8_0_pair_w;  /* d: the two blocks' in lanes 0, 1 */
Q8_TARGET static inline q8_0_pair_w q8_0_weights(const uint8_t *b0) {
    const __m512i w = two256(b0 + 2, b0 + 36);
    const q8_0_pair_w p = {_mm512_abs_epi8(w), _mm512_movepi8_mask(w), two_f16(b0, b0 + 34)};
    return p;
}
Q8_TARGET static inline __m512 q8_0_token(const q8_0_pair_w *p, const int8_t *x, const float *dx, __m512 acc) {
    const __m512i xs = _mm512_loadu_si512((const void *)x);
    const __m512i sx = _mm512_mask_sub_epi8(xs, p->negative, _mm512_setzero_si512(), xs);
    const __m512i prod = _mm512_dpbusd_epi32(_mm512_setzero_si512(), p->w, sx);
    /* the two blocks' scales times the input's (one 8-byte load), spread over their 8 lanes each */
    const __m512 dd = pair_spread(_mm_mul_ps(p->d, _mm_castpd_ps(_mm_load_sd((const double *)dx))));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(prod), dd, acc);
}
/* Two blocks' 16 bytes of nibbles (at a and b; low nibbles values 0-15, high 16-31) as 64 codes in value order. */
Q8_TARGET static inline __m512i nibbles_pair(const uint8_t *a, const uint8_t *b) {
    const __m256i v = _mm256_loadu2_m128i((const __m128i *)b, (const __m128i *)a), low = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                              _mm256_permute2x128_si256(lo, hi, 0x31), 1);
}

/* ---- MXFP4 (the experts' layout: 16 code bytes a block, low nibbles values 0-15, high 16-31; the E8M0 scales
 * apart): two blocks a step, as Q8_0's: each code's magnitude, twice its E2M1 value (0-12, whole), looked up with
 * vpshufb, its sign bit as the mask, half the block's scale as d (value = magnitude * d, exactly) ---------- */
Q8_TARGET static inline q8_0_pair_w mxfp4_weights(const uint8_t *codes, const uint8_t *e) {
    const __m512i c = nibbles_pair(codes, codes + 16);
    const __m512i magnitudes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12));
    const __m128 d = _mm_setr_ps(e8m0_half(e[0]), e8m0_half(e[1]), 0.f, 0.f);
    const q8_0_pair_w p = {_mm512_shuffle_epi8(magnitudes, c), _mm512_test_epi8_mask(c, _mm512_set1_epi8(8)), d};
    return p;
}
Q8_TAIL_TARGET static float mxfp4_tail(const uint8_t *codes, uint8_t e, const int8_t *x, float dx) {  /* odd last */
    float s = 0.f;
    for (int j = 0; j < 16; j++) s += E2M1X2[codes[j] & 15] * x[j] + E2M1X2[codes[j] >> 4] * x[j + 16];
    return e8m0_half(e) * dx * s;
}

/* ---- Q4_0 (d, 16 bytes of nibbles: q - 8), Q4_1 (d, m, nibbles: q d + m), Q5_0 (d, 32 fifth bits, nibbles:
 * q - 16), Q5_1 (d, m, fifth bits, nibbles): two blocks a step as Q8_0's, their codes signed as w = q - 8 or q - 16
 * (|w| against x signed as w), or with a min unsigned as they are, the mins (m) into the row's mf for row_sum ---- */
/* Any pair kind's two blocks at b0 (MXFP4: their scales at e). */
Q8_TARGET static inline q8_0_pair_w pair_weights(int kind, const uint8_t *b0, const uint8_t *e, float *mf) {
    if (kind == K_Q8_0) return q8_0_weights(b0);
    if (kind == K_MXFP4) return mxfp4_weights(b0, e);
    const uint8_t *b1 = b0 + block_bytes(kind);
    const int mins = has_min(kind), five = kind == K_Q5_0 || kind == K_Q5_1, at_h = 2 + 2 * mins;
    const int at_q = at_h + 4 * five;
    __m512i c = nibbles_pair(b0 + at_q, b1 + at_q);
    if (five) {  /* bit j of a block's qh: value j's fifth bit */
        uint32_t h0, h1;
        memcpy(&h0, b0 + at_h, 4), memcpy(&h1, b1 + at_h, 4);
        c = _mm512_or_si512(c, _mm512_maskz_mov_epi8((__mmask64)h1 << 32 | h0, _mm512_set1_epi8(16)));
    }
    q8_0_pair_w p;
    p.d = two_f16(b0, b1);
    if (mins) {
        p.w = c, p.negative = 0;
        _mm_storel_pi((__m64 *)mf, two_f16(b0 + 2, b1 + 2));
    } else {
        const __m512i w = _mm512_sub_epi8(c, _mm512_set1_epi8(five ? 16 : 8));
        p.w = _mm512_abs_epi8(w), p.negative = _mm512_movepi8_mask(w);
    }
    return p;
}

/* A row's odd last block of a pair kind (MXFP4: its scale at e; its min, if it has one, into *mf for row_sum). */
Q8_TAIL_TARGET static float pair_tail(int kind, const uint8_t *b, const uint8_t *e, const int8_t *x, float dx,
                                      float *mf) {
    if (kind == K_MXFP4) return mxfp4_tail(b, *e, x, dx);
    int s = 0;
    if (kind == K_Q8_0) {
        for (int j = 0; j < 32; j++) s += (int8_t)b[2 + j] * x[j];
        return f16f(b) * dx * (float)s;
    }
    const int mins = has_min(kind), five = kind == K_Q5_0 || kind == K_Q5_1, at_h = 2 + 2 * mins;
    const int at_q = at_h + 4 * five, offset = mins ? 0 : five ? 16 : 8;
    uint32_t h = 0;
    if (five) memcpy(&h, b + at_h, 4);
    for (int j = 0; j < 16; j++) {
        const int lo = (b[at_q + j] & 15) | (int)((h >> j) & 1) << 4;
        const int hi = (b[at_q + j] >> 4) | (int)((h >> (j + 16)) & 1) << 4;
        s += (lo - offset) * x[j] + (hi - offset) * x[j + 16];
    }
    if (mins) *mf = f16f(b + 2);
    return f16f(b) * dx * (float)s;
}

/* One step of a row (a K superblock, or a pair of 32-value blocks) against M inputs: its weights unpacked once, then
 * multiplied with each input's codes into that input's accumulator. e: the row's MXFP4 scales (else unused). The
 * formats that sum their mins apart put the step's mins into mf (the row's, for row_sum). */
Q8_TARGET static inline __attribute__((always_inline)) void row_step(int kind, const uint8_t *w, const uint8_t *e,
                                                                      int s, int M, const q8_view *xv, __m512 *acc,
                                                                      float *mf) {
    if (pair_kind(kind)) {
        const q8_0_pair_w p = pair_weights(kind, w, e + 2 * (size_t)s, mf + 2 * (size_t)s);
        for (int j = 0; j < M; j++) acc[j] = q8_0_token(&p, xv[j].q + (size_t)s * 64, xv[j].d + 2 * s, acc[j]);
        return;
    }
    const k_super k = kind == K_Q6_K ? q6k_weights(w) : q4k_weights(w, kind == K_Q5_K, mf + 8 * (size_t)s);
    for (int j = 0; j < M; j++)
        acc[j] = k_token(&k, kind == K_Q6_K, xv[j].q + (size_t)s * 256, xv[j].d[s], xv[j].bsums + 16 * s, acc[j]);
}

/* Bytes of a block in a row (MXFP4: its codes; the scales lie apart), and the values and bytes of a row_step. */
#define ROW_BLOCK_BYTES(kind) ((kind) == K_MXFP4 ? 16 : block_bytes(kind))
#define STEP_VALUES(kind) (pair_kind(kind) ? 64 : 256)
#define STEP_BYTES(kind) (pair_kind(kind) ? 2 * ROW_BLOCK_BYTES(kind) : block_bytes(kind))

/* Floats of a row's mins (mf) a kind needs: one per 32 values where sums_mins (at least 1: an array's length). */
#define MINS(kind, n) (sums_mins(kind) ? (n) / 32 : 1)

/* The sum of an accumulator: a pair kind's odd last block if the row has one; the offsets of the kinds that sum
 * their mins apart (the row's mins mf against the input's bx, n / 32 of each). */
Q8_TARGET static inline float row_sum(int kind, const uint8_t *w, const uint8_t *e, const q8_view *x, int n,
                                      __m512 acc, float *mf) {
    const int done = n / STEP_VALUES(kind) * STEP_VALUES(kind);
    const float tail = done < n ? pair_tail(kind, w + (size_t)done / 32 * ROW_BLOCK_BYTES(kind), e + done / 32,
                                            x->q + done, x->d[done / 32], mf + done / 32) : 0.f;
    if (sums_mins(kind))
        for (int i = 0; i < n / 32; i += 16) {
            const __mmask16 m = n / 32 - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n / 32 - i)) - 1);
            acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, mf + i), _mm512_maskz_loadu_ps(m, x->bx + i), acc);
        }
    return _mm512_reduce_add_ps(acc) + tail;
}

/* M inputs (a constant at each call) against one row: step by step, each step's weights unpacked once for all M. */
Q8_TARGET static inline __attribute__((always_inline)) void row_inputs(int kind, const uint8_t *w,
                                                                        const uint8_t *e, const char *x,
                                                                        size_t stride, int M, int n, float *res,
                                                                        int ldr, float *mf) {
    q8_view xv[8];
    __m512 acc[8];
    for (int j = 0; j < M; j++) xv[j] = q8_at(x + (size_t)j * stride, n, q8_block(kind)), acc[j] = _mm512_setzero_ps();
    for (int s = 0; s < n / STEP_VALUES(kind); s++) {
        const uint8_t *ws = w + (size_t)s * STEP_BYTES(kind);
        for (int o = 0; o < STEP_BYTES(kind); o += 64) PREFETCH_AHEAD(ws + o);  /* (the next rows: the thread's next) */
        row_step(kind, ws, e, s, M, xv, acc, mf);
    }
    for (int j = 0; j < M; j++) res[(size_t)j * ldr] = row_sum(kind, w, e, &xv[j], n, acc[j], mf);
}

/* rows4_fn and dot_fn of each kind. rows4: four rows against one input side by side, step by step, each row's
 * lines asked for ROWS4_PREFETCH bytes ahead. dot: one row against nt inputs, quantized at x with q8_stride(n) bytes
 * between them (ldx, in floats, is that stride / 4), eight at a time; the same steps in the same order, so a row's
 * result for an input is the same bits in either. (MXFP4 has no rows4: one token of it takes vdpbf16ps, mxfp4_dp.) */
#define DEFINE_Q8_ROWS4(NAME, KIND)                                                                             \
Q8_TARGET static void rows4_##NAME##_q8(const char *const *rows, const void *const *scales, int group,          \
                                         const float *const *x, int n, float *const *res) {                      \
    (void)scales, (void)group;                                                                                  \
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};       \
    q8_view xv[4];                                                                                              \
    float mf[4 * MINS(KIND, n)];  /* each row's mins */                                                         \
    for (int j = 0; j < 4; j++) xv[j] = q8_at(x[j], n, q8_block(KIND));                                        \
    for (int s = 0; s < n / STEP_VALUES(KIND); s++)                                                             \
        _Pragma("GCC unroll 4")  /* the accumulators in registers */                                            \
        for (int j = 0; j < 4; j++) {                                                                           \
            const uint8_t *w = (const uint8_t *)rows[j] + (size_t)s * STEP_BYTES(KIND);                         \
            for (int o = 0; o < STEP_BYTES(KIND); o += 64) PREFETCH_AHEAD(w + o);                               \
            row_step(KIND, w, NULL, s, 1, &xv[j], &acc[j], mf + (size_t)j * MINS(KIND, n));                     \
        }                                                                                                       \
    for (int j = 0; j < 4; j++)                                                                                 \
        *res[j] = row_sum(KIND, (const uint8_t *)rows[j], NULL, &xv[j], n, acc[j], mf + (size_t)j * MINS(KIND, n)); \
}
#define DEFINE_Q8_DOT(NAME, KIND)                                                                               \
Q8_TARGET static void dot_##NAME##_q8(const void *wrow, float scale, const void *gscale, int group, const float *x, \
                                      int ldx, int nt, int n, float *res, int ldr) {                             \
    (void)scale, (void)group;                                                                                   \
    const uint8_t *w = (const uint8_t *)wrow, *e = (const uint8_t *)gscale;  /* (e: MXFP4's scales) */          \
    const size_t stride = (size_t)ldx * sizeof(float);                                                          \
    float mf[MINS(KIND, n)];  /* the row's mins */                                                              \
    for (int t = 0; t < nt; t += 8) {                                                                           \
        const char *xs = (const char *)x + (size_t)t * stride;                                                  \
        float *r = res + (size_t)t * ldr;                                                                       \
        switch (nt - t < 8 ? nt - t : 8) {  /* constant M per case: the accumulators stay in registers */      \
            case 1: row_inputs(KIND, w, e, xs, stride, 1, n, r, ldr, mf); break;                                 \
            case 2: row_inputs(KIND, w, e, xs, stride, 2, n, r, ldr, mf); break;                                 \
            case 3: row_inputs(KIND, w, e, xs, stride, 3, n, r, ldr, mf); break;                                 \
            case 4: row_inputs(KIND, w, e, xs, stride, 4, n, r, ldr, mf); break;                                 \
            case 5: row_inputs(KIND, w, e, xs, stride, 5, n, r, ldr, mf); break;                                 \
            case 6: row_inputs(KIND, w, e, xs, stride, 6, n, r, ldr, mf); break;                                 \
            case 7: row_inputs(KIND, w, e, xs, stride, 7, n, r, ldr, mf); break;                                 \
            default: row_inputs(KIND, w, e, xs, stride, 8, n, r, ldr, mf); break;                                \
        }                                                                                                       \
    }                                                                                                           \
}
#define DEFINE_Q8_ROWS(NAME, KIND) DEFINE_Q8_ROWS4(NAME, KIND) DEFINE_Q8_DOT(NAME, KIND)
DEFINE_Q8_ROWS(q4_k, K_Q4_K)
DEFINE_Q8_ROWS(q5_k, K_Q5_K)
DEFINE_Q8_ROWS(q6_k, K_Q6_K)
DEFINE_Q8_ROWS(q8_0, K_Q8_0)
DEFINE_Q8_ROWS(q4_0, K_Q4_0)
DEFINE_Q8_ROWS(q4_1, K_Q4_1)
DEFINE_Q8_ROWS(q5_0, K_Q5_0)
DEFINE_Q8_ROWS(q5_1, K_Q5_1)
DEFINE_Q8_DOT(mxfp4, K_MXFP4)

rows4_fn q8_rows4(int kind) {
    switch (kind) {
        case K_Q4_K: return rows4_q4_k_q8;
        case K_Q5_K: return rows4_q5_k_q8;
        case K_Q6_K: return rows4_q6_k_q8;
        case K_Q4_0: return rows4_q4_0_q8;
        case K_Q4_1: return rows4_q4_1_q8;
        case K_Q5_0: return rows4_q5_0_q8;
        case K_Q5_1: return rows4_q5_1_q8;
        default: return rows4_q8_0_q8;
    }
}
dot_fn q8_dot(int kind) {
    switch (kind) {
        case K_Q4_K: return dot_q4_k_q8;
        case K_Q5_K: return dot_q5_k_q8;
        case K_Q6_K: return dot_q6_k_q8;
        case K_Q4_0: return dot_q4_0_q8;
        case K_Q4_1: return dot_q4_1_q8;
        case K_Q5_0: return dot_q5_0_q8;
        case K_Q5_1: return dot_q5_1_q8;
        case K_MXFP4: return dot_mxfp4_q8;
        default: return dot_q8_0_q8;
    }
}

/* Inside a parallel region: rows [0, T) of x (row t at x + t * ldx) quantized for `kind` and the variant `isa`
 * (AVX2: q8avx2.c's layout) into buf, row t at t * q8_stride(n) bytes, shared out over the threads. Ends with a
 * barrier. */
void q8_rows(int kind, int isa, const float *x, size_t ldx, int T, int n, void *buf) {
    #pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        char *row = (char *)buf + (size_t)t * q8_stride(n);
        if (isa == ISA_AVX2) q8_inputs_avx2(kind, x + (size_t)t * ldx, n, row);
        else q8_inputs(kind, x + (size_t)t * ldx, n, row);
    }
}
