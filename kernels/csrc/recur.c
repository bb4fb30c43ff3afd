/* One token of the hybrids' recurrent token mixers per sequence, after their input projection: the causal
 * convolution's state shifted and its output, then Gated DeltaNet's delta rule (tk_deltanet_step), Mamba-2's
 * state-space update (tk_ssm_step) or LFM2's gated short convolution (tk_shortconv_step), each with its output gate
 * and norm. In torch a step was some twenty small ops a layer (4 ms of a Qwen3.5 layer's 14 ms where its weights
 * stream in 8); here each state is read and written once, its heads spread over the threads. runtime/deltanet.py,
 * runtime/mamba2.py and runtime/shortconv.py are the Python side and the references the kernels are tested against.
 *
 * Everything is float32: the projections, the convolution's state and weights, the recurrent state, the output.
 * Letters: B sequences, C convolution channels, K its width, Hk/Hv key/value heads, Dk/Dv their dims (Gated
 * DeltaNet), Hm heads of P values and a state of N per value, G groups (Mamba-2), H hidden size. */
#include "common.h"

enum { MAX_DIM = 1024 };  /* a head's values, keys or state at most (the largest published: 256) */

/* The per-ISA inner loops, compiled for each variant (GCC vectorizes them under the target's flags): y += a * x,
 * and the dot product of two rows. */
#define DEFINE_RECUR_LOOPS(sfx, TARGET)                                                                            \
    TARGET static void axpy_##sfx(float *restrict y, float a, const float *restrict x, int n) {                  \
        for (int i = 0; i < n; i++) y[i] += a * x[i];                                                             \
    }                                                                                                             \
    TARGET static void decay_add_##sfx(float *restrict s, float decay, float k, const float *restrict delta,     \
                                       float q, float *restrict out, int n) {                                     \
        for (int i = 0; i < n; i++) {                                                                             \
            const float v = s[i] * decay + k * delta[i];                                                          \
            s[i] = v;                                                                                             \
            out[i] += v * q;                                                                                      \
        }                                                                                                         \
    }

DEFINE_RECUR_LOOPS(base, )
DEFINE_RECUR_LOOPS(avx2, __attribute__((target("avx2,fma"))))
DEFINE_RECUR_LOOPS(avx512, AVX512_TARGET)

typedef void (*axpy_fn)(float *, float, const float *, int);
typedef void (*decay_add_fn)(float *, float, float, const float *, float, float *, int);

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }  /* (torch's threshold) */

/* One channel of a causal depthwise convolution: its K-1 last inputs `state` shifted left with `in` appended,
 * then their dot with the channel's weights plus the bias. */
static inline float conv_step(float *state, const float *w, int K, float in, float bias) {
    float acc = bias;
    for (int j = 0; j < K - 1; j++) acc += w[j] * state[j];
    acc += w[K - 1] * in;
    for (int j = 0; j + 1 < K - 1; j++) state[j] = state[j + 1];
    if (K > 1) state[K - 2] = in;
    return acc;
}

static int pick_isa(int isa) {
    if (isa < ISA_BASE || isa > ISA_AVX512 || !(tk_isa_mask() & (1 << isa))) return -1;
    return isa;
}

/* Gated DeltaNet: each row's projections p = [q, k, v (C), z (Hv Dv), b (Hv), a (Hv)]; `work` [B, C] scratch.
 * After the convolution (SiLU), q and k are L2-normalised per key head (q then times Dk^-1/2); per value head,
 * beta = sigmoid(b), decay = exp(A softplus(a + dt_bias)), S <- decay S + k (beta (v - decay S^T k))^T, o = S^T q,
 * and out = RMSNorm(o) * norm * silu(z). A value head reads key head h / (Hv/Hk), or h % Hk where `tiled`. */
