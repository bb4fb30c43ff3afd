"""Granite MoE (`granitemoe`: IBM Granite 3.0/3.1 MoE, e.g. granite-3.1-3b-a800m): Llama-style attention over
experts, with the muP multipliers.

What differs from the plain decoder, each as transformers' `modeling_granitemoe.py` computes it:
- the embeddings times `embedding_multiplier`, each layer's attention and experts' outputs times
  `residual_multiplier` into the residual stream, attention scores times `attention_multiplier` (not 1/sqrt(d)),
  the logits divided by `logits_scaling`;
- the router takes the top k logits and a softmax over those alone;
- each layer's experts stored as two tensors (`input_linear`: every expert's gate and up rows, `output_linear`: its
  down), read as per-expert views;
- q/k/v/o biases where `attention_bias` says.
`granitemoeshared.py` adds its shared SwiGLU. llama.cpp writes both as its `granitemoe` architecture (read here).
"""

from __future__ import annotations

from typing import Any

from tandem.runtime.config import ModelConfig, decoder_fields, require
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.gguf_meta import Meta, common_config, read_float, read_int


def granite_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields Granite MoE and Granite MoE with a shared expert read alike."""
    require(raw, "intermediate_size", "num_local_experts", "num_experts_per_tok")
    bias = raw.get("attention_bias", False)
    return {
        **decoder_fields(raw, eps=1e-6, theta=10000.0, max_pos=2048),
        "qkv_bias": bias,
        "o_bias": bias,
        "num_experts": raw["num_local_experts"],
        "top_k": raw["num_experts_per_tok"],
        "moe_intermediate_size": raw["intermediate_size"],
        "scoring": "softmax_topk",
        "embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
        # (transformers' default: 1, not 1/sqrt(d))
        "attention_multiplier": float(raw.get("attention_multiplier", 1.0)),
        "logits_scaling": float(raw.get("logits_scaling", 1.0)),
    }


def parse(raw: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**granite_fields(raw))


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    """As llama.cpp's converter writes Granite MoE (its GraniteMoeModel, for both families: a shared expert's
    tensors say which): the muP multipliers as its scales, each left out where the config had none (llama.cpp then
    scales nothing, attention by 1/sqrt(head_dim)); the experts' width as the feed-forward length; the shared
    expert's."""
    a = "granitemoe"
    raw = common_config(meta, a, vocab)
    dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    shared = "blk.0.ffn_gate_shexp.weight" in types
    return raw | {
        "model_type": "granitemoeshared" if shared else "granitemoe",
        "num_local_experts": read_int(meta, f"{a}.expert_count", bound="num_local_experts"),
        "intermediate_size": read_int(meta, f"{a}.feed_forward_length"),  # (Granite's experts' width)
        "embedding_multiplier": read_float(meta, f"{a}.embedding_scale", 1.0),
        "residual_multiplier": read_float(meta, f"{a}.residual_scale", 1.0),
        "attention_multiplier": read_float(meta, f"{a}.attention.scale", dim ** -0.5),
        "logits_scaling": read_float(meta, f"{a}.logit_scale", 1.0),
    } | ({"shared_intermediate_size": read_int(meta, f"{a}.expert_shared_feed_forward_length")} if shared else {})


# The muP multipliers of a published model (granite-3.1-3b-a800m's), in the tiny config too: every one of them changes
# the numbers
MUP = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625,
       "logits_scaling": 6.0}

SPEC = FamilySpec(
    "granitemoe", "Granite MoE", parse,
    tiny={"intermediate_size": 48, "num_local_experts": 8, "num_experts_per_tok": 2, **MUP},
    shapes=(BenchShape("granite-3.1-3b-a800m", "ibm-granite/granite-3.1-3b-a800m-instruct", {
        "vocab_size": 49155, "hidden_size": 1536, "intermediate_size": 512, "num_hidden_layers": 32,
        "num_attention_heads": 24, "num_key_value_heads": 8, "num_local_experts": 40, "num_experts_per_tok": 8,
        "rope_theta": 10000000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "attention_bias": False,
        "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0, **MUP,
    }, aliases=("granite",)),),
    moe_prefix="block_sparse_moe", router="router.layer",
    stacked_experts=("input_linear.weight", "output_linear.weight"),
    gguf=GGUFArch("granitemoe", gguf_config, rope_permuted=True),
)
