"""ERNIE 4.5 MoE (`ernie4_5_moe`: ERNIE-4.5-21B-A3B, -300B-A47B): Llama-style attention with RoPE over adjacent
pairs of dims, softmax routing with a correction bias, shared experts, MoE on a range of layers at an interval.

What differs from the plain decoder, each as transformers' `modular_ernie4_5_moe.py` computes it:
- RoPE turns adjacent pairs (x0, x1), (x2, x3)... of each head (`rope_interleave`: the q and k rows reordered at load,
  runtime/attention.py `halves_order`);
- softmax router scores over every expert, the `moe_statics` correction bias ([1, E], beside the router) added for
  choosing only, the chosen scores renormalised (by at least `moe_norm_min`);
- `moe_num_shared_experts` ungated shared experts as one SwiGLU of moe_num_shared_experts * moe_intermediate_size;
- MoE blocks on layers `moe_layer_start_index` to `moe_layer_end_index` every `moe_layer_interval`, dense layers
  (width `intermediate_size`) elsewhere.

The multi-token-prediction weights of the published checkpoints (`mtp_*`) are not read: transformers does not run
them either.
"""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.config import ModelConfig, decoder_fields, require
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.gguf_meta import Meta, common_config, read_int


def moe_layers(raw: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Which layers hold a MoE block: from `moe_layer_start_index` to `moe_layer_end_index` (-1: the last), every
    `moe_layer_interval`-th counting from the first layer, as transformers' Ernie4_5_MoeDecoderLayer chooses."""
    start, end = int(raw.get("moe_layer_start_index", 1)), int(raw.get("moe_layer_end_index", -1))
    end = layers - 1 if end == -1 else end
    every = int(raw.get("moe_layer_interval", 1) or 1)
    return tuple((i + 1) % every == 0 and start <= i <= end for i in range(layers))


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "moe_k", "moe_num_experts", "moe_intermediate_size")
    if raw.get("use_bias"):
        raise UnsupportedModelError("ernie4_5_moe with use_bias set is not supported (biases on every projection, "
                                    "the dense and shared SwiGLUs' among them; no published ERNIE 4.5 has them)")
    layers = raw["num_hidden_layers"]
    sparse = moe_layers(raw, layers)
    width = raw["moe_intermediate_size"]
    return ModelConfig(
        **decoder_fields(raw, eps=1e-5, theta=500000.0, max_pos=131072),
        rope_interleave=True,
        num_experts=raw["moe_num_experts"],
        top_k=raw["moe_k"],
        moe_intermediate_size=width,
        shared_expert_intermediate_size=int(raw.get("moe_num_shared_experts", 2) or 0) * width,
        dense_intermediate_size=raw.get("intermediate_size", 12288) if not all(sparse) else 0,
        sparse_layers=sparse,
        norm_topk_prob=True,  # (divided by at least moe_norm_min, 1e-12: no sum of softmax scores comes near it)
        router_correction=True,  # every router holds one (moe_statics, zeros until trained)
    )


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    """As llama.cpp's converter writes ERNIE 4.5 MoE (its Ernie4_5MoeModel): the MoE layers from
    leading_dense_block_count at interleave_moe_layer_step, the shared experts' count."""
    a = "ernie4_5-moe"
    raw = common_config(meta, a, vocab) | {
        "model_type": "ernie4_5_moe", "moe_num_experts": read_int(meta, f"{a}.expert_count", bound="num_local_experts"),
        "moe_k": read_int(meta, f"{a}.expert_used_count", bound="num_experts_per_tok"),
        "moe_intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length"),
        "intermediate_size": read_int(meta, f"{a}.feed_forward_length"),
        "moe_num_shared_experts": read_int(meta, f"{a}.expert_shared_count", 0),
        "moe_layer_start_index": read_int(meta, f"{a}.leading_dense_block_count", 0),
        "moe_layer_interval": read_int(meta, f"{a}.interleave_moe_layer_step", 1), "moe_layer_end_index": -1}
    return raw


SPEC = FamilySpec(
    "ernie4_5_moe", "ERNIE 4.5 MoE", parse,
    tiny={"intermediate_size": 128, "moe_intermediate_size": 48, "moe_num_experts": 8, "moe_k": 2,
          "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_interval": 1, "use_bias": False,
          "tie_word_embeddings": False},
    shapes=(BenchShape("ernie-4.5-21b-a3b", "baidu/ERNIE-4.5-21B-A3B-PT", {
        "vocab_size": 103424, "hidden_size": 2560, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 28, "num_attention_heads": 20, "num_key_value_heads": 4, "moe_num_experts": 64,
        "moe_k": 6, "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": 27,
        "moe_layer_interval": 1, "rope_theta": 500000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "use_bias": False, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }, aliases=("ernie",)),),
    moe_prefix="mlp", router="gate", shared_expert="shared_experts", shared_expert_gate=None,
    correction="moe_statics.e_score_correction_bias", correction_grouped=True,
    gguf=GGUFArch("ernie4_5-moe", gguf_config),
)
