/* Attention of one new token per sequence (decode), in one call: RoPE on its query and key, its key and value
 * written into the KV cache, then each query head attends to its key/value head's cached keys with an online
 * softmax (optionally with gpt-oss's sink logit), accumulated in float32. In torch this was about 25 small ops and a
 * flash-attention call per layer, each paying the interpreter's and dispatcher's cost after the weights streamed
 * past (kernels/attend.py is the Python side; runtime/model.py's torch path is the reference it is tested against).
 *
 * Letters: B sequences, Hq query heads, Hkv key/value heads, G = Hq / Hkv (consecutive query heads share one key/
 * value head), D head dim, R rotated dims (the first R of each head; partial rotary when R < D), S keys read. */
#include "common.h"

enum { MAX_HEAD_DIM = 512, KEY_CHUNK = 64 };  /* keys scored per step of the online softmax: the scores stay in L1 */

static inline float load(const void *p, int bf16, size_t i) {
    return bf16 ? bf16f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int bf16, size_t i, float f) {
    if (bf16) ((uint16_t *)p)[i] = bf16_of(f);
    else ((float *)p)[i] = f;
}

/* One head's RoPE as runtime/rope.py's apply_rope computes it, rounded where it rounds: x*cos and rotate_half(x)*sin
 * each in the compute dtype, then their sum. The dims past R are copied. Compiled for the baseline ISA, which has
 * no FMA: the float32 products and sum are never fused, as torch's separate ops do not fuse them. */
__attribute__((noinline)) static void rope_head(const void *x, size_t at, const void *cos, const void *sin, int rot,
                                                int dim, int bf16, void *dst, size_t dst_at, int dst_bf16) {
    const int half = rot / 2;
    for (int i = 0; i < dim; i++) {
        float v = load(x, bf16, at + i);
        if (i < rot) {
            const float partner = i < half ? -load(x, bf16, at + i + half) : load(x, bf16, at + i - half);
            float a = v * load(cos, bf16, i), b = partner * load(sin, bf16, i);
            if (bf16) a = bf16f(bf16_of(a)), b = bf16f(bf16_of(b));
            v = a + b;
        }
        store(dst, dst_bf16, dst_at + i, v);
    }
}

/* The per-ISA loops: a query's dot product with one key, and a value row added into the accumulator with its
 * weight. The base variant's dot keeps 16 lanes in an array; the vector variants keep them in registers and add them
 * as a tree, not one after another (sixteen dependent adds had taken most of a 64-wide dot's time). */
#define DEFINE_VALUE_LOOPS(sfx, TARGET)                                                                            \
    TARGET static void add_value_##sfx(float *acc, float p, const void *value, int bf16, int dim) {              \
        if (bf16) {                                                                                               \
            const uint16_t *v = (const uint16_t *)value;                                                          \
            for (int d = 0; d < dim; d++) acc[d] += p * bf16f(v[d]);                                              \
        } else {                                                                                                  \
            const float *v = (const float *)value;                                                                \
            for (int d = 0; d < dim; d++) acc[d] += p * v[d];                                                     \
        }                                                                                                         \
    }                                                                                                             \
    TARGET static void scale_##sfx(float *acc, float c, int dim) {                                               \
        for (int d = 0; d < dim; d++) acc[d] *= c;                                                                \
    }

static float key_dot_base(const float *q, const void *key, int bf16, int dim) {
    float lanes[16] = {0};
    int d = 0;
    if (bf16) {
        const uint16_t *k = (const uint16_t *)key;
        for (; d + 16 <= dim; d += 16)
            for (int j = 0; j < 16; j++) lanes[j] += q[d + j] * bf16f(k[d + j]);
    } else {
        const float *k = (const float *)key;
        for (; d + 16 <= dim; d += 16)
            for (int j = 0; j < 16; j++) lanes[j] += q[d + j] * k[d + j];
    }
    float s = 0.0f;
    for (; d < dim; d++) s += q[d] * load(key, bf16, d);
    for (int j = 0; j < 16; j++) s += lanes[j];
    return s;
}

