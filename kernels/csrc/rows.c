/* One token's rows, on the AVX2 and AVX-512 variants alike: each thread streams its share of a pass's rows (gate
 * and up of every expert, then down; or a dense matrix's) as four long runs side by side, through the variant's
 * four-row kernels (avx2.c, avx512.c; int8 inputs: q8avx2.c, q8.c), as the bandwidth probe reads memory. With one
 * token there is nothing to reuse: decode is bound by how fast the weights stream from DRAM. */
#include "common.h"

/* The four-row kernel of a weight kind on a variant (the float path; AVX512_BF16 and AMX machines take the AVX-512
 * rows for one token). */
static rows4_fn four_rows(int kind, int isa) { return isa >= ISA_AVX512 ? rows4_avx512(kind) : rows4_avx2(kind); }
/* The int8-input path's four-row kernel, and its quantized inputs, on a variant (common.h q8_path). */
static rows4_fn q8_rows4_for(int kind, int isa) { return isa == ISA_AVX2 ? q8_avx2_rows4(kind) : q8_rows4(kind); }
static void q8_input_for(int kind, int isa, const float *x, int n, void *buf) {
    if (isa == ISA_AVX2) q8_inputs_avx2(kind, x, n, buf);
    else q8_inputs(kind, x, n, buf);
}

/* Where row q of a one-token pass lies (see one_token_row); `src` is the caller's description of the rows. */
typedef row_ref (*row_lookup)(const void *src, int q);

/* Inside a parallel region: `total` one-token rows of K values, found through `find` (`per` rows a matrix), shared
 * out in one contiguous run per thread; each thread streams its run as four long sequences side by side (row i of
 * each quarter), as the bandwidth probe does: four quarters were the best of four neighbouring rows at a time (four
 * streams one row long), four quarters and eight quarters on 2048x768 bf16 experts (docs/bench/kernels.md). */
