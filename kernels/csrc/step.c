/* One decode token through a run of decoder layers in one call: per layer RMSNorm, the q/k/v projections, the
 * q/k norms, attention (tk_attend_one; or a recurrent mixer's projection and step over its state: recur.c), the
 * output projection into the residual stream, RMSNorm, the router, the choice of experts, the experts (tk_moe)
 * into the residual stream. Everything the layer needs was planned once in
 * Python (runtime/decode_step.py: weights, buffers, variants), so a token returns to Python once, not ten times a
 * layer with small torch ops between the calls. It rounds where the torch path rounds (bf16 after each norm and
 * projection, and after adding q/k/v's and the router's biases; float32 residual stream), which stays the reference
 * it is tested against.
 *
 * Letters: H hidden size, Hq query heads, Hkv key/value heads, D head dim, E experts, K experts per token. */
#include "common.h"

enum { QK_NORM_NONE = 0, QK_NORM_FULL = 1, QK_NORM_HEAD = 2 };
enum { SCORE_SOFTMAX = 0, SCORE_SOFTMAX_TOPK = 1, SCORE_SIGMOID = 2 };
enum { MAX_EXPERTS = 1024, MAX_TOP_K = 64 };
enum { FFN_ROUTED = 0, FFN_SHARED = 1, FFN_DENSE = 2 };
enum { MIX_ATTENTION = 0, MIX_DELTANET = 1, MIX_SSM = 2, MIX_SHORTCONV = 3 };

static void bf16_to_float(const uint16_t *src, float *dst, int n) {
    for (int i = 0; i < n; i++) dst[i] = bf16f(src[i]);
}

/* y += bias, both bf16, rounded to bf16 as torch adds them (in float32, then to the nearest even); or both float32
 * (float32 compute). */
static void add_bias(void *y, const void *bias, int n, int f32) {
    if (!bias) return;
    if (f32) {
        for (int i = 0; i < n; i++) ((float *)y)[i] += ((const float *)bias)[i];
        return;
    }
    uint16_t *yb = (uint16_t *)y;
    const uint16_t *b = (const uint16_t *)bias;
    for (int i = 0; i < n; i++) yb[i] = bf16_of(bf16f(yb[i]) + bf16f(b[i]));
}

/* RMSNorm of `rows` rows of n values, ldx apart, into y: bf16 (a bf16 weight; x bf16, or float32 where `x_f32`)
 * or float32 throughout (f32). */
static void norm(const void *x, int x_f32, size_t ldx, const void *w, void *y, int rows, int n, float eps, int f32) {
    if (f32) tk_rms_norm_float((const float *)x, ldx, (const float *)w, (float *)y, rows, n, eps);
    else if (x_f32) tk_rms_norm_f32((const float *)x, ldx, (const uint16_t *)w, (uint16_t *)y, rows, n, eps);
    else tk_rms_norm_bf16((const uint16_t *)x, ldx, (const uint16_t *)w, (uint16_t *)y, rows, n, eps);
}

/* The router's logits [E] (bf16 values) -> K expert ids and weights, as runtime/moe.py's route: "softmax" and
 * "sigmoid" score every expert and take the K best scores (plus the layer's correction bias where it has one: for
 * choosing only; ties: the lower id), their scores normalised to sum to one if asked; "softmax_topk" takes the K best
 * logits and a softmax over those alone. Then times `scaling`. */
