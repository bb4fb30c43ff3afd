/* The portable variant (ISA_BASE): plain C that the compiler vectorises for any x86-64 CPU, and the drivers that
 * run every variant's dot products (dot_fn) over an expert (expert_generic) or a dense matrix (linear_rows).
 * Also the RMSNorm of the decoder (tk_rms_norm_bf16, tk_rms_norm_f32), rows of GGUF blocks dequantized
 * (tk_dequantize_rows: a quantized embedding's looked-up rows) and the bandwidth probe's baseline loop. */
#include "common.h"
#include "blocks.h"

DEFINE_DOTS(base, )
DEFINE_BLOCK_DOTS(base, )

/* MXFP4 in plain C (AVX2 has its own, avx2.c: the table lookups here do not vectorise). */
void dot_mxfp4_base(const void *wrow, float scale, const void *gscale, int group, const float *x, int ldx, int nt,
                    int n, float *res, int ldr) {
    (void)scale;
    MXFP4_BODY
}

/* One expert on base, AVX2 or AVX-512 (more than one token there), or several tokens of GGUF blocks or MXFP4 on
 * AVX512_BF16 (against int8 activations where q8_path: the inputs quantized into xb first): each row once for all
 * tokens through the variant's dot product (pick_dot), in one parallel region: gate and up rows, SwiGLU, down rows. */
void expert_generic(const tk_args *a) {
    const int T = a->tokens, H = a->hidden, I = a->inter, kind = a->kind, dk = a->down_kind, g = a->group;
    const int q8_in = q8_path(kind, a->isa), q8_down = q8_path(dk, a->isa);
    const dot_fn dot = q8_in ? q8_dot_for(kind, a->isa) : pick_dot(kind, a->isa);
    const dot_fn down_dot = q8_down ? q8_dot_for(dk, a->isa) : pick_dot(dk, a->isa);
    const float *x = q8_in ? (const float *)a->xb : a->x, *act = q8_down ? (const float *)a->xb : a->act;
    const int ldx = q8_in ? (int)(q8_stride(H) / 4) : H, ld_act = q8_down ? (int)(q8_stride(I) / 4) : 2 * I;
    const char *gate = a->gate, *up = a->up, *down = a->down;
    const size_t in_row = row_bytes(kind, H, g), down_row = row_bytes(dk, I, g);
    #pragma omp parallel num_threads(a->threads)
    {
        if (q8_in) q8_rows(kind, a->isa, a->x, H, T, H, a->xb);
        #pragma omp for schedule(static)
        for (int r = 0; r < 2 * I; r++) {
            const int gate_part = r < I, row = gate_part ? r : r - I;
            const void *s = gate_part ? a->gate_scale : a->up_scale;
            dot((gate_part ? gate : up) + (size_t)row * in_row, row_scale(s, kind, row),
                row_scales(s, kind, row, H, g), g, x, ldx, T, H, a->act + r, 2 * I);
        }
        swiglu_rows(a);
        if (q8_down) q8_rows(dk, a->isa, a->act, 2 * (size_t)I, T, I, a->xb);  /* (xb's inputs all read: barrier above) */
        #pragma omp for schedule(static)
        for (int h = 0; h < H; h++)
            down_dot(down + (size_t)h * down_row, row_scale(a->down_scale, dk, h),
                     row_scales(a->down_scale, dk, h, I, g), g, act, ld_act, T, I, a->out + h, H);
    }
}

/* Outputs [lo, hi) of every token rounded into yb (the same rounding either way). */
void linear_round(const tk_linear_args *a, int lo, int hi) {
    if (!a->yb) return;
    for (int t = 0; t < a->tokens; t++) {
        const size_t at = (size_t)t * a->out + lo;
        if (tk_isa_mask() & (1 << ISA_AVX512BF16)) to_bf16(a->y + at, a->yb + at, hi - lo);
        else for (int r = 0; r < hi - lo; r++) a->yb[at + r] = bf16_of(a->y[at + r]);
    }
}

/* Any token count on any variant: pairs of rows, each read once for all tokens, through the experts' dot
 * products of the matrix's kind (AVX512_BF16, bf16 only: vdpbf16ps against x rounded to bf16, which is exact when x
 * came from bf16). */
void linear_rows(const tk_linear_args *a, int isa) {
    const int T = a->tokens, I = a->in, O = a->out;
    const int q8 = q8_path(a->kind, isa);  /* blocks against int8 activations, quantized into xb first */
    const dot_fn dot = q8 ? q8_dot_for(a->kind, isa) : pick_dot(a->kind, isa);
    const float *x = q8 ? (const float *)a->xb : a->x;
    const int ldx = q8 ? (int)(q8_stride(I) / 4) : I;
    const size_t rb = row_bytes(a->kind, I, 0);
    #pragma omp parallel num_threads(a->threads)
    {
        const int bf16dp = isa == ISA_AVX512BF16 && a->kind == K_BF16;  /* (other blocks there: the AVX-512 rows) */
        if (bf16dp) {
            #pragma omp for schedule(static)
            for (int t = 0; t < T; t++) to_bf16(a->x + (size_t)t * I, a->xb + (size_t)t * I, I);
        }
        if (q8) q8_rows(a->kind, isa, a->x, I, T, I, a->xb);
        #pragma omp for schedule(static)
        for (int r = 0; r < O; r += 32) {  /* O is a multiple of 32 (checked) */
            for (int q = r; q < r + 32; q += 2) {
                const char *w = (const char *)a->w + (size_t)q * rb;
                if (bf16dp)
                    dot2_bf16_dp((const uint16_t *)w, (const uint16_t *)(w + rb), a->xb, NULL, I, T, I, a->y + q, O);
                else for (int j = 0; j < 2; j++) dot(w + (size_t)j * rb, 1.f, NULL, 0, x, ldx, T, I, a->y + q + j, O);
            }
            linear_round(a, r, r + 32);
        }
    }
}

