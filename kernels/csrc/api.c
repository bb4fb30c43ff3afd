/* What Python calls (kernels/library.py, through ctypes): the ISA mask, the argument checks, the choice of variant and
 * of shared parallel region, whole MoE layers, dense matrices, the argument struct sizes and the probe; the tiny
 * Python module init at the end only makes the library an importable extension. The kernels themselves are in
 * one file per instruction set (common.h lists them). */
#include <Python.h>
#include "common.h"
#include "blocks.h"
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_usable(void) {
    static int state = -1;
    if (state >= 0) return state;
    unsigned a, b, c, d;
    state = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && (d & (1u << 24)) && (d & (1u << 25))
        && (c & (1u << 11)))  /* AMX-BF16, AMX-TILE, AMX-INT8; AVX512-VNNI (the one-token int8 and int4 kernels) */
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;  /* ask Linux for tile state */
    return state;
}

/* Bitmask of the usable ISA variants, bit i for variant i of the ISA_ enum, set when the CPU has what that variant's
 * code uses:
 *   bit 0, ISA_BASE        always (plain C)
 *   bit 1, ISA_AVX2        AVX2 and FMA (its loops are compiled for AVX2+FMA+F16C; F16C is taken as given with AVX2)
 *   bit 2, ISA_AVX512      AVX512F, AVX512BW and AVX512VL (also compiled for AVX512DQ, FMA and F16C, taken as given)
 *   bit 3, ISA_AVX512BF16  bit 2, AVX512_BF16 (vdpbf16ps) and AVX512-VNNI (q8.c's integer sums; every CPU with the
 *                          first has the second)
 *   bit 4, ISA_AMX         bit 3, AVX512-VNNI (one token of int8/int4, vnni.c), AMX-TILE, AMX-BF16 and AMX-INT8 (CPUID
 *                          leaf 7), and Linux granting this process the tile state (amx_usable)
 * then limited by tk_limit_isas (bit 0 stays). Every choice and check in the library goes through it, so a limit
 * makes the kernels behave as on a CPU without the features left out. */
static int isa_limit = ~0;

void tk_limit_isas(int allowed) { isa_limit = allowed | (1 << ISA_BASE); }

int tk_isa_mask(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        int m = 1 << ISA_BASE;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) m |= 1 << ISA_AVX2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl"))
            m |= 1 << ISA_AVX512;
        if ((m & (1 << ISA_AVX512)) && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni"))
            m |= 1 << ISA_AVX512BF16;
        if ((m & (1 << ISA_AVX512BF16)) && amx_usable()) m |= 1 << ISA_AMX;
        cached = m;
    }
    return cached & isa_limit;
}

dot_fn pick_dot(int kind, int isa) {
    static const dot_fn table[3][KINDS] = {
        {dot_fp32_base, dot_bf16_base, dot_fp16_base, dot_int8_base, dot_int4_base, dot_mxfp4_base,
         BLOCK_DOT_ROW(base)},
        {fma8_fp32, fma8_bf16, fma8_fp16, fma8_int8, dot_int4_avx2, dot_mxfp4_avx2, BLOCK_DOT_ROW(avx2)},
        {fma_fp32, fma_bf16, fma_fp16, fma_int8, fma_int4, fma_mxfp4, BLOCK_DOT_ROW(avx512)},
    };
    int row = isa >= ISA_AVX512 ? 2 : isa;
    return table[row][kind];
}