int tk_deltanet_step(const tk_deltanet_args *a) {
    const int B = a->batch, Hk = a->key_heads, Hv = a->value_heads, Dk = a->key_dim, Dv = a->value_dim, K = a->conv_k;
    if (B < 1 || Hk < 1 || Hv < Hk || Hv % Hk || Dk < 1 || Dv < 1 || Dk > MAX_DIM || Dv > MAX_DIM || K < 1 ||
        a->threads < 1)
        return -1;
    const int isa = pick_isa(a->isa);
    if (isa < 0) return -2;
    axpy_fn axpy = isa == ISA_AVX512 ? axpy_avx512 : isa == ISA_AVX2 ? axpy_avx2 : axpy_base;
    decay_add_fn decay_add = isa == ISA_AVX512 ? decay_add_avx512 : isa == ISA_AVX2 ? decay_add_avx2 : decay_add_base;
    const int key = Hk * Dk, value = Hv * Dv, C = 2 * key + value, r = Hv / Hk;
    const float scale = 1.0f / sqrtf((float)Dk);
    #pragma omp parallel num_threads(a->threads)
    {
        #pragma omp for schedule(static)
        for (long long bc = 0; bc < (long long)B * C; bc++) {  /* the convolution, channel by channel */
            const int b = (int)(bc / C), c = (int)(bc % C);
            float *state = a->conv + ((size_t)b * C + c) * (K - 1);
            a->work[(size_t)b * C + c] = silu(conv_step(state, a->conv_w + (size_t)c * K, K,
                                                        a->p[(size_t)b * a->ld_p + c], 0.0f));
        }
        #pragma omp for schedule(static)
        for (int bh = 0; bh < B * 2 * Hk; bh++) {  /* q and k: each key head to unit length (q then scaled) */
            const int b = bh / (2 * Hk), h = bh % (2 * Hk);
            float *x = a->work + (size_t)b * C + (size_t)h * Dk;
            float ss = 0.0f;
            for (int i = 0; i < Dk; i++) ss += x[i] * x[i];
            const float inv = 1.0f / sqrtf(ss + 1e-6f) * (h < Hk ? scale : 1.0f);
            for (int i = 0; i < Dk; i++) x[i] *= inv;
        }
        #pragma omp for schedule(static)
        for (int bh = 0; bh < B * Hv; bh++) {  /* each value head's state */
            const int b = bh / Hv, h = bh % Hv, kh = a->tiled ? h % Hk : h / r;
            const float *row = a->p + (size_t)b * a->ld_p, *w = a->work + (size_t)b * C;
            const float *q = w + (size_t)kh * Dk, *k = w + key + (size_t)kh * Dk, *v = w + 2 * key + (size_t)h * Dv;
            const float *z = row + C + (size_t)h * Dv;
            const float beta = 1.0f / (1.0f + expf(-row[C + value + h]));
            const float decay = expf(a->A[h] * softplus(row[C + value + Hv + h] + a->dt_bias[h]));
            float *S = a->ssm + ((size_t)b * Hv + h) * (size_t)Dk * Dv;
            float read[MAX_DIM], delta[MAX_DIM], o[MAX_DIM];
            memset(read, 0, sizeof(float) * Dv);
            memset(o, 0, sizeof(float) * Dv);
            for (int i = 0; i < Dk; i++) axpy(read, k[i], S + (size_t)i * Dv, Dv);  /* S^T k */
            for (int j = 0; j < Dv; j++) delta[j] = (v[j] - decay * read[j]) * beta;
            for (int i = 0; i < Dk; i++) decay_add(S + (size_t)i * Dv, decay, k[i], delta, q[i], o, Dv);
            float ss = 0.0f;
            for (int j = 0; j < Dv; j++) ss += o[j] * o[j];
            const float inv = 1.0f / sqrtf(ss / Dv + a->eps);
            float *out = a->out + (size_t)b * value + (size_t)h * Dv;
            for (int j = 0; j < Dv; j++) out[j] = o[j] * inv * a->norm_w[j] * silu(z[j]);
        }
    }
    return 0;
}

/* Mamba-2: each row's projections p = [z (I), x, B, C (the convolution's channels: I + 2 G N), dt (Hm)]. After the
 * convolution (bias, SiLU), per head: dt = clamp(softplus(dt + dt_bias)), S <- exp(dt A) S + dt x B^T, y = S C +
 * D x; then y * silu(z) RMSNormed per group of I / G values, times the norm's weight. */
