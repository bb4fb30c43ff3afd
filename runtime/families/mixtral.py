"""Mixtral: Llama-style attention (no biases), top-k over softmax, always renormalised, no shared expert."""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.config import ModelConfig, decoder_fields, require
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.gguf_meta import Meta, common_config, read_int


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "intermediate_size", "num_local_experts", "num_experts_per_tok")
    return ModelConfig(
        **decoder_fields(raw, eps=1e-5, theta=1e6, max_pos=32768),
        num_experts=raw["num_local_experts"],
        top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["intermediate_size"],
        sliding_window=raw.get("sliding_window"),
    )


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    a = "llama"
    experts = read_int(meta, f"{a}.expert_count", 0, "num_experts")
    if experts == 0:
        raise UnsupportedModelError("this GGUF file is a dense llama model (no experts); Tandem runs mixtures of "
                                    "experts: Mixtral, Qwen-MoE, OLMoE")
    return common_config(meta, a, vocab) | {
        "model_type": "mixtral", "num_local_experts": experts,
        "intermediate_size": read_int(meta, f"{a}.feed_forward_length")}


SPEC = FamilySpec(
    "mixtral", "Mixtral", parse,
    tiny={"intermediate_size": 96, "num_local_experts": 8, "num_experts_per_tok": 2},
    shapes=(BenchShape("mixtral", "mistralai/Mixtral-8x7B-v0.1", {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "rope_theta": 1e6, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }),),
    moe_prefix="block_sparse_moe", expert_proj=("w1", "w3", "w2"),
    gguf=GGUFArch("llama", gguf_config, rope_permuted=True),
)