/* 0 when the kernel can serve these arguments, else a negative code. */
static int expert_checks(const tk_args *a) {
    if (a->threads < 1 || a->hidden < 1 || a->inter < 1 || a->tokens < 0) return -7;  /* (Python checks first) */
    if (a->kind < K_FP32 || a->kind >= KINDS || a->down_kind < K_FP32 || a->down_kind >= KINDS) return -1;
    if (a->down_kind != a->kind && !(IS_BLOCK_KIND(a->kind) && IS_BLOCK_KIND(a->down_kind))) return -1;
    if (a->act_kind != ACT_SILU && a->act_kind != ACT_CLAMPED && a->act_kind != ACT_GELU_TANH) return -1;
    if (!(tk_isa_mask() & (1 << a->isa))) return -2;
    /* MXFP4: whole blocks of 32, on the variants with its dot products (base, AVX2, AVX-512) */
    if (a->kind == K_MXFP4 && (a->hidden % 32 || a->inter % 32 || a->isa > ISA_AVX512BF16 || !a->xb)) return -3;
    if (a->kind == K_INT4 && ((a->group != 32 && a->group != 64 && a->group != 128) || a->hidden % a->group ||
                              a->inter % a->group)) return -3;
    /* GGUF blocks: whole blocks, on the variants with their dot products (base, AVX2, AVX-512) */
    if (IS_BLOCK_KIND(a->kind) && (a->hidden % block_values(a->kind) || a->inter % block_values(a->down_kind) ||
                                   a->isa > ISA_AVX512BF16 || (a->isa == ISA_AVX512BF16 && !a->xb))) return -3;
    if (a->isa == ISA_AVX512BF16 && a->kind != K_MXFP4 && !IS_BLOCK_KIND(a->kind) && (a->kind != K_BF16 || !a->xb || a->inter % 2)) return -4;
    if (a->isa == ISA_AMX) {
        if ((a->kind != K_BF16 && a->kind != K_INT8 && a->kind != K_INT4) || !a->xb || a->tokens > 16 ||
            a->hidden % 32 || a->inter % 32) return -5;
        if (a->kind != K_BF16 && (a->hidden % 64 || a->inter % 64)) return -5;  /* chunks of 64 values */
    }
    return 0;
}

/* The shared parallel region an expert call can join (tk_experts): 0 none (it runs alone), else one of these. */
enum { REGION_NONE, REGION_ROWS, REGION_VNNI_ONE, REGION_AMX, REGIONS };
static int region_of(const tk_args *b) {
    if ((b->isa == ISA_AVX2 || b->isa == ISA_AVX512 || mxfp4_dp(b) ||
         (b->isa == ISA_AVX512BF16 && IS_BLOCK_KIND(b->kind))) && b->tokens == 1)
        return REGION_ROWS;  /* experts_one_token */
    if (b->isa != ISA_AMX) return REGION_NONE;
    if (b->tokens == 1 && b->kind != K_BF16) return REGION_VNNI_ONE;  /* int8, int4 */
    return REGION_AMX;
}

static void run_region(int region, const tk_args *a, int n) {
    switch (region) {
        case REGION_ROWS: experts_one_token(a, n); break;
        case REGION_VNNI_ONE: experts_vnni_one_token(a, n); break;
        default: experts_amx(a, n); break;
    }
}

/* The down projection's bias, added to each token's output after the experts ran (the reference's order). */
static void add_down_bias(const tk_args *a, int n) {
    for (int e = 0; e < n; e++)
        if (a[e].down_bias)
            for (int t = 0; t < a[e].tokens; t++)
                for (int h = 0; h < a[e].hidden; h++) a[e].out[(size_t)t * a[e].hidden + h] += a[e].down_bias[h];
}

/* Returns 0 on success, a negative code for arguments the kernel cannot serve. */
int tk_expert(const tk_args *a) {
    if (a->tokens <= 0) return 0;
    const int code = expert_checks(a);
    if (code) return code;
    const int region = region_of(a);
    if (region != REGION_NONE) run_region(region, a, 1);
    else if (tiled_serves(a)) {
        const int tiled = expert_tiled(a);
        if (tiled) return tiled;
    } else if (a->isa == ISA_AVX512BF16 && a->kind == K_BF16) expert_bf16dp(a);
    else if (a->isa == ISA_AVX2) expert_streamed(a);
    else expert_generic(a);
    add_down_bias(a, 1);
    return 0;
}

/* n experts of one layer (same kind and shape), each with its own tokens and buffers: those that can share a
 * parallel region (region_of: one-token AVX-512 rows, one-token int4 or int8 on an AMX machine, AMX tiles) run
 * in one region per kind of region, AMX_BATCH at a time; the rest, or all when the shapes differ, one after
 * another. Returns 0, or the first negative code of the checks. */
