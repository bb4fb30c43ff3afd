"""Gemma 4 (`gemma4_text` with its MoE block: gemma-4-26B-A4B, its text model): sliding and global layers of
different shapes, a dense MLP beside the experts in every layer, Gemma's norms around each half of a layer.

What differs from the plain decoder, each as transformers' `modeling_gemma4.py` computes it:
- the embeddings times sqrt(hidden_size); the logits soft-capped (`final_logit_softcapping`); each layer's whole
  output times its `layer_scalar`;
- attention: q and k RMSNormed per head (q_norm, k_norm), the values too without a weight, scores unscaled (1.0);
  the `sliding_attention` layers see the last `sliding_window` positions with their RoPE (`rope_parameters`'
  sliding entry), the `full_attention` ("global") layers see everything with their own head size
  (`global_head_dim`, or `per_layer_config`), key/value heads (`num_global_key_value_heads` where
  `attention_k_eq_v`) and RoPE (the full entry: "proportional", part of each half turning); with
  `attention_k_eq_v` a global layer has no v_proj, its values k_proj's output;
- attention's output RMSNormed (post_attention_layernorm) before the residual; the feed-forward is
  runtime/parallel.py's: GeGLU (tanh GELU) MLP and experts side by side, each with its norms.

Published checkpoints hold the whole model (`gemma4`, with vision and audio towers): Tandem opens its text model there
(`text_config`, tensors under `model.language_model.`), or as its own folder (`gemma4_text`), or as llama.cpp's
`gemma4` GGUF file. Per-layer input embeddings (the E2B/E4B models), layers sharing another's keys and values,
bidirectional attention and the dense models (no MoE block) are refused by name."""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import CheckpointError, UnsupportedModelError
from tandem.runtime.config import ROPE_RULES, WHOLE, ModelConfig, decoder_fields, require, sliding_layer_pattern
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.gguf_meta import Meta, common_config, per_layer, read_float, read_int

# transformers' Gemma4TextConfig defaults, for the keys a config.json may leave out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "sliding_window": 512,
    "hidden_size_per_layer_input": 256, "attention_k_eq_v": False, "num_kv_shared_layers": 0,
    "enable_moe_block": False, "eos_token_id": 1, "bos_token_id": 2, "global_head_dim": 512,
}
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")  # transformers' names of GELU with tanh's approximation
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


def refusals(raw: dict[str, Any]) -> list[str]:
    """What of this Gemma 4 Tandem does not run."""
    out = []
    if not raw["enable_moe_block"]:
        out.append("it is a dense model (enable_moe_block false): Tandem runs Gemma 4's MoE models")
    if raw["hidden_size_per_layer_input"]:
        out.append("it has per-layer input embeddings (hidden_size_per_layer_input, the E2B/E4B models)")
    if raw["num_kv_shared_layers"]:
        out.append("its last layers share earlier layers' keys and values (num_kv_shared_layers)")
    if raw.get("use_bidirectional_attention") == "all":
        out.append("its attention is bidirectional (use_bidirectional_attention \"all\")")
    if raw["hidden_activation"] not in GELU_TANH:
        out.append(f"its activation is {raw['hidden_activation']!r}, not GELU with tanh's approximation")
    return out


def rope_entry(raw: dict[str, Any], kind: str) -> dict[str, Any]:
    """`rope_parameters`' entry for one kind of layer (transformers' defaults where the config has none), checked as
    runtime/config.py checks a flat one."""
    given = (raw.get("rope_parameters") or ROPE).get(kind) or ROPE[kind]
    if not isinstance(given, dict):
        raise CheckpointError(f"config.json's rope_parameters.{kind} must be an object, not {given!r}")
    if given.get("rope_type", "default") not in ("default", "proportional"):
        raise UnsupportedModelError(f"config.json's rope_parameters.{kind} is RoPE of type "
                                    f"{given.get('rope_type')!r}; Tandem runs Gemma 4's (default, proportional)")
    for name, (ok, what) in ROPE_RULES.items():
        if name in given and not ok(given[name]):
            raise CheckpointError(f"config.json's rope_parameters.{kind}.{name} is {given[name]!r}, but it must be "
                                  f"{what}")
    return given