/* RMSNorm of bf16 or float32 rows exactly as the reference rounds it (runtime/model.py rms_norm), in float32:
 * bf16 x (q/k norms): h = bf16(x * 1/sqrt(mean(x^2) + eps)), y = bf16(h * w); float32 x (the residual stream):
 * y = bf16(x * 1/sqrt(...) * w), rounded once. One call instead of seven small torch ops per norm (the decode loop
 * runs two to four per layer). Row r of x starts at x + r * ldx (in elements); y is [rows, n]. */
static inline float norm_value(const void *x, int f32, size_t i) {
    return f32 ? ((const float *)x)[i] : bf16f(((const uint16_t *)x)[i]);
}

static void rms_norm_rows(const void *x, int f32, size_t ldx, const uint16_t *w, uint16_t *y, int rows, int n,
                          float eps) {
    for (int r = 0; r < rows; r++) {
        const size_t row = (size_t)r * ldx;
        float part[16] = {0};
        int i = 0;
        for (; i + 16 <= n; i += 16)
            for (int j = 0; j < 16; j++) { const float v = norm_value(x, f32, row + i + j); part[j] += v * v; }
        float ss = 0;
        for (; i < n; i++) { const float v = norm_value(x, f32, row + i); ss += v * v; }
        for (int j = 0; j < 16; j++) ss += part[j];
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
        uint16_t *yr = y + (size_t)r * n;
        for (i = 0; i < n; i++) {
            const float h = norm_value(x, f32, row + i) * inv;
            yr[i] = bf16_of((f32 ? h : bf16f(bf16_of(h))) * bf16f(w[i]));
        }
    }
}

void tk_rms_norm_bf16(const uint16_t *x, size_t ldx, const uint16_t *w, uint16_t *y, int rows, int n, float eps) {
    if (rows < 1 || n < 1) return;
    rms_norm_rows(x, 0, ldx, w, y, rows, n, eps);
}

void tk_rms_norm_f32(const float *x, size_t ldx, const uint16_t *w, uint16_t *y, int rows, int n, float eps) {
    if (rows < 1 || n < 1) return;
    rms_norm_rows(x, 1, ldx, w, y, rows, n, eps);
}

/* RMSNorm in float32 throughout (float32 compute: runtime/model.py rms_norm with float32 x and weight):
 * y = w * (x * 1/sqrt(mean(x^2) + eps)), each product rounded as the reference rounds it. y may be x. */
void tk_rms_norm_float(const float *x, size_t ldx, const float *w, float *y, int rows, int n, float eps) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * ldx;
        float part[16] = {0};
        int i = 0;
        for (; i + 16 <= n; i += 16)
            for (int j = 0; j < 16; j++) part[j] += xr[i + j] * xr[i + j];
        float ss = 0;
        for (; i < n; i++) ss += xr[i] * xr[i];
        for (int j = 0; j < 16; j++) ss += part[j];
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
        float *yr = y + (size_t)r * n;
        for (i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}

DEFINE_SUM(sum_base, )

/* Rows `ids` [n] of a matrix of GGUF blocks ([rows, cols]) as float32 [n, cols], each block unpacked as the dot
 * products unpack it. 0, -1 for a kind that is not a block kind or a width that is not whole blocks, -2 for an id
 * outside the rows. */
int tk_dequantize_rows(int kind, const uint8_t *data, int64_t rows, const int64_t *ids, int n, int cols, float *out) {
    if (!IS_BLOCK_KIND(kind) || cols < 1 || cols % block_values(kind)) return -1;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows) return -2;
    const size_t row = row_bytes(kind, cols, 0);
    for (int i = 0; i < n; i++) {
        const uint8_t *w = data + (size_t)ids[i] * row;
        float *y = out + (size_t)i * cols;
        switch (kind) {
            case K_Q8_0: UNPACK_CHUNK(unpack_q8_0, 32, 34, w, 0, cols, y); break;
            case K_Q4_0: UNPACK_CHUNK(unpack_q4_0, 32, 18, w, 0, cols, y); break;
            case K_Q4_1: UNPACK_CHUNK(unpack_q4_1, 32, 20, w, 0, cols, y); break;
            case K_Q5_0: UNPACK_CHUNK(unpack_q5_0, 32, 22, w, 0, cols, y); break;
            case K_Q5_1: UNPACK_CHUNK(unpack_q5_1, 32, 24, w, 0, cols, y); break;
            case K_Q4_K: UNPACK_CHUNK(unpack_q4_k, 256, 144, w, 0, cols, y); break;
            case K_Q5_K: UNPACK_CHUNK(unpack_q5_k, 256, 176, w, 0, cols, y); break;
            case K_Q6_K: UNPACK_CHUNK(unpack_q6_k, 256, 210, w, 0, cols, y); break;
            default: UNPACK_CHUNK(unpack_gmxfp4, 32, 17, w, 0, cols, y); break;
        }
    }
    return 0;
}
