"""Qwen3.5 / Qwen3.6 MoE (Qwen3.5-35B-A3B and larger), their text model: Qwen3-Next's hybrid (runtime/families/
qwen3_next.py: Gated DeltaNet on three layers of four, gated attention, zero-centred norms) with every layer's
feed-forward routed experts and a gated shared expert. As published the folder holds the whole model (`qwen3_5_moe`,
with a vision tower): Tandem opens its text model there (`text_config`, tensors under `model.language_model.`).
Differences from Qwen3-Next in the files: Gated DeltaNet's projections as four tensors (in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a); the whole-model folders hold a layer's experts as two tensors (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]: runtime/checkpoint.py `stored_layout`). Its multimodal RoPE is plain
RoPE for text, whose three position ids are one."""

from __future__ import annotations

from functools import partial
from typing import Any

from tandem.runtime.config import ModelConfig, require
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.families.qwen3_next import TINY_LINEAR, gguf_sources, hybrid_fields, hybrid_gguf_config
from tandem.runtime.gguf_meta import Meta


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    return ModelConfig(
        **hybrid_fields(raw),
        num_experts=raw["num_experts"],
        top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=True,
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0) or 0,
    )


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    """llama.cpp's `qwen35moe` files: as Qwen3-Next's, their value heads reordered so that value head j reads key
    head j % key heads (the converter's _LinearAttentionVReorderBase), where there are more value heads."""
    raw = hybrid_gguf_config(meta, "qwen35moe", vocab)
    tiled = raw["linear_num_value_heads"] != raw["linear_num_key_heads"]
    return raw | {"model_type": "qwen3_5_moe_text", "linear_value_heads_tiled": tiled}


SPEC = FamilySpec(
    "qwen3_5_moe_text", "Qwen3.5-MoE", parse,
    tiny={"moe_intermediate_size": 48, "shared_expert_intermediate_size": 64, "num_experts": 8,
          "num_experts_per_tok": 2, **TINY_LINEAR},
    shapes=(BenchShape("qwen3.5-35b-a3b", "Qwen/Qwen3.5-35B-A3B", {
        "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 248044},
        aliases=("qwen3.5-moe", "qwen3.6-35b-a3b")),),
    inside=("qwen3_5_moe", "text_config", "model.language_model."),
    gguf=GGUFArch("qwen35moe", gguf_config, sources=partial(gguf_sources, split=True)),
)