int tk_experts(const tk_args *a, int n) {
    int alike = 1;
    for (int e = 0; e < n; e++) {
        const tk_args *b = a + e;
        if (b->tokens <= 0) continue;
        const int code = expert_checks(b);
        if (code) return code;
        alike = alike && b->kind == a->kind && b->down_kind == a->down_kind && b->hidden == a->hidden && b->inter == a->inter &&
                b->group == a->group && b->threads == a->threads;
    }
    tk_args group[AMX_BATCH];
    for (int region = REGION_NONE; region < REGIONS; region++) {
        int m = 0;
        for (int e = 0; e < n; e++) {
            if (a[e].tokens <= 0 || (alike ? region_of(a + e) : REGION_NONE) != region) continue;
            if (region == REGION_NONE) {
                const int code = tk_expert(a + e);  /* checked above: only a failed allocation (-9, tiles.c) is left */
                if (code) return code;
                continue;
            }
            group[m++] = a[e];
            if (m == AMX_BATCH) run_region(region, group, m), add_down_bias(group, m), m = 0;
        }
        if (m) run_region(region, group, m), add_down_bias(group, m);
    }
    return 0;
}

/* ---- a whole MoE layer ----------------------------------------------------------------------------------
 * From the router's choice to the weighted sum in one call: the tokens are grouped by expert (experts in id
 * order), each expert's tokens in chunks of at most `chunk` (the tokens one expert call takes: a prompt's many
 * tokens make several), each chunk's rows copied into a slot of the caller's arena; the chunks run through
 * tk_experts (shared parallel regions) `slots` at a time, and each output row, times its routing weight, is added
 * into out (a token's experts in id order). What the layer loop would otherwise do per expert in Python (find the
 * tokens, gather, scale, add). */

/* Scratch per slot of `tokens` rows: x [T, H], out [T, H], act [T, 2I] float32, xb [max(T, 16), max(H, I) +
 * XB_EXTRA] 16-bit. */
size_t tk_moe_slot_bytes(int hidden, int inter, int tokens) {
    const size_t wide = hidden > inter ? hidden : inter, t = tokens > 16 ? (size_t)tokens : 16;
    return (size_t)tokens * ((size_t)hidden * 8 + (size_t)inter * 8) + t * (wide + XB_EXTRA) * 2;
}

int tk_moe(const tk_moe_args *m) {
    const int T = m->tokens, K = m->top_k, H = m->proto.hidden, I = m->proto.inter, chunk = m->chunk;
    if (T <= 0) return 0;
    if (K < 1 || m->slots < 1 || m->slots > AMX_BATCH || chunk < 1 || chunk > BLOCK_TOKENS) return -6;
    if (m->proto.threads < 1 || H < 1 || I < 1) return -7;
    for (size_t i = 0; i < (size_t)T * K; i++) {
        if (m->ids[i] < 0 || m->ids[i] >= m->experts) return -6;
        for (size_t j = i - i % K; j < i; j++)  /* a token's experts are distinct (a router never picks one twice) */
            if (m->ids[j] == m->ids[i]) return -6;
    }
    memset(m->out, 0, sizeof(float) * (size_t)T * H);
    const size_t per = tk_moe_slot_bytes(H, I, chunk), routings = (size_t)T * K;
    tk_args a[AMX_BATCH];
    int rows[AMX_BATCH][BLOCK_TOKENS];
    float rw[AMX_BATCH][BLOCK_TOKENS];
    size_t left = routings;  /* routings not yet in a chunk */
    int n = 0;  /* chunks in the current round */
    for (int e = 0; e < m->experts && left; e++) {
        size_t i = 0;  /* where the scan for this expert's next chunk resumes */
        for (;;) {
            int c = 0;
            for (; i < routings && c < chunk; i++)
                if (m->ids[i] == e) rows[n][c] = (int)(i / K), rw[n][c++] = m->weights[i];
            if (!c) break;
            left -= c;
            char *slot = m->arena + per * (size_t)n;
            a[n] = m->proto;
            a[n].tokens = c;
            a[n].gate = m->table[e].gate, a[n].up = m->table[e].up, a[n].down = m->table[e].down;
            a[n].gate_scale = m->table[e].gate_scale, a[n].up_scale = m->table[e].up_scale;
            a[n].down_scale = m->table[e].down_scale;
            a[n].gate_bias = m->table[e].gate_bias, a[n].up_bias = m->table[e].up_bias;
            a[n].down_bias = m->table[e].down_bias;
            float *x = (float *)slot;
            a[n].x = x, a[n].out = x + (size_t)chunk * H, a[n].act = x + 2 * (size_t)chunk * H;
            a[n].xb = (uint16_t *)(a[n].act + 2 * (size_t)chunk * I);
            for (int r = 0; r < c; r++) {
                float *dst = x + (size_t)r * H;
                if (m->x_bf16) {
                    const uint16_t *src = m->x_bf16 + (size_t)rows[n][r] * H;
                    for (int h = 0; h < H; h++) dst[h] = bf16f(src[h]);
                } else {
                    memcpy(dst, m->x + (size_t)rows[n][r] * H, sizeof(float) * H);
                }
            }
            if (++n < m->slots && left) continue;
            const int code = tk_experts(a, n);
            if (code) return code;
            for (int j = 0; j < n; j++)
                for (int r = 0; r < a[j].tokens; r++) {
                    float *dst = m->out + (size_t)rows[j][r] * H;
                    const float *y = a[j].out + (size_t)r * H, w = rw[j][r];
                    for (int h = 0; h < H; h++) dst[h] += w * y[h];
                }
            n = 0;
        }
    }
    return 0;
}