def global_geometry(raw: dict[str, Any], sliding: tuple[bool, ...]) -> tuple[int, int]:
    """The global layers' (head dim, key/value heads; 0: the sliding layers'), from `per_layer_config` as
    transformers saves it, or from `global_head_dim` and `num_global_key_value_heads` as the published configs
    give them."""
    per_layer = raw.get("per_layer_config")
    if per_layer is None:
        kv = raw.get("num_global_key_value_heads") if raw["attention_k_eq_v"] else None
        return raw["global_head_dim"], kv or 0
    if not isinstance(per_layer, dict):
        raise CheckpointError(f"config.json's per_layer_config must be an object, not {per_layer!r}")
    try:
        overrides = {int(k): v for k, v in per_layer.items()}
    except ValueError:
        raise CheckpointError("config.json's per_layer_config must be keyed by layer numbers") from None
    allowed = {"head_dim": WHOLE["head_dim"], "num_key_value_heads": WHOLE["num_key_value_heads"]}
    if any(not isinstance(v, dict) or set(v) - set(allowed) for v in overrides.values()):
        raise UnsupportedModelError(f"config.json's per_layer_config changes more than {', '.join(sorted(allowed))} "
                                    "per layer; Tandem runs Gemma 4's layers as published")
    for layer, given in overrides.items():
        for key, value in given.items():
            lo, hi = allowed[key]
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise CheckpointError(f"config.json's per_layer_config gives layer {layer} a {key} of {value!r}, but "
                                      f"it must be a whole number from {lo} to {hi}; fix config.json")
    kinds = {tuple(sorted(overrides.get(i, {}).items())) for i, s in enumerate(sliding) if not s}
    if len(kinds) > 1 or any(overrides.get(i) for i, s in enumerate(sliding) if s):
        raise UnsupportedModelError("config.json's per_layer_config gives layers of one kind different shapes; "
                                    "Tandem runs every global layer alike and every sliding layer alike")
    one = dict(kinds.pop()) if kinds else {}
    return one.get("head_dim", raw["head_dim"]), one.get("num_key_value_heads", 0)


def parse(raw: dict[str, Any]) -> ModelConfig:
    raw = DEFAULTS | raw
    problems = refusals(raw)
    if problems:
        raise UnsupportedModelError(f"this Gemma 4 model is not supported yet: {'; '.join(problems)}")
    require(raw, "num_experts", "top_k_experts", "moe_intermediate_size")
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                        for i in range(layers)]
    types = [*types[:-1], "full_attention"]  # (transformers forces the last layer global)
    sliding = sliding_layer_pattern(raw | {"layer_types": types}, layers)
    local, full = rope_entry(raw, "sliding_attention"), rope_entry(raw, "full_attention")
    flat = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")} | {"rope_parameters": local}
    head_dim, kv_heads = global_geometry(raw, sliding)
    if head_dim % 2:
        raise CheckpointError(f"config.json gives the global layers a head size of {head_dim}, but RoPE turns pairs "
                              "of dims: it must be an even number; fix config.json")
    own = decoder_fields(flat | {"rope_parameters": full}, eps=1e-6, theta=1_000_000.0, max_pos=131072)
    bias = raw.get("attention_bias", False)
    hidden = raw["hidden_size"]
    return ModelConfig(
        **decoder_fields(flat, eps=1e-6, theta=10_000.0, max_pos=131072),
        num_experts=raw["num_experts"],
        top_k=raw["top_k_experts"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        dense_intermediate_size=raw["intermediate_size"],
        norm_topk_prob=True,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        attention_multiplier=1.0,
        embedding_multiplier=hidden ** 0.5,
        sliding_window=raw["sliding_window"],
        sliding_layers=sliding,
        activation="gelu_tanh",
        sandwich_norms=True,
        parallel_dense=True,
        global_head_dim=head_dim,
        global_kv_heads=kv_heads,
        global_rope=(own["rope_theta"], own["rope_type"], own["rope_params"]),
        values_from_keys=bool(raw["attention_k_eq_v"]),
        value_norm=True,
        logit_softcap=raw.get("final_logit_softcapping"),
        layer_scalars=True,
    )


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    """As llama.cpp writes its `gemma4` files: key/value heads per layer (the global layers' differ), which layers
    slide (`sliding_window_pattern`), both kinds' head sizes and RoPE bases; the global layers' values are their keys
    where they have no attn_v. Their RoPE's turning part is in rope_freqs.weight (`gguf_frequencies`)."""
    a = "gemma4"
    layers = read_int(meta, f"{a}.block_count", bound="num_hidden_layers")
    kv = per_layer(meta, f"{a}.attention.head_count_kv", layers, int, "num_key_value_heads")
    out = common_config(meta | {f"{a}.attention.head_count_kv": kv[0]}, a, vocab)  # (the kinds' heads: below)
    problems = []
    if read_int(meta, f"{a}.attention.shared_kv_layers", 0):
        problems.append("its last layers share earlier layers' keys and values (shared_kv_layers)")
    if read_int(meta, f"{a}.embedding_length_per_layer_input", 0):
        problems.append("it has per-layer input embeddings (the E2B/E4B models)")
    if not read_int(meta, f"{a}.expert_count", 0):
        problems.append("it is a dense model: Tandem runs Gemma 4's MoE models")
    if problems:
        raise UnsupportedModelError(f"this Gemma 4 file is not supported yet: {'; '.join(problems)}")
    sliding = per_layer(meta, f"{a}.attention.sliding_window_pattern", layers, bool)
    head_dim, global_dim = (read_int(meta, f"{a}.attention.key_length{k}", bound="head_dim") for k in ("_swa", ""))
    if (read_int(meta, f"{a}.attention.value_length_swa", head_dim), read_int(meta, f"{a}.attention.value_length",
                                                                             global_dim)) != (head_dim, global_dim):
        raise UnsupportedModelError("this Gemma 4 file's values are not its keys' size; Tandem runs Gemma 4 as "
                                    "published")
    if read_int(meta, f"{a}.rope.dimension_count_swa", head_dim) != head_dim:
        raise UnsupportedModelError("this Gemma 4 file rotates part of its sliding layers' heads; Tandem runs Gemma 4 "
                                    "as published")
    local_kv = {kv[i] for i in range(layers) if sliding[i]}
    global_kv = {kv[i] for i in range(layers) if not sliding[i]}
    values = {f"blk.{i}.attn_v.weight" in types for i in range(layers) if not sliding[i]}
    if len(local_kv) > 1 or len(global_kv) > 1 or len(values) > 1:
        raise CheckpointError("this Gemma 4 file gives layers of one kind different shapes; the file is "
                              "inconsistent: re-download it")
    full = read_float(meta, f"{a}.rope.freq_base", 1_000_000.0)
    return out | {
        "model_type": "gemma4_text", "num_key_value_heads": next(iter(local_kv or global_kv)),
        "head_dim": head_dim, "global_head_dim": global_dim, "attention_k_eq_v": values == {False},
        "num_global_key_value_heads": next(iter(global_kv or local_kv)),
        "intermediate_size": read_int(meta, f"{a}.feed_forward_length", bound="intermediate_size"),
        "moe_intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length", bound="moe_intermediate_size"),
        "num_experts": read_int(meta, f"{a}.expert_count", bound="num_experts"),
        "top_k_experts": out.pop("num_experts_per_tok"), "enable_moe_block": True, "hidden_size_per_layer_input": 0,
        "sliding_window": read_int(meta, f"{a}.attention.sliding_window", bound="sliding_window"),
        "final_logit_softcapping": read_float(meta, f"{a}.final_logit_softcapping") if
        f"{a}.final_logit_softcapping" in meta else None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "hidden_activation": "gelu_pytorch_tanh", "hidden_act": None,
        "rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                  "rope_theta": read_float(meta, f"{a}.rope.freq_base_swa", 10_000.0)},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 1.0,
                                               "rope_theta": full}},
    }


