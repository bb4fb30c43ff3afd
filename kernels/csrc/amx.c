/* The AMX variant (ISA_AMX), 2-16 tokens on tiles: bf16 weights as they lie, int8 and int4 in the block layout of
 * kernels/quant.py against 16-bit fixed-point activations; experts (experts_amx) and dense bf16 matrices
 * (linear_amx). One token of int8 or int4 on these machines runs on AVX512-VNNI (vnni.c), of other kinds on the
 * AVX-512 rows (avx512.c). */
#include "common.h"

/* ---- AMX tiles: 2-16 tokens --------------------------------------------------------------------------------
 * bf16: C[rows, tokens] += W[rows, 32 k] . X^T[32 k, tokens], the weight tile loaded straight from the row-major
 * matrix (16 rows, stride = row bytes), activations packed once per call in the pair-interleaved layout the
 * second operand needs (tokens padded to 16 with stale values). Tiles: 0,1 accumulators, 2,3 weights, 4
 * activations; widths a multiple of 32. int8 and int4: C[tokens, rows] against the block layout (below). */

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

/* Tiles 0-7 at their full 16 rows x 64 bytes. A constant: GCC 12 does not treat ldtilecfg as reading its operand,
 * so a configuration built on the stack can lose its row and column stores when the function is not inlined. */
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
AVX512_TARGET void token_scales(const float *x, int ldx, int T, int K, float top_value, float *scale,
                                    float *inv) {
    for (int t = 0; t < T; t++) {
        __m512 m = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + (size_t)t * ldx + k)));
        const float top = _mm512_reduce_max_ps(m);
        scale[t] = top >= FLT_MIN * top_value ? top / top_value : 1.f;  /* tinier: inv would overflow; all round to 0 */
        inv[t] = 1.f / scale[t];
    }
}


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
 * weights 5 and 6. Integer tiles, not bf16 tiles through per-group tables: faster from DRAM at 2, 4 and 8 tokens
 * on 2048x768 experts and at 8 on 4096x14336 (docs/bench/kernels.md). In L2 the tile products, the unpacking and
 * the group read-outs each take a share; none alone dominates. */
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
 * packed (experts_amx). Each thread streams its run of 16-row blocks as two halves side by side, block i of each,
 * which streams and unpacks them faster than neighbouring blocks in pairs (2048x768 int4 experts at 8 tokens:
 * docs/bench/kernels.md). Tokens 8-15 take a second pass, which finds
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


/* One expert, or several experts of one layer in one parallel region (decode: the top-k experts of a token),
 * on AMX tiles. Each phase runs over all experts at once, so a layer pays one region and a handful of barriers
 * instead of one set per expert, and the threads stream one long run of rows. Every entry must be an AMX call
 * of the same kind and shape, each with its own buffers. Phases: pack the input, gate and up rows, SwiGLU,
 * pack the activation, down rows. */
AMX_TARGET void experts_amx(const tk_args *a, int n) {
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

AMX_TARGET void linear_amx(const tk_linear_args *a) {
    #pragma omp parallel num_threads(a->threads)
    {
        amx_begin(&AMX_CONFIG);
        #pragma omp for schedule(static)
        for (int c = 0; c < a->in / 32; c++) amx_pack_chunk(a->x, a->in, a->tokens, c, a->xb);
        #pragma omp for schedule(static)
        for (int b = 0; b < a->out / 32; b++) {
            amx_rows32((const uint16_t *)a->w, b * 32, a->in, a->xb, a->tokens, a->y, a->out);
            linear_round(a, b * 32, b * 32 + 32);  /* while the block is in cache: no separate pass over y */
        }
        _tile_release();
    }
}