/* The variant as asked (or, for -1, the best: one token on the AVX-512 rows, more on AMX tiles, else the rows of
 * the best dot product; block kinds on the AVX-512 rows at most). Up to 16 tokens, or BLOCK_TOKENS of block kinds.
 * Returns 0, or a negative code for arguments the kernel cannot serve. */
int tk_linear(const tk_linear_args *a) {
    if (a->tokens <= 0) return 0;
    if (a->tokens > (IS_BLOCK_KIND(a->kind) ? BLOCK_TOKENS : 16) || a->in % 32 || a->out % 32) return -5;
    if (a->threads < 1 || a->in < 1 || a->out < 1) return -7;
    const int blocks = IS_BLOCK_KIND(a->kind), floats = a->kind == K_FP32 || a->kind == K_FP16;
    if ((a->kind != K_BF16 && !blocks && !floats) || (blocks && a->in % block_values(a->kind))) return -5;
    const int mask = tk_isa_mask();
    int isa = a->isa;
    if (isa < 0) {
        isa = ISA_BASE;
        while (isa < ISA_AMX && (mask & (1 << (isa + 1)))) isa++;
        if ((a->tokens == 1 || blocks) && isa >= ISA_AVX512) isa = ISA_AVX512;
    }
    if (floats && isa > ISA_AVX512) isa = ISA_AVX512;  /* fp32 and fp16 matrices: the float rows (no bf16 units) */
    if (isa < ISA_BASE || isa > ISA_AMX || !(mask & (1 << isa)) || (blocks && isa > ISA_AVX512BF16)) return -2;
    if (isa == ISA_AMX) linear_amx(a);
    else if ((isa == ISA_AVX2 || isa == ISA_AVX512 || (blocks && isa == ISA_AVX512BF16)) && a->tokens == 1)
        linear_one_token(a, isa);
    else linear_rows(a, isa);
    return 0;
}

/* The size of each argument struct Python fills through ctypes (0 tk_args, 1 tk_weights, 2 tk_moe_args,
 * 3 tk_linear_args, 4 tk_attend_args, 5 tk_layer_args, 6-8 the recurrent steps' (recur.c); 0 for any other): kernels/library.py compares them with its own structures when it loads the
 * library, so a layout that drifted on one side is refused before it can corrupt memory. */
size_t tk_struct_size(int which) {
    switch (which) {
        case 0: return sizeof(tk_args);
        case 1: return sizeof(tk_weights);
        case 2: return sizeof(tk_moe_args);
        case 3: return sizeof(tk_linear_args);
        case 4: return sizeof(tk_attend_args);
        case 5: return sizeof(tk_layer_args);
        case 6: return sizeof(tk_deltanet_args);
        case 7: return sizeof(tk_ssm_args);
        case 8: return sizeof(tk_shortconv_args);
        default: return 0;
    }
}

/* Streaming read bandwidth probe: sums n floats with `threads` threads (the result defeats dead-code removal), each
 * reading its share as `streams` streams side by side (1, 2, 4 or PROBE_STREAMS). Which count the memory serves best
 * differs between machines: one stream per thread reached 0.75 of what the expert kernels got on one, eight streams
 * 0.8 of what two did on another (docs/bench/kernels.md), so the probe's caller tries each. */
double tk_read_sum(const float *p, size_t n, int threads, int streams) {
    if (threads < 1) threads = 1;
    return (tk_isa_mask() & (1 << ISA_AVX2)) ? sum_avx2(p, n, threads, streams) : sum_base(p, n, threads, streams);
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu", "Tandem CPU expert kernels (called via ctypes).", -1, NULL};
PyMODINIT_FUNC PyInit__cpu(void) { return PyModule_Create(&module); }
