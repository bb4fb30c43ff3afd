"""dots.llm1 (`dots1`: rednote-hilab's dots.llm1.base and .inst): Qwen3's attention over DeepSeek-V3's experts.

What differs from the plain decoder, each as transformers' `modular_dots1.py` computes it:
- per-head q/k RMSNorm (Qwen3), optional q/k/v/o biases (`attention_bias`), sliding-window layers where
  `layer_types` says "sliding_attention" (by default the layers from `max_window_layers` on, when `sliding_window`
  is set; the published model has none);
- sigmoid router scores; `e_score_correction_bias` added for choosing only; group-limited choice (`n_group`,
  `topk_group`, each group scored by its two best experts); `norm_topk_prob`; `routed_scaling_factor`;
- `n_shared_experts` shared experts as one ungated SwiGLU of n_shared_experts * moe_intermediate_size;
- the first `first_k_dense_replace` layers dense (width `intermediate_size`).
"""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.config import ModelConfig, decoder_fields, dense_first_pattern, require, sliding_layer_pattern
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.families.deepseek_v2 import check_top2_groups, sigmoid_routing
from tandem.runtime.gguf_meta import Meta, common_config, read_flag, read_float, read_int


def sliding_types(raw: dict[str, Any], layers: int) -> list[str] | None:
    """`layer_types` as given, else Dots1Config's default: the layers from `max_window_layers` on slide where
    `sliding_window` is set (None: every layer sees the whole context)."""
    if "layer_types" in raw:
        return raw["layer_types"]
    if raw.get("sliding_window") is None:
        return None
    below = int(raw.get("max_window_layers", 62))
    return ["sliding_attention" if i >= below else "full_attention" for i in range(layers)]


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "num_experts_per_tok", "moe_intermediate_size")
    experts = raw.get("n_routed_experts", raw.get("num_local_experts"))  # the attribute_map's two names
    if experts is None:
        require(raw, "n_routed_experts")
    if raw.get("moe_layer_freq", 1) != 1:
        raise UnsupportedModelError(f"dots1 with moe_layer_freq {raw['moe_layer_freq']} is not supported: transformers "
                                    "builds a MoE block in every layer after first_k_dense_replace whatever it says")
    layers = raw["num_hidden_layers"]
    sparse = dense_first_pattern({"first_k_dense_replace": raw.get("first_k_dense_replace", 0)}, layers)
    types = sliding_types(raw, layers)
    slides = types is not None and "sliding_attention" in types
    bias = raw.get("attention_bias", False)
    width = raw["moe_intermediate_size"]
    cfg = ModelConfig(
        **decoder_fields(raw, eps=1e-6, theta=10000.0, max_pos=2048),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        sliding_window=raw.get("sliding_window") if slides else None,
        sliding_layers=sliding_layer_pattern({"layer_types": types}, layers) if slides else (),
        num_experts=experts,
        top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=width,
        norm_topk_prob=raw.get("norm_topk_prob", False),
        shared_expert_intermediate_size=int(raw.get("n_shared_experts") or 0) * width,
        dense_intermediate_size=raw.get("intermediate_size", 10944) if not all(sparse) else 0,
        sparse_layers=sparse,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        **sigmoid_routing(raw),
    )
    return check_top2_groups(raw, cfg)


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    """As llama.cpp's converter writes dots.llm1 (its Dots1Model, on Qwen2MoeModel's keys): the expert counts and
    widths, the leading dense layers, the shared experts, the routing scale and normalisation; sigmoid routing with
    a correction bias is the architecture's own (no key), and groups are not written (the published model has one)."""
    a = "dots1"
    return common_config(meta, a, vocab) | {
        "model_type": "dots1", "n_routed_experts": read_int(meta, f"{a}.expert_count", bound="num_local_experts"),
        "moe_intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length"),
        "intermediate_size": read_int(meta, f"{a}.feed_forward_length"),
        "n_shared_experts": read_int(meta, f"{a}.expert_shared_count", 0),
        "first_k_dense_replace": read_int(meta, f"{a}.leading_dense_block_count", 0),
        "routed_scaling_factor": read_float(meta, f"{a}.expert_weights_scale", 1.0),
        "norm_topk_prob": read_flag(meta, f"{a}.expert_weights_norm", False),
        "n_group": read_int(meta, f"{a}.expert_group_count", 1),
        "topk_group": read_int(meta, f"{a}.expert_group_used_count", 1)}


SPEC = FamilySpec(
    "dots1", "dots.llm1", parse,
    # Like dots.llm1: a dense first layer, two shared experts, normalised and scaled sigmoid routing.
    tiny={"intermediate_size": 128, "moe_intermediate_size": 48, "n_routed_experts": 8, "num_experts_per_tok": 2,
          "n_shared_experts": 2, "head_dim": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
          "norm_topk_prob": True, "routed_scaling_factor": 2.5, "sliding_window": None},
    shapes=(BenchShape("dots-llm1", "rednote-hilab/dots.llm1.inst", {
        "vocab_size": 152064, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
        "n_routed_experts": 128, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000000.0, "sliding_window": None,
        "max_window_layers": 62, "attention_bias": False, "tie_word_embeddings": False, "eos_token_id": 151649,
    }, aliases=("dots",)),),
    moe_prefix="mlp", router="gate", shared_expert="shared_experts", shared_expert_gate=None,
    gguf=GGUFArch("dots1", gguf_config),
)
