"""The architecture of a decoder-only MoE model, normalised across families.

Every family parses its `config.json` into this one dataclass; the decoder, the weight-name spec and
the RAM estimate read only from it. Fields are what the forward pass needs, nothing more.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tandem.kernels.errors import CheckpointError, UnsupportedModelError

# no q/k norm; RMSNorm per head (Qwen3); over the projection (OLMoE); each head of the rotated q and k scaled to unit
# RMS with no weight, in the layers that rotate (Llama 4's L2 norm)
QKNorm = Literal["none", "head", "full", "l2"]
# the experts' and MLPs' gate activation: silu(gate) * up, or GELU with tanh's approximation (Gemma's GeGLU)
Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class ModelConfig:
    """The fields without a default every family reads from its config.json; the rest default to the plain
    decoder (Llama-style attention, every layer a MoE block, no shared expert), so a family sets only what differs
    and a new knob needs no edit in the families that do not use it."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    # mixture of experts
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to one
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    dense_intermediate_size: int = 0  # for layers without experts (0 if there are none)
    sparse_layers: tuple[bool, ...] = ()  # per layer: True if its feed-forward is a MoE block; () = every layer
    # per layer: its token mixer by name (runtime/layers.py MIXERS); () = "mla" in every layer under kv_lora_rank,
    # else "attention"
    mixers: tuple[str, ...] = ()
    # attention variant
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: QKNorm = "none"
    qk_norm_after_rope: bool = False  # the q/k norms taken of the rotated q and k (HunYuan), not before RoPE
    # Granite's muP multipliers: the embeddings times embedding_multiplier, each layer's attention and feed-forward
    # outputs times residual_multiplier into the residual stream, attention scores times attention_multiplier (None:
    # 1/sqrt(head_dim)), the logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    clip_qkv: float | None = None
    sliding_window: int | None = None  # attention sees the last this many positions (itself included) ...
    sliding_layers: tuple[bool, ...] = ()  # ... in these layers (() = every layer)
    # Llama 4: attention within chunks of `attention_chunk` positions (a query sees the keys from the start of its
    # own chunk) in the `chunked_layers`; the `nope_layers` rotate nothing, their queries scaled by the position's
    # temperature (`attention_temperature`: (floor_scale, attn_scale), 1 + attn_scale * ln(1 + floor((p + 1) /
    # floor_scale)); None: not scaled)
    attention_chunk: int | None = None
    chunked_layers: tuple[bool, ...] = ()
    nope_layers: tuple[bool, ...] = ()  # () = every layer rotates
    attention_temperature: tuple[float, float] | None = None
    # rotary embeddings (runtime/rope.py): the variant, its parameters from config.json, the dims rotated
    rope_type: str = "default"
    rope_params: tuple[tuple[str, Any], ...] = ()  # the variant's parameters, sorted by name (frozen, hashable)
    rotary_dim: int = 0  # 0 = the whole head
    # embeddings and special tokens
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # PhiMoE
    norm_type: Literal["rms", "layer"] = "rms"  # the decoder's norms: RMSNorm, or LayerNorm with a bias (same eps)
    lm_head_bias: bool = False
    scoring: str = "softmax"  # every MoE layer's RoutingRule.scoring (runtime/moe.py)
    scale_expert_input: bool = False  # RoutingRule.scale_input: the routed expert takes x times its weight (Llama 4)
    jitter_eps: float = 0.0  # RoutingRule.jitter_eps: sparsemixer's threshold (PhiMoE's router_jitter_noise)
    # DeepSeek-V2/V3: Multi-head Latent Attention (runtime/mla.py) and their routing (moe.RoutingRule)
    kv_lora_rank: int = 0  # the latent each token caches; 0 = plain attention (no MLA)
    q_lora_rank: int = 0  # 0 = queries through one q_proj, else q_a_proj -> RMSNorm -> q_b_proj
    qk_nope_head_dim: int = 0  # query/key dims per head without rotation (head_dim = nope + rope under MLA)
    qk_rope_head_dim: int = 0  # ... and with it: one rotated key per token, shared by every head
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary dims in adjacent pairs (x0, x1), (x2, x3)... rather than two halves (MLA
    # rotates them so; grouped-query attention takes q and k in the halves' order, rows reordered once at load)
    # (scoring: above) moe.RoutingRule's fields, as named there
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    routed_scaling_factor: float = 1.0
    router_correction: bool = False  # the router has a per-expert e_score_correction_bias, for choosing only
    # gpt-oss
    attention_sinks: bool = False  # each head's learned logit (self_attn.sinks) joins its softmax and takes mass
    router_bias: bool = False  # the router adds a per-expert bias (router.bias) to its logits
    clamped_swiglu: tuple[float, float] | None = None  # (alpha, limit): the experts compute gpt-oss's clamped SwiGLU
    # with biases (moe.ClampedSwiGLUExpert: torch; moe.MXFP4Expert: the C kernels); None: plain SwiGLU, no biases
    experts_mxfp4: bool = False  # the experts are stored as MXFP4 (`*_blocks`, `*_scales`: gpt-oss as published)
    # Gemma 4
    activation: Activation = "silu"  # the experts' and MLPs' gate: silu (SwiGLU) or tanh-approximated GELU (GeGLU)
    sandwich_norms: bool = False  # attention's output RMSNormed before it joins the residual stream, and so is the
    # feed-forward's (its own kind does that: runtime/parallel.py)
    parallel_dense: bool = False  # the MoE layers run a dense MLP beside their experts (runtime/parallel.py)
    # the layers outside `sliding_layers` ("global") where their attention differs: their head size, key/value heads
    # and RoPE (theta, variant, parameters); 0 / None: as every other layer's
    global_head_dim: int = 0
    global_kv_heads: int = 0
    global_rope: tuple[float, str, tuple[tuple[str, Any], ...]] | None = None
    values_from_keys: bool = False  # global layers: no v_proj, the values are k_proj's output (attention_k_eq_v)
    value_norm: bool = False  # the values RMSNormed per head, with no weight
    logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    layer_scalars: bool = False  # each layer's output (the whole residual stream) times its `layer_scalar`
    # hybrids (Qwen3-Next, Qwen3.5): `mixers` names their token mixers without attention (runtime/deltanet.py)
    norm_offset: float = 0.0  # the decoder's RMSNorm weights (its q/k norms' too) are stored less this: a norm
    # multiplies by weight + norm_offset (Qwen3-Next's zero-centred norms store weight - 1)
    attention_gate: bool = False  # q_proj gives each head its query then as many gate values; the heads' output
    # times sigmoid(gate) goes to o_proj
    linear_key_heads: int = 0  # Gated DeltaNet's query/key heads ...
    linear_value_heads: int = 0  # ... its value heads (a multiple of the key heads) ...
    linear_key_dim: int = 0  # ... and their head dims
    linear_value_dim: int = 0
    linear_tiled: bool = False  # value head j reads key head j % key heads (llama.cpp's Qwen3.5 files reorder the
    # value heads so), not j // (value heads per key head)
    conv_kernel: int = 0  # the width of the mixers' causal depthwise convolution
    conv_bias: bool = False  # the mixers' convolutions have biases (LFM2's projections too)
    # Mamba-2 (runtime/mamba2.py: Granite 4.0-H): heads of ssm_head_dim values, a state of ssm_state per value, B and
    # C shared by the heads of each of ssm_groups groups; in_proj and out_proj biases; the time step's clamp
    ssm_heads: int = 0
    ssm_head_dim: int = 0
    ssm_state: int = 0
    ssm_groups: int = 1
    ssm_bias: bool = False
    ssm_dt_limit: tuple[float, float] = (0.0, float("inf"))

    def __post_init__(self) -> None:
        if not self.sparse_layers:  # the default: a MoE block in every layer (frozen, hence object.__setattr__)
            object.__setattr__(self, "sparse_layers", (True,) * self.num_layers)
        if not self.sliding_layers:
            object.__setattr__(self, "sliding_layers", (True,) * self.num_layers)
        if not self.mixers:
            object.__setattr__(self, "mixers", ("mla" if self.kv_lora_rank else "attention",) * self.num_layers)
        for name in ("chunked_layers", "nope_layers"):
            if not getattr(self, name):
                object.__setattr__(self, name, (False,) * self.num_layers)

    @property
    def attention_scale(self) -> float:
        """The scale of grouped-query attention's scores: 1/sqrt(head_dim), or the config's multiplier."""
        return self.head_dim ** -0.5 if self.attention_multiplier is None else self.attention_multiplier

    def window(self, layer: int) -> int | None:
        """How many positions attention in `layer` sees (None: all)."""
        return self.sliding_window if self.sliding_window and self.sliding_layers[layer] else None

    def chunk(self, layer: int) -> int | None:
        """The chunk size of `layer`'s attention (None: not chunked)."""
        return self.attention_chunk if self.attention_chunk and self.chunked_layers[layer] else None

    def rotates(self, layer: int) -> bool:
        """Whether `layer` applies RoPE to q and k."""
        return not self.nope_layers[layer]

    def temperature(self, layer: int) -> tuple[float, float] | None:
        """`layer`'s query temperature (floor_scale, attn_scale), or None where its queries are not scaled."""
        return self.attention_temperature if self.nope_layers[layer] else None

    def is_global(self, layer: int) -> bool:
        """Whether `layer` is one of the global layers whose attention has its own geometry (`global_head_dim`)."""
        return bool(self.global_head_dim) and not self.sliding_layers[layer]

    def kv_heads(self, layer: int) -> int:
        """`layer`'s key/value heads."""
        return self.global_kv_heads or self.num_kv_heads if self.is_global(layer) else self.num_kv_heads

    def head_size(self, layer: int) -> int:
        """`layer`'s head dim."""
        return self.global_head_dim if self.is_global(layer) else self.head_dim

    def head_sizes(self) -> set[int]:
        """Every layer's head dim."""
        return {self.head_size(i) for i in range(self.num_layers)}

    @property
    def num_moe_layers(self) -> int:
        return sum(self.sparse_layers)


# those runtime/rope.py implements
ROPE_TYPES = {"default", "frequency_factors", "llama3", "longrope", "proportional", "su", "yarn"}


def rope_fields(raw: dict[str, Any], default_theta: float) -> dict[str, Any]:
    """`rope_theta`, the RoPE variant and its parameters, from transformers 5's `rope_parameters` dict or the older
    `rope_scaling` and flat keys. A variant Tandem does not implement is refused by name."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    nested = next((k for k, v in params.items() if isinstance(v, dict)), None)
    if nested is not None:  # transformers 5's per-layer-type form ({"full_attention": {...}, ...}): read flat, it
        # would silently rotate every layer with the default tables
        raise UnsupportedModelError(f"config.json's rope_parameters gives RoPE per kind of layer ({nested!r}, ...); "
                                    "Tandem runs one RoPE for every layer, so this model is not supported yet")
    # a scaling named in either place counts: a file with a plain rope_parameters beside an older rope_scaling
    # (edited by hand, or half converted) must not run without the scaling it asks for
    given = params.get("rope_type")
    older = scaling.get("rope_type") or scaling.get("type")
    rope_type = given if given not in (None, "default") else older or "default"
    if rope_type not in ROPE_TYPES:
        key = "rope_parameters" if rope_type == given else "rope_scaling"
        raise UnsupportedModelError(
            f"RoPE type {rope_type!r} (config.json's {key}) is not supported yet; Tandem runs "
            f"{', '.join(sorted(ROPE_TYPES))}"
        )
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    given = {k: v for k, v in (scaling | params).items() if k not in ("rope_type", "type", "rope_theta")}
    return {"rope_theta": theta, "rope_type": rope_type,
            "rope_params": tuple(sorted((k, _frozen(v)) for k, v in given.items()))}


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


ACTIVATIONS = {"silu", "swish"}  # the experts' and dense layers' activation: SwiGLU (silu is swish)


def check_activation(raw: dict[str, Any]) -> None:
    """An activation other than the one the kernels and the decoder compute is refused: it would run and give
    wrong tokens."""
    act = raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (Tandem computes SwiGLU with silu); "
                                    "this checkpoint would give wrong tokens")


def token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def sparse_layer_pattern(raw: dict[str, Any], num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Qwen-style dense/sparse interleaving: `decoder_sparse_step` and `mlp_only_layers`."""
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def dense_first_pattern(raw: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """DeepSeek/GLM-style layers: the first `first_k_dense_replace` dense, then a MoE block every `moe_layer_freq`
    layers."""
    first = int(raw.get("first_k_dense_replace", 0) or 0)
    freq = int(raw.get("moe_layer_freq", 1) or 1)
    return tuple(i >= first and i % freq == 0 for i in range(num_layers))


def sliding_layer_pattern(raw: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Which layers slide their attention window: transformers 5's `layer_types` when the config has them
    ("sliding_attention" / "full_attention"), else every layer."""
    types = raw.get("layer_types")
    if types is None:
        return (True,) * num_layers
    if not isinstance(types, list) or len(types) != num_layers:
        raise CheckpointError(f"config.json's layer_types has {len(types) if isinstance(types, list) else types!r} "
                              f"entries but the model has {num_layers} layers; fix config.json")
    return tuple(t == "sliding_attention" for t in types)


def require(raw: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if k not in raw]
    if missing:
        raise UnsupportedModelError(
            f"config.json of this {raw.get('model_type')} model lacks {', '.join(missing)}; "
            "is it a complete Hugging Face config?"
        )


def decoder_fields(raw: dict[str, Any], *, eps: float, theta: float, max_pos: int) -> dict[str, Any]:
    """The fields every family reads the same way (with its own defaults)."""
    require(raw, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    check_activation(raw)
    heads = raw["num_attention_heads"]
    return {
        "model_type": raw["model_type"],
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "num_layers": raw["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": raw.get("num_key_value_heads") or heads,
        "head_dim": raw.get("head_dim") or raw["hidden_size"] // heads,
        "rms_norm_eps": raw.get("rms_norm_eps", eps),
        **rope_fields(raw, theta),
        "max_position_embeddings": raw.get("max_position_embeddings", max_pos),
        "tie_word_embeddings": raw.get("tie_word_embeddings", False),
        "eos_token_ids": token_ids(raw.get("eos_token_id")),
        "bos_token_id": raw.get("bos_token_id"),
    }


# The whole-number fields of config.json, with the range each may take. The upper bounds are far above any real
# model; they exist because these numbers size lists and tensors before the weights can contradict them (a
# `num_local_experts` of 10**9 would otherwise fill the RAM before any check).
WHOLE: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 24), "hidden_size": (1, 1 << 17), "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024), "head_dim": (1, 4096),
    "max_position_embeddings": (1, 1 << 24), "intermediate_size": (0, 1 << 20), "moe_intermediate_size": (1, 1 << 20),
    "shared_expert_intermediate_size": (0, 1 << 20), "num_local_experts": (1, 4096), "num_experts": (0, 4096),
    "num_experts_per_tok": (1, 4096), "decoder_sparse_step": (1, 1024), "sliding_window": (0, 1 << 24),
    "bos_token_id": (0, 1 << 24),
    "original_max_position_embeddings": (1, 1 << 24),  # PhiMoE's LongRoPE pretraining length, at the top level
    # Llama 4's chunks, its interval of layers without RoPE and of MoE layers, its dense layers' width
    "attention_chunk_size": (1, 1 << 24), "no_rope_layer_interval": (1, 1024), "interleave_moe_layer_step": (1, 1024),
    "intermediate_size_mlp": (0, 1 << 20),
    # the hybrids' recurrent mixers (Qwen3-Next, Qwen3.5)
    "linear_num_key_heads": (1, 1024), "linear_num_value_heads": (1, 1024), "linear_key_head_dim": (1, 4096),
    "linear_value_head_dim": (1, 4096), "linear_conv_kernel_dim": (1, 64),
    "conv_L_cache": (2, 64), "num_dense_layers": (0, 1024),  # LFM2's
    "mamba_n_heads": (1, 4096), "mamba_n_groups": (1, 4096), "mamba_d_state": (1, 4096), "mamba_d_conv": (2, 64),
    "mamba_expand": (1, 64), "mamba_chunk_size": (1, 1 << 16),  # Granite 4.0-H's
}
PER_LAYER = ("moe_intermediate_size",)  # whole-number fields a config may list once per layer, all alike
MEANING = {"num_local_experts": "the number of experts", "num_experts": "the number of experts",
           "num_experts_per_tok": "top-k, the experts each token picks", "num_hidden_layers": "the number of layers",
           "num_attention_heads": "attention heads", "num_key_value_heads": "key/value heads"}
WHOLE.update({  # Gemma 4's global layers, its experts' top-k, the variants it refuses (per-layer inputs, KV sharing)
    "global_head_dim": (2, 4096), "num_global_key_value_heads": (1, 1024), "top_k_experts": (1, 4096),
    "hidden_size_per_layer_input": (0, 1 << 16), "num_kv_shared_layers": (0, 1024),
})
WHOLE.update({  # DeepSeek-V2/V3
    "n_routed_experts": (1, 4096), "n_shared_experts": (0, 64), "kv_lora_rank": (1, 1 << 16),
    "q_lora_rank": (1, 1 << 17), "qk_nope_head_dim": (0, 4096), "qk_rope_head_dim": (2, 4096),
    "v_head_dim": (1, 4096), "first_k_dense_replace": (0, 1024), "moe_layer_freq": (1, 1024), "n_group": (1, 4096),
    "topk_group": (1, 4096),
})
# Real numbers above zero, each below a bound far past real values (eps under 1; a clip must fit in bf16).
POSITIVE: dict[str, float] = {"rms_norm_eps": 1.0, "rope_theta": 1e15, "clip_qkv": 1e30}
POSITIVE.update({"routed_scaling_factor": 1e6})  # DeepSeek-V2/V3
POSITIVE.update({"swiglu_alpha": 1e6, "swiglu_limit": 1e6})  # gpt-oss
POSITIVE.update({"floor_scale": 1 << 24, "attn_scale": 1e6})  # Llama 4's query temperature
FLAGS = ("tie_word_embeddings", "norm_topk_prob", "qkv_bias", "attention_bias", "use_sliding_window")
FLAGS += ("rope_interleave", "mlp_bias")  # DeepSeek-V2/V3
POSITIVE.update({"partial_rotary_factor": 1.0 + 1e-9})  # glm4_moe: a share of each head, 1 = all of it
FLAGS += ("use_qk_norm",)  # glm4_moe
FLAGS += ("attention_k_eq_v", "enable_moe_block", "use_double_wide_mlp")  # gemma4_text


def _is_whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_real_below(v: Any, high: float) -> bool:
    """A number above zero and below `high` (an integer too large for a float is not)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < high


# RoPE's parameters, in transformers 5's `rope_parameters` or older configs' `rope_scaling` (both may be given; a key
# means the same in either): what each must be, checked in both dicts before any variant reads one. runtime/rope.py
# feeds them to math.log, divisions and torch.tensor, where a string, a list, a zero or a negative number is a
# traceback or silently wrong cos/sin tables. The upper bounds are far past published values (YaRN's factor 40 and
# betas 32/1, mscales near 1, LongRoPE's factors below 100) yet keep every product finite. Keys no variant reads are
# left alone; which keys a variant needs, and list lengths, are checked against the head in `rope_problems`.
RopeRule = tuple[Callable[[Any], bool], str]
ROPE_BOUND = 1e6


def _above_zero(high: float) -> RopeRule:
    return (lambda v: _is_real_below(v, high)), f"a number above zero and below {high:g}"


def _from_zero(high: float) -> RopeRule:
    # 0 is allowed where transformers reads it as unset (`beta_fast or 32`, `if mscale and mscale_all_dim`)
    return (lambda v: _is_number(v) and 0 <= v < high), f"a number at least 0 (0: unset) and below {high:g}"


def _factors(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(_is_real_below(f, ROPE_BOUND) for f in v)


ROPE_RULES: dict[str, RopeRule] = {
    "rope_theta": _above_zero(POSITIVE["rope_theta"]),
    "partial_rotary_factor": ((lambda v: _is_real_below(v, POSITIVE["partial_rotary_factor"])),
                              "a number above 0 and at most 1 (the share of each head rotated)"),
    "factor": _above_zero(ROPE_BOUND),  # YaRN/LongRoPE: how many times the pretraining context is stretched
    "attention_factor": _above_zero(ROPE_BOUND),  # the scale of cos and sin
    "short_mscale": _above_zero(ROPE_BOUND), "long_mscale": _above_zero(ROPE_BOUND),  # PhiMoE's cos/sin scales
    "beta_fast": _from_zero(ROPE_BOUND), "beta_slow": _from_zero(ROPE_BOUND),  # YaRN's ramp, in rotations
    "mscale": _from_zero(ROPE_BOUND), "mscale_all_dim": _from_zero(ROPE_BOUND),  # a negative one can divide by 0
    "original_max_position_embeddings": ((lambda v: _is_whole(v) and 1 <= v <= 1 << 24),
                                         f"a whole number from 1 to {1 << 24} (the pretraining context)"),
    "truncate": ((lambda v: isinstance(v, bool)), "true or false"),
    "low_freq_factor": _above_zero(ROPE_BOUND), "high_freq_factor": _above_zero(ROPE_BOUND),  # Llama 3's ramp
    # each rotated pair's divisor of its frequency, as llama.cpp's files store a scaling (their rope_freqs tensor)
    "factors": (_factors, f"a list of numbers above zero and below {ROPE_BOUND:g}, one per rotated pair of dims"),
    "short_factor": (_factors, f"a list of numbers above zero and below {ROPE_BOUND:g}, one per rotated pair of dims"),
    "long_factor": (_factors, f"a list of numbers above zero and below {ROPE_BOUND:g}, one per rotated pair of dims"),
}


def _shown(value: Any) -> str:
    """A value for a message, cut short (a LongRoPE factor list has 64 entries)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _non_finite(value: Any, path: str) -> str | None:
    """The first NaN or infinity anywhere in a JSON value, by its key path."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, v in items:
        found = _non_finite(v, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def clean_raw(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """config.json's values checked for type and range before any family reads them; keys set to null dropped
    (a family's default applies, as when the key is absent). Raises CheckpointError naming the key."""
    def bad(key: str, why: str) -> CheckpointError:
        meaning = f" ({MEANING[key]})" if key in MEANING else ""
        return CheckpointError(f"{where}: {key!r}{meaning} is {raw[key]!r}, {why}; fix config.json or re-download it")

    found = _non_finite(raw, "")
    if found:
        raise CheckpointError(f"{where}: {found!r} is not a finite number; fix config.json or re-download it")
    out = {k: v for k, v in raw.items() if v is not None}
    for key in PER_LAYER:  # one value for every layer, listed per layer (HunYuan's): read as that one value
        if isinstance(out.get(key), list) and out[key]:
            if any(v != out[key][0] for v in out[key]):
                raise bad(key, "a value per layer that differs between layers, which is not supported")
            out[key] = out[key][0]
    for key, (lo, hi) in WHOLE.items():
        if key in out and not (_is_whole(out[key]) and lo <= out[key] <= hi):
            raise bad(key, f"but it must be a whole number from {lo} to {hi}")
    for key, high in POSITIVE.items():
        if key in out and not _is_real_below(out[key], high):
            raise bad(key, f"but it must be a number above zero and below {high:g}")
    for key in FLAGS:
        if key in out and not isinstance(out[key], bool):
            raise bad(key, "but it must be true or false")
    eos = out.get("eos_token_id")
    if eos is not None and not (_is_whole(eos) and eos >= 0 or isinstance(eos, list) and all(
            _is_whole(i) and i >= 0 for i in eos)):
        raise bad("eos_token_id", "but it must be a token id or a list of them")
    dense = out.get("mlp_only_layers")
    layers = out.get("num_hidden_layers", 0)
    if dense is not None and not (isinstance(dense, list) and all(_is_whole(i) and 0 <= i < layers for i in dense)):
        raise bad("mlp_only_layers", f"but it must be a list of layer numbers from 0 to {layers - 1}")
    for key in ("rope_parameters", "rope_scaling"):
        if key not in out:
            continue
        if not isinstance(out[key], dict):
            raise bad(key, "but it must be an object")
        out[key] = {k: v for k, v in out[key].items() if v is not None}  # null: absent, as at the top level
        for name, (ok, what) in ROPE_RULES.items():
            if name in out[key] and not ok(out[key][name]):
                raise CheckpointError(f"{where}: {key}.{name} is {_shown(out[key][name])}, but it must be {what}; "
                                      "fix config.json or re-download it")
    for key in ("rope_parameters", "rope_scaling"):
        kind = out.get(key, {}).get("rope_type", out.get(key, {}).get("type"))
        if kind is not None and not isinstance(kind, str):
            raise CheckpointError(f"{where}: {key}'s type is {kind!r}, but it must be a name such as \"default\"")
    return out


def rope_problems(cfg: ModelConfig) -> list[str]:
    """The RoPE variant's parameters (each already of the right type and range: `ROPE_RULES`) against the variant
    and the head: the keys it needs (as transformers requires them), one LongRoPE factor per rotated pair of dims,
    an even number of rotated dims. Unchecked, a mismatch is a shape error in the first forward pass, or tables
    that silently rotate wrong."""
    p, kind = dict(cfg.rope_params), cfg.rope_type
    dims = cfg.rotary_dim or cfg.head_dim  # runtime/rope.py's rotary_dims
    where = "config.json's rope_parameters or rope_scaling"
    problems = []
    if dims % 2:
        problems.append(f"each head rotates {dims} dims (head_dim, or the rotated part of it), but RoPE turns pairs "
                        "of dims: it must be an even number")
    if kind == "yarn" and "factor" not in p:
        problems.append(f"YaRN needs its factor (the context stretch) in {where}")
    if kind in ("longrope", "su"):
        for key in ("short_factor", "long_factor"):
            if key not in p:
                problems.append(f"LongRoPE needs {key} in {where}")
            elif len(p[key]) != dims // 2:
                problems.append(f"LongRoPE's {key} ({where}) lists {len(p[key])} numbers, but the {dims} rotated "
                                f"dims of a head need {dims // 2}, one per pair")
        original = p.get("original_max_position_embeddings", cfg.max_position_embeddings)
        if original < 2:  # its cos/sin scale divides by the log of this length
            problems.append(f"LongRoPE's original_max_position_embeddings is {original}, but it must be at least 2")
    if kind == "frequency_factors" and len(p.get("factors", ())) != dims // 2:
        problems.append(f"the RoPE frequency factors ({where}) list {len(p.get('factors', ()))} numbers, but the "
                        f"{dims} rotated dims of a head need {dims // 2}, one per pair")
    if kind == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if k not in p]
        if missing:
            problems.append(f"Llama 3's RoPE needs {', '.join(missing)} in {where}")
        elif p["high_freq_factor"] <= p["low_freq_factor"]:
            problems.append(f"Llama 3's RoPE has high_freq_factor ({p['high_freq_factor']}) at or below "
                            f"low_freq_factor ({p['low_freq_factor']}) in {where}: its ramp would divide by zero or "
                            "run backwards")
    if kind == "yarn" and (p.get("beta_fast") or 32) < (p.get("beta_slow") or 1):  # (0: the default, as transformers)
        problems.append(f"YaRN's beta_fast ({p.get('beta_fast')}) is below its beta_slow ({p.get('beta_slow')}) in "
                        f"{where}: the ramp between them would run backwards")
    if kind != "default" and p.get("mscale_all_dim") and "factor" not in p:  # runtime/mla.py scales by mscale(factor)
        problems.append(f"mscale_all_dim is given without the factor it scales ({where})")
    return problems


def token_problems(cfg: ModelConfig) -> list[str]:
    """A special token id outside the vocabulary [0, vocab_size) is a damaged config (or a vocab_size edited without
    it): an end-of-sequence id no logit can reach never stops generation. Absent or null: no such token."""
    named = [("eos_token_id", i) for i in cfg.eos_token_ids]
    named += [("bos_token_id", cfg.bos_token_id)] if cfg.bos_token_id is not None else []
    return [f"{field} {i} is not a token of the vocabulary (vocab_size {cfg.vocab_size}: ids 0 to "
            f"{cfg.vocab_size - 1})" for field, i in named if not 0 <= i < cfg.vocab_size]


def check_config(cfg: ModelConfig, where: str) -> None:
    """What no single field shows: the fields against each other."""
    problems = rope_problems(cfg) + token_problems(cfg)
    if cfg.num_experts and cfg.top_k > cfg.num_experts:
        problems.append(f"each token picks {cfg.top_k} experts (top-k) but a layer has only {cfg.num_experts}")
    for kv in {cfg.num_kv_heads, cfg.global_kv_heads or cfg.num_kv_heads}:
        if cfg.num_heads % kv:
            problems.append(f"{cfg.num_heads} attention heads do not share {kv} key/value heads evenly")
    if cfg.num_experts and not cfg.moe_intermediate_size:
        problems.append("the experts have no width (moe_intermediate_size)")
    if any(not s for s in cfg.sparse_layers) and not cfg.dense_intermediate_size:
        problems.append("layers without experts need intermediate_size")
    if problems:
        raise CheckpointError(f"{where} does not describe a model that can run: {'; '.join(problems)}; fix config.json")