static void choose_experts(const float *logits, const float *correction, int E, int K, int scoring, int normalize,
                           float scaling, int64_t *ids, float *weights) {
    float scores[MAX_EXPERTS], choose[MAX_EXPERTS];
    int taken[MAX_EXPERTS] = {0};
    if (scoring == SCORE_SOFTMAX) {
        float mx = -INFINITY, sum = 0.0f;
        for (int e = 0; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
        for (int e = 0; e < E; e++) sum += scores[e] = expf(logits[e] - mx);
        for (int e = 0; e < E; e++) scores[e] /= sum;
    } else if (scoring == SCORE_SIGMOID) {
        for (int e = 0; e < E; e++) scores[e] = 1.0f / (1.0f + expf(-logits[e]));
    } else {
        memcpy(scores, logits, sizeof(float) * (size_t)E);
    }
    /* sigmoid without a correction chooses by the logits, its own order (large logits' scores all round to 1) */
    const float *plain = scoring == SCORE_SIGMOID ? logits : scores;
    for (int e = 0; e < E; e++) choose[e] = correction ? scores[e] + correction[e] : plain[e];
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || choose[e] > choose[best])) best = e;
        taken[best] = 1;
        ids[k] = best;
        weights[k] = scores[best];
    }
    if (scoring == SCORE_SOFTMAX_TOPK) {  /* the chosen logits, best first: a softmax over them */
        float sum = 0.0f;
        for (int k = 0; k < K; k++) sum += weights[k] = expf(weights[k] - scores[ids[0]]);
        for (int k = 0; k < K; k++) weights[k] /= sum;
    } else if (normalize) {  /* (sigmoid scores may all be tiny: torch's route adds 1e-20, and so does this) */
        float sum = 0.0f;
        for (int k = 0; k < K; k++) sum += weights[k];
        if (scoring == SCORE_SIGMOID) sum += 1e-20f;
        for (int k = 0; k < K; k++) weights[k] /= sum;
    }
    for (int k = 0; k < K; k++) weights[k] *= scaling;
}

/* The layer's own SwiGLU of the normed stream (hf) into mlp_out, as runtime/moe.py's LinearMLP computes it through
 * DenseLinear: gate and up (rounded to bf16), silu(gate) rounded, times up rounded, down (rounded); float32 compute
 * rounds nothing. */
static int swiglu(tk_layer_args *a) {
    int code;
    if ((code = tk_linear(&a->mlp[0])) || (code = tk_linear(&a->mlp[1]))) return code;
    const int I = a->mlp_inter;
    if (a->f32) {
        const float *g = (const float *)a->mlp_gate, *u = (const float *)a->mlp_up;
        for (int i = 0; i < I; i++) a->mlp_h[i] = silu(g[i]) * u[i];
    } else {
        const uint16_t *g = (const uint16_t *)a->mlp_gate, *u = (const uint16_t *)a->mlp_up;
        for (int i = 0; i < I; i++) {
            const float s = bf16f(bf16_of(silu(bf16f(g[i]))));
            a->mlp_h[i] = bf16f(bf16_of(s * bf16f(u[i])));
        }
    }
    return tk_linear(&a->mlp[2]);
}

static inline float mlp_value(const tk_layer_args *a, int i) {
    return a->f32 ? ((const float *)a->mlp_out)[i] : bf16f(((const uint16_t *)a->mlp_out)[i]);
}

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float rounded(float x, int f32) { return f32 ? x : bf16f(bf16_of(x)); }

/* Gated attention: each query value's output [nq] (attend_out) times sigmoid of its gate (in qkv_out after v),
 * rounded as torch rounds bf16 (the sigmoid, then the product). */
static void gate_output(tk_layer_args *a, const char *gates, int nq) {
    if (a->f32) {
        float *out = (float *)a->attend_out;
        const float *g = (const float *)gates;
        for (int i = 0; i < nq; i++) out[i] *= sigmoid(g[i]);
        return;
    }
    uint16_t *out = (uint16_t *)a->attend_out;
    const uint16_t *g = (const uint16_t *)gates;
    for (int i = 0; i < nq; i++) out[i] = bf16_of(bf16f(out[i]) * rounded(sigmoid(bf16f(g[i])), 0));
}

/* o's sums (plus its bias) into the residual stream, times the layer's residual factor. */
static void o_into(const tk_layer_args *a, float *x) {
    const int H = a->hidden;
    const float r = a->residual;
    if (a->o_bias)
        for (int i = 0; i < H; i++) x[i] += r * (a->o.y[i] + a->o_bias[i]);
    else
        for (int i = 0; i < H; i++) x[i] += r * a->o.y[i];
}

