/* One token of int8 or int4 on a CPU with AMX (part of the ISA_AMX variant): AVX512-VNNI.
 *
 * The weights are in the block layout of the AMX tiles (kernels/quant.py): each 64-byte line holds one 4-value
 * column (quad) of a block's 16 rows (int4: two, in the low and high nibbles), and one vpdpbusd multiplies it by
 * that quad of the token, broadcast, into the 16 rows' sums. The token is in 15-bit fixed point x = 128 hi + lo
 * (hi a signed byte, lo in [0, 127]); the weights are made unsigned (int8: w + 128, one xor; int4: the stored
 * q + 8), and the offset is taken off exactly per token (int8: 128 Σ hi and 128 Σ lo) or per group (int4:
 * 8 Σ x). A block needs two accumulators (int4: four), so each thread streams four quarters of its run of blocks
 * side by side (as stream_rows does), every line prefetched a little ahead. One token takes this path rather than
 * the integer tiles (int8: about the speed of a loop that only loads the lines in this order; the tiles stay slower
 * with the same prefetch) or, for int4, the row-major nibbles of each group one block at a time (7 vector
 * operations per 64 weight bytes here, 13 there): both faster on 2048x768 experts (docs/bench/kernels.md).
 */
#include "common.h"

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
void experts_vnni_one_token(const tk_args *a, int n) {
    float xscale[AMX_BATCH];
    #pragma omp parallel num_threads(a->threads)
    {
        vnni_one_token_phase(a, n, 0, xscale);
        experts_swiglu(a, n);
        vnni_one_token_phase(a, n, 1, xscale);
    }
}
