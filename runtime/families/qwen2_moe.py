"""Qwen1.5/Qwen2-MoE: q/k/v biases, a shared expert behind a sigmoid gate, optional dense layers."""

from __future__ import annotations

from typing import Any

from tandem.runtime.config import ModelConfig, decoder_fields, require, sliding_layer_pattern, sparse_layer_pattern
from tandem.runtime.families import FamilySpec, GGUFArch
from tandem.runtime.gguf_meta import Meta, common_config, read_flag, read_int


def sliding_layers(raw: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """`layer_types` when given; else transformers' rule for older configs: every other layer (the first, the
    third, …) below `max_window_layers`."""
    if "layer_types" in raw:
        return sliding_layer_pattern(raw, layers)
    below = raw.get("max_window_layers", 28)
    return tuple(i % 2 == 0 and i < below for i in range(layers))


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    layers = raw["num_hidden_layers"]
    sparse = sparse_layer_pattern(raw, layers, raw["num_experts"])
    return ModelConfig(
        **decoder_fields(raw, eps=1e-6, theta=10000.0, max_pos=32768),
        qkv_bias=raw.get("qkv_bias", True),  # always on before transformers 5 made it a key
        num_experts=raw["num_experts"],
        top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob", False),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0) or 0,
        sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window") else None,
        sliding_layers=sliding_layers(raw, layers),
        dense_intermediate_size=raw.get("intermediate_size", 0) if not all(sparse) else 0,
        sparse_layers=sparse,
    )


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    a = "qwen2moe"
    return common_config(meta, a, vocab) | {
        "model_type": "qwen2_moe", "num_experts": read_int(meta, f"{a}.expert_count", bound="num_local_experts"),
        "moe_intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length"),
        "shared_expert_intermediate_size": read_int(meta, f"{a}.expert_shared_feed_forward_length", 0),
        "intermediate_size": read_int(meta, f"{a}.feed_forward_length", 0) or 1,
        "norm_topk_prob": read_flag(meta, f"{a}.expert_weights_norm", False), "decoder_sparse_step": 1,
        "mlp_only_layers": []}


SPEC = FamilySpec(
    "qwen2_moe", "Qwen2-MoE", parse,
    tiny={"intermediate_size": 128, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 96,
          "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False},
    gguf=GGUFArch("qwen2moe", gguf_config),
)
