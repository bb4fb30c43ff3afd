"""OLMoE: q/k RMSNorm over the whole projection (before heads are split), optional q/k/v clipping."""

from __future__ import annotations

from typing import Any

from tandem.runtime.config import ModelConfig, decoder_fields, require
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.gguf_meta import MISSING, Meta, common_config, read_flag, read_int


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "intermediate_size", "num_experts", "num_experts_per_tok")
    bias = raw.get("attention_bias", False)
    return ModelConfig(
        **decoder_fields(raw, eps=1e-5, theta=10000.0, max_pos=4096),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="full",
        clip_qkv=raw.get("clip_qkv"),
        num_experts=raw["num_experts"],
        top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob", False),
    )


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    a = "olmoe"
    return common_config(meta, a, vocab) | {
        "model_type": "olmoe", "num_experts": read_int(meta, f"{a}.expert_count", bound="num_local_experts"),
        "intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length",
                                  meta.get(f"{a}.feed_forward_length", MISSING)),
        "norm_topk_prob": read_flag(meta, f"{a}.expert_weights_norm", False)}


SPEC = FamilySpec(
    "olmoe", "OLMoE", parse,
    tiny={"intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2},
    shapes=(BenchShape("olmoe", "allenai/OLMoE-1B-7B-0924", {
        "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "norm_topk_prob": False, "rope_theta": 10000.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "eos_token_id": 2, "clip_qkv": None,
    }),),
    gguf=GGUFArch("olmoe", gguf_config),
)