#define AVX2_ATTEND __attribute__((target("avx2,fma,f16c")))
AVX2_ATTEND static inline __m256 keys8_avx2(const void *key, int bf16, int d) {  /* 8 keys' values as float32 */
    if (!bf16) return _mm256_loadu_ps((const float *)key + d);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)key + d));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AVX2_ATTEND static float key_dot_avx2(const float *q, const void *key, int bf16, int dim) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int d = 0;
    for (; d + 16 <= dim; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), keys8_avx2(key, bf16, d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), keys8_avx2(key, bf16, d + 8), a1);
    }
    for (; d + 8 <= dim; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), keys8_avx2(key, bf16, d), a0);
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(_mm256_add_ps(a0, a1)), _mm256_extractf128_ps(_mm256_add_ps(a0, a1), 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    float s = _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
    for (; d < dim; d++) s += q[d] * load(key, bf16, d);
    return s;
}

AVX512_TARGET static float key_dot_avx512(const float *q, const void *key, int bf16, int dim) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    int d = 0;
    for (; d + 16 <= dim; d += 16) {
        const __m512 k = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                    _mm256_loadu_si256((const __m256i *)((const uint16_t *)key + d))), 16))
                              : _mm512_loadu_ps((const float *)key + d);
        if ((d / 16) % 2) a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), k, a1);
        else a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), k, a0);
    }
    float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    for (; d < dim; d++) s += q[d] * load(key, bf16, d);
    return s;
}

DEFINE_VALUE_LOOPS(base, )
DEFINE_VALUE_LOOPS(avx2, AVX2_ATTEND)
DEFINE_VALUE_LOOPS(avx512, AVX512_TARGET)

typedef float (*key_dot_fn)(const float *, const void *, int, int);
typedef void (*add_value_fn)(float *, float, const void *, int, int);
typedef void (*scale_fn)(float *, float, int);

/* Where sequence b is: its cache row, its position, the first position it reads and its RoPE tables' row. */
typedef struct {
    size_t row;
    int start, first;
    const void *cos, *sin;
} seq_place;

static inline seq_place place_of(const tk_attend_args *a, int b) {
    if (!a->starts) return (seq_place){(size_t)b, a->start, a->first, a->cos, a->sin};
    const int start = a->starts[b];
    const int first = a->chunk ? start - start % a->chunk
                               : a->window && start + 1 > a->window ? start + 1 - a->window : 0;
    const size_t at = (size_t)start * (size_t)a->rot * (a->bf16 ? 2 : 4);
    return (seq_place){(size_t)a->rows[b], start, first, (const char *)a->cos + at, (const char *)a->sin + at};
}

/* Query head h of sequence b: its roped query against the keys [first, start] of its key/value head, softmax over
 * them (and the head's sink logit, which takes its share of the mass and adds nothing), the values' weighted sum. */