int tk_ssm_step(const tk_ssm_args *a) {
    const int B = a->batch, Hm = a->heads, P = a->head_dim, N = a->state, G = a->groups, K = a->conv_k;
    if (B < 1 || Hm < 1 || P < 1 || N < 1 || N > MAX_DIM || P > MAX_DIM || G < 1 || Hm % G || K < 1 ||
        a->threads < 1)
        return -1;
    const int isa = pick_isa(a->isa);
    if (isa < 0) return -2;
    axpy_fn axpy = isa == ISA_AVX512 ? axpy_avx512 : isa == ISA_AVX2 ? axpy_avx2 : axpy_base;
    const int inner = Hm * P, C = inner + 2 * G * N, per = Hm / G, width = inner / G;
    #pragma omp parallel num_threads(a->threads)
    {
        #pragma omp for schedule(static)
        for (long long bc = 0; bc < (long long)B * C; bc++) {
            const int b = (int)(bc / C), c = (int)(bc % C);
            float *state = a->conv + ((size_t)b * C + c) * (K - 1);
            a->work[(size_t)b * C + c] = silu(conv_step(state, a->conv_w + (size_t)c * K, K,
                                                        a->p[(size_t)b * a->ld_p + inner + c],
                                                        a->conv_b ? a->conv_b[c] : 0.0f));
        }
        #pragma omp for schedule(static)
        for (int bh = 0; bh < B * Hm; bh++) {
            const int b = bh / Hm, h = bh % Hm, g = h / per;
            const float *row = a->p + (size_t)b * a->ld_p, *w = a->work + (size_t)b * C;
            const float *x = w + (size_t)h * P, *Bv = w + inner + (size_t)g * N, *Cv = w + inner + (size_t)(G + g) * N;
            float dt = softplus(row[inner + C + h] + a->dt_bias[h]);
            dt = dt < a->dt_min ? a->dt_min : dt > a->dt_max ? a->dt_max : dt;
            const float dA = expf(dt * a->A[h]);
            float *S = a->ssm + ((size_t)b * Hm + h) * (size_t)P * N;
            float *y = a->out + (size_t)b * inner + (size_t)h * P;
            for (int i = 0; i < P; i++) {
                float *s = S + (size_t)i * N, acc = 0.0f;
                for (int n = 0; n < N; n++) s[n] *= dA;
                axpy(s, dt * x[i], Bv, N);
                for (int n = 0; n < N; n++) acc += s[n] * Cv[n];
                y[i] = acc + a->D[h] * x[i];
            }
        }
        #pragma omp for schedule(static)
        for (int bg = 0; bg < B * G; bg++) {  /* gated, then RMSNormed per group (norm_before_gate false) */
            const int b = bg / G, g = bg % G;
            float *y = a->out + (size_t)b * inner + (size_t)g * width;
            const float *z = a->p + (size_t)b * a->ld_p + (size_t)g * width;
            float ss = 0.0f;
            for (int i = 0; i < width; i++) {
                y[i] *= silu(z[i]);
                ss += y[i] * y[i];
            }
            const float inv = 1.0f / sqrtf(ss / width + a->eps);
            for (int i = 0; i < width; i++) y[i] *= inv * a->norm_w[(size_t)g * width + i];
        }
    }
    return 0;
}

/* LFM2's gated short convolution: each row's projections p = [B, C, x] (H each) -> C * conv(B * x) (with the
 * convolution's bias), no activation. */
int tk_shortconv_step(const tk_shortconv_args *a) {
    const int B = a->batch, H = a->hidden, K = a->conv_k;
    if (B < 1 || H < 1 || K < 1 || a->threads < 1) return -1;
    #pragma omp parallel for num_threads(a->threads) schedule(static)
    for (long long bc = 0; bc < (long long)B * H; bc++) {
        const int b = (int)(bc / H), c = (int)(bc % H);
        const float *row = a->p + (size_t)b * a->ld_p;
        float *state = a->conv + ((size_t)b * H + c) * (K - 1);
        const float conv = conv_step(state, a->conv_w + (size_t)c * K, K, row[c] * row[2 * H + c],
                                     a->conv_b ? a->conv_b[c] : 0.0f);
        a->out[(size_t)b * H + c] = row[H + c] * conv;
    }
    return 0;
}