/* A recurrent token mixer over the normed stream (hf): its projection, its step (which updates the layer's state),
 * o, into the stream; rounded where the torch path rounds under bf16 (the projection, the step's output). */
static int mixer_step(tk_layer_args *a, float *x) {
    const int P = a->proj_rows, f32 = a->f32;
    int code;
    for (int i = 0; i < a->n_proj; i++)
        if ((code = tk_linear(&a->proj[i]))) return code;
    add_bias(a->mix_p, a->proj_bias, P, f32);
    if (!f32) bf16_to_float((const uint16_t *)a->mix_p, a->mix_pf, P);
    if (a->mixer == MIX_DELTANET) code = tk_deltanet_step((const tk_deltanet_args *)a->recur);
    else if (a->mixer == MIX_SSM) code = tk_ssm_step((const tk_ssm_args *)a->recur);
    else code = tk_shortconv_step((const tk_shortconv_args *)a->recur);
    if (code) return code;
    if (!f32)  /* the step's float32 output as the torch path hands it to o: bf16 (float32: o.x is mix_out) */
        for (int i = 0; i < a->mix_inner; i++) ((float *)a->o.x)[i] = bf16f(bf16_of(a->mix_out[i]));
    if ((code = tk_linear(&a->o))) return code;
    o_into(a, x);
    return 0;
}

static int feed_forward(tk_layer_args *a, float *x);

/* x [H] float32, the residual stream, through one layer (positions as `a->attend` says). 0, or a negative code.
 * bf16 compute rounds where the torch path rounds: the norms' outputs (h), the projections' (qkv_out, attend_out, the
 * router's logits); float32 compute rounds nothing, and the normed stream goes to the projections as it is (hf). */
static int layer_step(tk_layer_args *a, float *x) {
    const int H = a->hidden, D = a->attend.dim, Hq = a->attend.heads, Hkv = a->attend.kv_heads, f32 = a->f32;
    const int nq = Hq * D, nkv = Hkv * D;
    const size_t item = f32 ? 4 : 2;
    char *qkv = (char *)a->qkv_out;
    int code;
    /* attention, or the layer's recurrent mixer */
    norm(x, 1, H, a->input_norm, f32 ? (void *)a->hf : (void *)a->h, 1, H, a->eps, f32);
    if (!f32) bf16_to_float(a->h, a->hf, H);
    if (a->mixer != MIX_ATTENTION) {
        if ((code = mixer_step(a, x))) return code;
        return feed_forward(a, x);
    }
    for (int i = 0; i < a->n_qkv; i++)
        if ((code = tk_linear(&a->qkv[i]))) return code;
    add_bias(qkv, a->qkv_bias, a->qkv_rows, f32);
    if (a->qk_norm == QK_NORM_FULL) {
        norm(qkv, f32, nq, a->q_norm, qkv, 1, nq, a->eps, f32);
        norm(qkv + item * nq, f32, nkv, a->k_norm, qkv + item * nq, 1, nkv, a->eps, f32);
    } else if (a->qk_norm == QK_NORM_HEAD) {
        norm(qkv, f32, D, a->q_norm, qkv, Hq, D, a->eps, f32);
        norm(qkv + item * nq, f32, D, a->k_norm, qkv + item * nq, Hkv, D, a->eps, f32);
    }
    if ((code = tk_attend_one(&a->attend))) return code;
    if (a->attn_gate) gate_output(a, qkv + item * (nq + 2 * nkv), nq);
    if (!f32) bf16_to_float((const uint16_t *)a->attend_out, (float *)a->o.x, nq);  /* (float32: o.x is attend_out) */
    if ((code = tk_linear(&a->o))) return code;
    o_into(a, x);
    return feed_forward(a, x);
}