def gguf_frequencies(raw: dict[str, Any], factors: list[float]) -> dict[str, Any]:
    """rope_freqs.weight as llama.cpp's converter writes it for Gemma 4's global layers: 1 for each pair that turns,
    then 1e30 (no turn) for the rest: proportional RoPE turning that share of each half."""
    turning = next((j for j, f in enumerate(factors) if f != 1.0), len(factors))
    if any(f < 1e20 for f in factors[turning:]) or len(factors) != raw["global_head_dim"] // 2:
        raise UnsupportedModelError("this Gemma 4 file's rope_freqs.weight scales its global layers' RoPE in a way "
                                    "Tandem does not run (it reads the converter's: pairs that turn, then pairs "
                                    "that do not)")
    half = len(factors)
    share = turning / half
    if int(share * 2 * half // 2) != turning:  # (transformers floors share * head_dim / 2: a hair above, then)
        share = (turning + 0.25) / half
    rope = dict(raw["rope_parameters"])
    rope["full_attention"] = rope["full_attention"] | {"partial_rotary_factor": share}
    return raw | {"rope_parameters": rope}


# the tensors of a layer llama.cpp names its own way for Gemma 4 (its converter's tensor map)
GGUF_TENSORS = {
    "post_attention_layernorm.weight": "post_attention_norm.weight", "pre_feedforward_layernorm.weight":
    "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight", "layer_scalar": "layer_output_scale.weight",
    "router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
}

SPEC = FamilySpec(
    "gemma4_text", "Gemma 4", parse,
    tiny={"intermediate_size": 96, "moe_intermediate_size": 48, "num_experts": 8, "top_k_experts": 2,
          "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
          "enable_moe_block": True, "hidden_size_per_layer_input": 0, "sliding_window": 4,
          "final_logit_softcapping": 30.0, "layer_types": ["sliding_attention", "full_attention"],
          "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "pad_token_id": 0,
          "rope_parameters": ROPE},
    shapes=(
        BenchShape("gemma4-26b-a4b", "google/gemma-4-26B-A4B-it", {
            "vocab_size": 262144, "hidden_size": 2816, "intermediate_size": 2112, "moe_intermediate_size": 704,
            "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
            "global_head_dim": 512, "num_global_key_value_heads": 2, "attention_k_eq_v": True,
            "num_experts": 128, "top_k_experts": 8, "enable_moe_block": True, "hidden_size_per_layer_input": 0,
            "sliding_window": 1024, "final_logit_softcapping": 30.0, "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(30)],
            "rope_parameters": ROPE, "bos_token_id": 2, "eos_token_id": [1, 106],
        }, aliases=("gemma4",)),
    ),
    moe_prefix="", router="router.proj", dense_mlp="mlp",
    stacked_experts=("experts.gate_up_proj", "experts.down_proj"),
    shared_expert_gate=None,
    gguf=GGUFArch("gemma4", gguf_config, frequencies=gguf_frequencies, tensors=GGUF_TENSORS),
    inside=("gemma4", "text_config", "model.language_model."),
)