static void stream_rows(row_lookup find, const void *src, int total, int per, int K, int kind, int group,
                        rows4_fn r4, dot_fn dot, int T, int ldx, int ldr) {
    const thread_run run = this_threads_run(total, 4);
    const int lo = run.lo, hi = run.hi, len = run.len;
    const size_t rb = row_bytes(kind, K, group);
    const size_t s_step = kind == K_INT8 ? sizeof(float) : row_scale_bytes(kind, K, group);  /* scale bytes per row */
    row_ref r[4];
    int left[4] = {0, 0, 0, 0};  /* rows left in the matrix each quarter is in (0: look the next row up) */
    for (int i = 0; i < len; i++) {
        int m = 0;  /* quarters still going: the first m (the last one is the shortest) */
        for (int j = 0; j < 4 && lo + j * len + i < hi; j++, m++)
            if (!left[j]) {  /* a quarter's first row, or the first of the next matrix */
                r[j] = find(src, lo + j * len + i);
                left[j] = per - (lo + j * len + i) % per;
            }
        if (m == 4 && T == 1) {
            const char *w[4] = {r[0].w, r[1].w, r[2].w, r[3].w};
            const void *s[4] = {r[0].s, r[1].s, r[2].s, r[3].s};
            const float *x[4] = {r[0].x, r[1].x, r[2].x, r[3].x};
            float *res[4] = {r[0].res, r[1].res, r[2].res, r[3].res};
            r4(w, s, group, x, K, res);
        } else {
            for (int j = 0; j < m; j++) {
                if (T > 1 && left[j] > 1)  /* the quarter's next row on its way while this one is multiplied */
                    for (size_t o = 0; o < rb; o += 64) _mm_prefetch(r[j].w + rb + o, _MM_HINT_T0);
                dot(r[j].w, row_scale(r[j].s, kind, 0), kind == K_INT8 ? NULL : r[j].s, group, r[j].x, ldx, T, K,
                    r[j].res, ldr);
            }
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
    const int K = down ? a->inter : a->hidden;
    stream_rows(phase_row, &src, n * (down ? per : 2 * per), per, K, down ? a->down_kind : a->kind, a->group, r4, dot,
                1, K, 1);
    #pragma omp barrier
}

/* n one-token experts of one layer (one alone: n = 1) in one parallel region, rows four at a time (the AVX2 or
 * AVX-512 ones, by the variant), phase by phase over all of them: gate and up rows, SwiGLU, down rows. Every entry
 * has the same kind and shape and its own buffers. */
void experts_one_token(const tk_args *a, int n) {
    const int dp = mxfp4_dp(a);  /* MXFP4 by vdpbf16ps: reads the inputs as laid out in xb */
    const int q8_in = q8_path(a->kind, a->isa), q8_down = q8_path(a->down_kind, a->isa);  /* int8 inputs in xb */
    const rows4_fn r4 = dp ? rows4_mxfp4_dp : q8_in ? q8_rows4_for(a->kind, a->isa) : four_rows(a->kind, a->isa);
    const rows4_fn r4_down = dp ? rows4_mxfp4_dp : q8_down ? q8_rows4_for(a->down_kind, a->isa)
                                                          : four_rows(a->down_kind, a->isa);
    const dot_fn dot = dp ? dot_mxfp4_dp : q8_in ? q8_dot_for(a->kind, a->isa) : pick_dot(a->kind, a->isa);
    const dot_fn dot_down = dp ? dot_mxfp4_dp : q8_down ? q8_dot_for(a->down_kind, a->isa)
                                                         : pick_dot(a->down_kind, a->isa);
    #pragma omp parallel num_threads(a->threads)
    {
        if (dp || q8_in) {
            #pragma omp for schedule(static)
            for (int e = 0; e < n; e++)
                if (dp) mxfp4_inputs_bf16(a[e].x, a[e].xb, a->hidden);
                else q8_input_for(a->kind, a->isa, a[e].x, a->hidden, a[e].xb);
        }
        one_token_phase(a, n, 0, r4, dot);
        experts_swiglu(a, n);
        if (dp || q8_down) {
            #pragma omp for schedule(static)
            for (int e = 0; e < n; e++)
                if (dp) mxfp4_inputs_bf16(a[e].act, a[e].xb, a->inter);
                else q8_input_for(a->down_kind, a->isa, a[e].act, a->inter, a[e].xb);
        }
        one_token_phase(a, n, 1, r4_down, dot_down);
    }
}

typedef struct { const tk_linear_args *a; int isa; } linear_src;
static row_ref linear_row(const void *src, int q) {
    const linear_src *l = (const linear_src *)src;
    const tk_linear_args *a = l->a;
    const float *x = q8_path(a->kind, l->isa) ? (const float *)a->xb : a->x;  /* int8 inputs: laid out in xb */
    const row_ref r = {(const char *)a->w + (size_t)q * row_bytes(a->kind, a->in, 0), NULL, x, a->y + q, 0};
    return r;
}

/* One token: the rows streamed as for one-token experts (stream_rows), which reach more of the probe's bandwidth
 * than the AMX tiles on 2048x2048 and 50304x2048 matrices (docs/bench/kernels.md): tk_linear takes them for one
 * token on AMX machines too, and on AVX2 machines (their own four-row kernels). */
void linear_one_token(const tk_linear_args *a, int isa) {
    const int q8 = q8_path(a->kind, isa);
    if (q8) q8_input_for(a->kind, isa, a->x, a->in, a->xb);
    const rows4_fn r4 = q8 ? q8_rows4_for(a->kind, isa) : four_rows(a->kind, isa);
    const dot_fn dot = q8 ? q8_dot_for(a->kind, isa) : pick_dot(a->kind, isa);
    #pragma omp parallel num_threads(a->threads)
    {
        const linear_src src = {a, isa};
        stream_rows(linear_row, &src, a->out, a->out, a->in, a->kind, 0, r4, dot, 1, a->in, 1);
        const thread_run run = this_threads_run(a->out, 4);  /* this thread's rows, as stream_rows shared them */
        linear_round(a, run.lo, run.hi);
    }
}

/* One expert over its T tokens (more than one), on AVX2: each row read once for all of them (the variant's dot
 * products, up to 8 tokens a pass, against int8 inputs in xb where q8_path), as the one-token rows do: each thread's
 * share as four long runs side by side, each quarter's next row prefetched while one is multiplied. One run per thread
 * reached 0.34 of the DRAM probe for two tokens of OLMoE's bf16 experts on a Xeon core, which keeps too few misses in
 * flight for one stream. */
void expert_streamed(const tk_args *a) {
    const int T = a->tokens, H = a->hidden, I = a->inter, kind = a->kind, dk = a->down_kind, isa = a->isa;
    const int q8_in = q8_path(kind, isa), q8_down = q8_path(dk, isa);
    const dot_fn dot = q8_in ? q8_dot_for(kind, isa) : pick_dot(kind, isa);
    const dot_fn down_dot = q8_down ? q8_dot_for(dk, isa) : pick_dot(dk, isa);
    const int ldx = q8_in ? (int)(q8_stride(H) / 4) : H, ld_act = q8_down ? (int)(q8_stride(I) / 4) : 2 * I;
    const phase_rows gate_up = {a, 0}, down = {a, 1};
    #pragma omp parallel num_threads(a->threads)
    {
        if (q8_in) q8_rows(kind, isa, a->x, H, T, H, a->xb);
        stream_rows(phase_row, &gate_up, 2 * I, I, H, kind, a->group, NULL, dot, T, ldx, 2 * I);
        #pragma omp barrier
        swiglu_rows(a);
        if (q8_down) q8_rows(dk, isa, a->act, 2 * (size_t)I, T, I, a->xb);  /* (xb's inputs all read: barrier above) */
        stream_rows(phase_row, &down, H, H, I, dk, a->group, NULL, down_dot, T, ld_act, H);
    }
}