/* The layer's feed-forward over x (after its token mixer): RMSNorm, then the routed experts (and a shared one), or
 * the layer's own SwiGLU, into the stream. */
static int feed_forward(tk_layer_args *a, float *x) {
    const int H = a->hidden, f32 = a->f32;
    const float r = a->residual;
    int code;
    norm(x, 1, H, a->post_norm, f32 ? (void *)a->hf : (void *)a->h, 1, H, a->eps, f32);
    if (!f32) bf16_to_float(a->h, a->hf, H);
    if (a->ffn == FFN_DENSE) {  /* the SwiGLU's output (bf16) into the stream, as the torch path adds it: times the
                                 * residual factor in its own dtype (bf16: rounded; exact at 1) */
        if ((code = swiglu(a))) return code;
        for (int i = 0; i < H; i++) x[i] += rounded(r * mlp_value(a, i), f32);
        return 0;
    }
    if ((code = tk_linear(&a->router))) return code;
    float logits[MAX_EXPERTS];
    if (f32) {  /* the router's float32 sums, its bias added */
        memcpy(logits, a->router.y, sizeof(float) * (size_t)a->moe.experts);
        if (a->router_bias)
            for (int e = 0; e < a->moe.experts; e++) logits[e] += ((const float *)a->router_bias)[e];
    } else {
        add_bias(a->router.yb, a->router_bias, a->moe.experts, 0);
        bf16_to_float(a->router.yb, logits, a->moe.experts);  /* the router's logits as the torch path rounds them */
    }
    choose_experts(logits, a->correction, a->moe.experts, a->moe.top_k, a->scoring, a->normalize, a->scaling,
                   (int64_t *)a->moe.ids, (float *)a->moe.weights);
    if ((code = tk_moe(&a->moe))) return code;
    if (a->ffn == FFN_SHARED) {  /* the experts' float32 sum plus the shared one's, then into the stream */
        if ((code = swiglu(a))) return code;
        if (a->shared_gate) {  /* sigmoid(gate . h) times the shared expert's output */
            float sum = 0.0f;
            for (int i = 0; i < H; i++) sum += a->shared_gate[i] * a->hf[i];
            const float g = rounded(sigmoid(rounded(sum, f32)), f32);
            for (int i = 0; i < H; i++) x[i] += r * (a->moe.out[i] + rounded(g * mlp_value(a, i), f32));
            return 0;
        }
        for (int i = 0; i < H; i++) x[i] += r * (a->moe.out[i] + mlp_value(a, i));
        return 0;
    }
    for (int i = 0; i < H; i++) x[i] += r * a->moe.out[i];
    return 0;
}

/* One token (x [H] float32, at position `start`, whose RoPE tables are cos and sin [R]) through `n` planned layers;
 * each layer's chosen experts are left in its moe.ids and moe.weights. 0, or a negative code. */
int tk_decode_layers(tk_layer_args *layers, int n, float *x, int start, const void *cos, const void *sin) {
    for (int l = 0; l < n; l++) {
        tk_layer_args *a = &layers[l];
        if (a->ffn < FFN_ROUTED || a->ffn > FFN_DENSE || a->mixer < MIX_ATTENTION || a->mixer > MIX_SHORTCONV ||
            a->n_qkv < 0 || a->n_qkv > 4 || a->n_proj < 0 || a->n_proj > 4 || (a->mixer != MIX_ATTENTION && !a->recur))
            return -8;
        if (a->ffn != FFN_DENSE && (a->moe.experts > MAX_EXPERTS || a->moe.top_k > MAX_TOP_K ||
                                    a->moe.top_k > a->moe.experts || a->moe.tokens != 1))
            return -8;
        a->attend.start = start, a->attend.cos = cos, a->attend.sin = sin;
        a->attend.first = a->window && start + 1 > a->window ? start + 1 - a->window : 0;
        const int code = layer_step(a, x);
        if (code) return code;
    }
    return 0;
}
