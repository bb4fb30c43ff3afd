/* GGUF's block formats (ggml's quantization types) as weight kinds of the kernels: rows kept exactly as the file
 * stores them (memory-mapped, or read into RAM as they are), a row a run of blocks.
 *
 * Each block is unpacked into float32 values in L1 (a superblock of 256 values, or 8 blocks of 32 at a time) and
 * multiplied with every token of the call from there: the values are those of the gguf package's reference
 * dequantizer (kernels/blocks.py documents the layouts), so a row's dot product is the float32 product over the
 * dequantized weights, summed in another order. The unpacking loops are plain C that the compiler vectorises for
 * each variant (base, AVX2, AVX-512: DEFINE_BLOCK_DOTS), as base.c's dot products are.
 *
 * Letters: V values a block, B bytes a block, C values a chunk (what one unpack makes: 256, or the rest of a row).
 */
#ifndef TANDEM_KERNELS_BLOCKS_H
#define TANDEM_KERNELS_BLOCKS_H

#include "common.h"

#define CHUNK 256  /* values unpacked at a time: one K superblock, or 8 blocks of 32 */

/* f16 bits -> float32, exactly (subnormals, infinities and NaNs as stored). */
static inline __attribute__((always_inline)) float f16f(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | p[1] << 8);
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31, man = h & 0x3ffu;
    uint32_t u;
    if (e == 31) u = sign | 0x7f800000u | man << 13;
    else if (e) u = sign | (e + 112) << 23 | man << 13;
    else {
        const float f = (float)man * (1.f / 16777216.f);  /* man * 2^-24: exact */
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define BI static inline __attribute__((always_inline)) void
BI unpack_q8_0(const uint8_t *b, float *y) {
    const float d = f16f(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)q[j] * d;
}
BI unpack_q4_0(const uint8_t *b, float *y) {
    const float d = f16f(b);
    for (int j = 0; j < 16; j++) y[j] = d * (float)((b[2 + j] & 15) - 8), y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
}
BI unpack_q4_1(const uint8_t *b, float *y) {
    const float d = f16f(b), m = f16f(b + 2);
    for (int j = 0; j < 16; j++) y[j] = d * (float)(b[4 + j] & 15) + m, y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
}
/* Q5_0/Q5_1: value j's fifth bit is bit j of the 32-bit qh. */
BI unpack_q5_0(const uint8_t *b, float *y) {
    const float d = f16f(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((int)((b[6 + j] & 15) | ((qh >> j) & 1) << 4) - 16);
        y[j + 16] = d * (float)((int)((b[6 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
    }
}
BI unpack_q5_1(const uint8_t *b, float *y) {
    const float d = f16f(b), m = f16f(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b[8 + j] & 15) | ((qh >> j) & 1) << 4) + m;
        y[j + 16] = d * (float)((b[8 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m;
    }
}
/* Q4_K/Q5_K: sub-block i's 6-bit scale and min from the 12 packed bytes. */
static inline __attribute__((always_inline)) void k_scale_min(const uint8_t *s, int i, float *sc, float *mn) {
    if (i < 4) *sc = (float)(s[i] & 63), *mn = (float)(s[i + 4] & 63);
    else *sc = (float)((s[i + 4] & 15) | (s[i - 4] >> 6) << 4), *mn = (float)((s[i + 4] >> 4) | (s[i] >> 6) << 4);
}
BI unpack_q4_k(const uint8_t *b, float *y) {
    const float d = f16f(b), dmin = f16f(b + 2);
    const uint8_t *q = b + 16;
    for (int i = 0; i < 8; i += 2, q += 32, y += 64) {
        float s0, m0, s1, m1;
        k_scale_min(b + 4, i, &s0, &m0), k_scale_min(b + 4, i + 1, &s1, &m1);
        const float d0 = d * s0, o0 = dmin * m0, d1 = d * s1, o1 = dmin * m1;
        for (int l = 0; l < 32; l++) y[l] = d0 * (float)(q[l] & 15) - o0, y[l + 32] = d1 * (float)(q[l] >> 4) - o1;
    }
}
BI unpack_q5_k(const uint8_t *b, float *y) {
    const float d = f16f(b), dmin = f16f(b + 2);
    const uint8_t *qh = b + 16, *q = b + 48;
    for (int i = 0; i < 8; i += 2, q += 32, y += 64) {
        float s0, m0, s1, m1;
        k_scale_min(b + 4, i, &s0, &m0), k_scale_min(b + 4, i + 1, &s1, &m1);
        const float d0 = d * s0, o0 = dmin * m0, d1 = d * s1, o1 = dmin * m1;
        for (int l = 0; l < 32; l++) {
            y[l] = d0 * (float)((q[l] & 15) | ((qh[l] >> i) & 1) << 4) - o0;
            y[l + 32] = d1 * (float)((q[l] >> 4) | ((qh[l] >> (i + 1)) & 1) << 4) - o1;
        }
    }
}
/* Q6_K: per half of 128 values, ql's 64 bytes (low nibbles: values 0-63, high: 64-127 of the half, in runs of 32),
 * qh's 32 bytes (2 bits of 4 values each), one int8 scale per 16 values; d last. */
BI unpack_q6_k(const uint8_t *b, float *y) {
    const float d = f16f(b + 208);
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int half = 0; half < 2; half++, y += 128, sc += 8)
        for (int h = 0; h < 2; h++) {  /* each run of 16 values under one scale (d sc, rounded as the reference) */
            const uint8_t *ql = b + 64 * half + 16 * h, *qh = b + 128 + 32 * half + 16 * h;
            const float s0 = d * (float)sc[h], s1 = d * (float)sc[h + 2], s2 = d * (float)sc[h + 4];
            const float s3 = d * (float)sc[h + 6];
            float *o = y + 16 * h;
            for (int l = 0; l < 16; l++) {
                o[l] = s0 * (float)((int)((ql[l] & 15) | ((qh[l] >> 0) & 3) << 4) - 32);
                o[l + 32] = s1 * (float)((int)((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32);
                o[l + 64] = s2 * (float)((int)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32);
                o[l + 96] = s3 * (float)((int)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32);
            }
        }
}
/* GGUF's MXFP4: the E8M0 byte first, then the codes (low nibbles values 0-15, high 16-31). */
BI unpack_gmxfp4(const uint8_t *b, float *y) {
    const float s = e8m0_half(b[0]);
    for (int j = 0; j < 16; j++) y[j] = E2M1X2[b[1 + j] & 15] * s, y[j + 16] = E2M1X2[b[1 + j] >> 4] * s;
}
#undef BI

/* Up to C values of a row from value k0 (whole blocks): each block unpacked in turn. */
#define UNPACK_CHUNK(UNPACK, V, B, w, k0, c, buf)                                                  \
    for (int u_ = 0; u_ < (c); u_ += (V)) UNPACK((w) + (size_t)((k0) + u_) / (V) * (B), (buf) + u_)

/* A dot_fn of a block kind: per chunk, the row's values unpacked once, then each token (16 at a time) multiplied
 * with them into 32 partial sums (two vectors on AVX-512: two independent chains). */
#define BLOCK_DOT_BODY(UNPACK, V, B)                                                               \
    const uint8_t *w = (const uint8_t *)wrow;                                                      \
    (void)scale, (void)gscale, (void)group;                                                        \
    float buf[CHUNK];                                                                              \
    for (int t0 = 0; t0 < nt; t0 += 16) {                                                          \
        const int m = nt - t0 < 16 ? nt - t0 : 16;                                                 \
        float acc[16][32];                                                                         \
        memset(acc, 0, sizeof(acc));                                                               \
        for (int k0 = 0; k0 < n; k0 += CHUNK) {                                                    \
            const int c = n - k0 < CHUNK ? n - k0 : CHUNK;                                         \
            UNPACK_CHUNK(UNPACK, V, B, w, k0, c, buf);                                             \
            for (int j = 0; j < m; j++) {                                                          \
                const float *xs = x + (size_t)(t0 + j) * ldx + k0;                                 \
                for (int k = 0; k < c; k += 32)                                                    \
                    _Pragma("omp simd")                                                            \
                    for (int l = 0; l < 32; l++) acc[j][l] += buf[k + l] * xs[k + l];              \
            }                                                                                      \
        }                                                                                          \
        for (int j = 0; j < m; j++) {                                                              \
            float s = 0.f;                                                                         \
            for (int l = 0; l < 32; l++) s += acc[j][l];                                           \
            res[(size_t)(t0 + j) * ldr] = s;                                                       \
        }                                                                                          \
    }

#define DEFINE_BLOCK_DOT(NAME, SUFFIX, ATTR, V, B)                                                 \
ATTR void dot_##NAME##_##SUFFIX(const void *wrow, float scale, const void *gscale, int group,       \
        const float *x, int ldx, int nt, int n, float *res, int ldr) { BLOCK_DOT_BODY(unpack_##NAME, V, B) }

/* Every block kind's dot_fn for one variant: dot_q8_0_<suffix> ... dot_gmxfp4_<suffix>. */
#define DEFINE_BLOCK_DOTS(SUFFIX, ATTR)                                                            \
    DEFINE_BLOCK_DOT(q8_0, SUFFIX, ATTR, 32, 34)                                                   \
    DEFINE_BLOCK_DOT(q4_0, SUFFIX, ATTR, 32, 18)                                                   \
    DEFINE_BLOCK_DOT(q4_1, SUFFIX, ATTR, 32, 20)                                                   \
    DEFINE_BLOCK_DOT(q5_0, SUFFIX, ATTR, 32, 22)                                                   \
    DEFINE_BLOCK_DOT(q5_1, SUFFIX, ATTR, 32, 24)                                                   \
    DEFINE_BLOCK_DOT(q4_k, SUFFIX, ATTR, 256, 144)                                                 \
    DEFINE_BLOCK_DOT(q5_k, SUFFIX, ATTR, 256, 176)                                                 \
    DEFINE_BLOCK_DOT(q6_k, SUFFIX, ATTR, 256, 210)                                                 \
    DEFINE_BLOCK_DOT(gmxfp4, SUFFIX, ATTR, 32, 17)

#define DECLARE_BLOCK_DOTS(SUFFIX)                                                                 \
    TK_INTERNAL dot_kernel dot_q8_0_##SUFFIX, dot_q4_0_##SUFFIX, dot_q4_1_##SUFFIX, dot_q5_0_##SUFFIX, \
        dot_q5_1_##SUFFIX, dot_q4_k_##SUFFIX, dot_q5_k_##SUFFIX, dot_q6_k_##SUFFIX, dot_gmxfp4_##SUFFIX;
DECLARE_BLOCK_DOTS(base)
DECLARE_BLOCK_DOTS(avx2)
DECLARE_BLOCK_DOTS(avx512)
#define BLOCK_DOT_ROW(SUFFIX) dot_q8_0_##SUFFIX, dot_q4_0_##SUFFIX, dot_q4_1_##SUFFIX, dot_q5_0_##SUFFIX, \
    dot_q5_1_##SUFFIX, dot_q4_k_##SUFFIX, dot_q5_k_##SUFFIX, dot_q6_k_##SUFFIX, dot_gmxfp4_##SUFFIX

#endif
