"""Qwen3-MoE: per-head q/k RMSNorm, explicit head_dim, no shared expert, optional dense layers."""

from __future__ import annotations

from typing import Any

from tandem.runtime.config import ModelConfig, decoder_fields, require, sparse_layer_pattern
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.gguf_meta import Meta, common_config, read_flag, read_int


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "num_experts_per_tok", "moe_intermediate_size")
    experts = raw.get("num_experts", raw.get("num_local_experts"))  # transformers 5 writes the latter
    if experts is None:
        require(raw, "num_experts")
    layers = raw["num_hidden_layers"]
    sparse = sparse_layer_pattern(raw, layers, experts)
    bias = raw.get("attention_bias", False)
    return ModelConfig(
        **decoder_fields(raw, eps=1e-6, theta=10000.0, max_pos=32768),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        num_experts=experts,
        top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob", True),
        dense_intermediate_size=raw.get("intermediate_size", 0) if not all(sparse) else 0,
        sparse_layers=sparse,
        sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window") else None,
    )


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    a = "qwen3moe"
    return common_config(meta, a, vocab) | {
        "model_type": "qwen3_moe", "num_experts": read_int(meta, f"{a}.expert_count", bound="num_local_experts"),
        "moe_intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length"),
        "intermediate_size": read_int(meta, f"{a}.feed_forward_length", 0) or 1,
        "norm_topk_prob": read_flag(meta, f"{a}.expert_weights_norm", True), "decoder_sparse_step": 1,
        "mlp_only_layers": []}


SPEC = FamilySpec(
    "qwen3_moe", "Qwen3-MoE", parse,
    tiny={"intermediate_size": 128, "moe_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
          "head_dim": 32, "norm_topk_prob": True},
    shapes=(BenchShape("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "rope_theta": 1e6,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    }, aliases=("qwen3",)),),
    gguf=GGUFArch("qwen3moe", gguf_config),
)