static void attend_head(const tk_attend_args *a, int b, int h, key_dot_fn dot, add_value_fn add, scale_fn scale) {
    const int D = a->dim, bf16 = a->bf16, g = h / (a->heads / a->kv_heads);
    const size_t esize = bf16 ? 2 : 4;
    const seq_place at_b = place_of(a, b);
    float q[MAX_HEAD_DIM], acc[MAX_HEAD_DIM] = {0};
    rope_head(a->q, (size_t)b * a->ld_q + (size_t)h * D, at_b.cos, at_b.sin, a->rot, D, bf16, q, 0, 0);
    if (bf16)  /* the roped query as the reference holds it: in the compute dtype */
        for (int d = 0; d < D; d++) q[d] = bf16f(bf16_of(q[d]));
    const size_t row = (at_b.row * a->kv_heads + g) * (size_t)a->context;  /* the head's first cache position */
    const char *keys = (const char *)a->kcache + row * D * esize, *values = (const char *)a->vcache + row * D * esize;
    float m = -INFINITY, l = 0.0f, sc[KEY_CHUNK];
    for (int s0 = at_b.first; s0 <= at_b.start; s0 += KEY_CHUNK) {
        const int n = at_b.start + 1 - s0 < KEY_CHUNK ? at_b.start + 1 - s0 : KEY_CHUNK;
        float mx = m;
        for (int j = 0; j < n; j++) {
            sc[j] = dot(q, keys + (size_t)(s0 + j) * D * esize, bf16, D) * a->scale;
            if (sc[j] > mx) mx = sc[j];
        }
        if (mx > m) {  /* a new maximum: what was summed so far shrinks by exp(m - mx) */
            const float c = expf(m - mx);
            l *= c;
            scale(acc, c, D);
            m = mx;
        }
        for (int j = 0; j < n; j++) {
            const float p = expf(sc[j] - m);
            l += p;
            add(acc, p, values + (size_t)(s0 + j) * D * esize, bf16, D);
        }
    }
    if (a->sinks) {
        const float sink = load(a->sinks, bf16, h);
        if (sink > m) {
            const float c = expf(m - sink);
            l *= c;
            scale(acc, c, D);
            m = sink;
        }
        l += expf(sink - m);
    }
    const size_t at = ((size_t)b * a->heads + h) * D;
    for (int d = 0; d < D; d++) store(a->out, bf16, at + d, acc[d] / l);
}

/* 0, or a negative code for arguments it cannot serve. */
int tk_attend_one(const tk_attend_args *a) {
    if (a->batch < 1 || a->heads < 1 || a->kv_heads < 1 || a->heads % a->kv_heads || a->dim < 1 ||
        a->dim > MAX_HEAD_DIM || a->rot < 0 || a->rot > a->dim || a->rot % 2 || a->threads < 1 ||
        a->start < 0 || a->first < 0 || a->first > a->start || a->start >= a->context || a->bf16 < 0 || a->bf16 > 1)
        return -1;
    if (a->starts) {  /* every position inside a row; the rows themselves are checked by the caller */
        if (!a->rows || a->window < 0 || a->chunk < 0) return -1;
        for (int b = 0; b < a->batch; b++)
            if (a->starts[b] < 0 || a->starts[b] >= a->context || a->rows[b] < 0) return -1;
    }
    if (a->isa < ISA_BASE || a->isa > ISA_AVX512 || !(tk_isa_mask() & (1 << a->isa))) return -2;
    key_dot_fn dot = a->isa == ISA_AVX512 ? key_dot_avx512 : a->isa == ISA_AVX2 ? key_dot_avx2 : key_dot_base;
    add_value_fn add = a->isa == ISA_AVX512 ? add_value_avx512 : a->isa == ISA_AVX2 ? add_value_avx2 : add_value_base;
    scale_fn scale = a->isa == ISA_AVX512 ? scale_avx512 : a->isa == ISA_AVX2 ? scale_avx2 : scale_base;
    const int D = a->dim, bf16 = a->bf16;
    const size_t esize = bf16 ? 2 : 4;
    #pragma omp parallel num_threads(a->threads)
    {
        #pragma omp for schedule(static)
        for (int bg = 0; bg < a->batch * a->kv_heads; bg++) {  /* the new key (roped) and value into the cache */
            const int b = bg / a->kv_heads, g = bg % a->kv_heads;
            const seq_place at_b = place_of(a, b);
            const size_t cell = ((at_b.row * a->kv_heads + g) * (size_t)a->context + (size_t)at_b.start) * D;
            rope_head(a->k, (size_t)b * a->ld_k + (size_t)g * D, at_b.cos, at_b.sin, a->rot, D, bf16, a->kcache, cell,
                      bf16);
            memcpy((char *)a->vcache + cell * esize, (const char *)a->v + ((size_t)b * a->ld_v + (size_t)g * D) * esize,
                   D * esize);
        }
        #pragma omp for schedule(static)
        for (int bh = 0; bh < a->batch * a->heads; bh++) attend_head(a, bh / a->heads, bh % a->heads, dot, add, scale);
    }
    return 0;
}
