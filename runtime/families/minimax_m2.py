"""MiniMax-M2 (`minimax_m2`: MiniMax-M2, M2.1): attention with q/k RMSNorm over all heads and partial rotary, over
sigmoid-routed experts.

What differs from the plain decoder, each as transformers' `modular_minimax_m2.py` computes it:
- q and k each RMSNorm'ed over the whole projection, all heads together (its `qk_norm_type` "per_layer", OLMoE's
  form), before RoPE;
- partial rotary: the first `rotary_dim` dims of each head rotate, rotate-half style, the rest pass through;
- sigmoid router scores; a per-expert `e_score_correction_bias` (beside the router, in the MoE block) added for
  choosing only; the chosen scores always renormalised; no groups, no scaling, no shared expert;
- Mixtral's expert layout (`block_sparse_moe.experts.N.w1/w3/w2`), every layer MoE, of width `intermediate_size`.

The multi-token-prediction modules of the published checkpoints are not read: transformers does not run them either.
"""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.config import ModelConfig, decoder_fields, require
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.families.glm4_moe import rotary_dim
from tandem.runtime.gguf_meta import Meta, common_config, read_int


def rotated_dims(raw: dict[str, Any], head_dim: int) -> int:
    """`rotary_dim` as config.json gives it (transformers derives partial_rotary_factor from it), else the factor."""
    if raw.get("rotary_dim") is None:
        return rotary_dim(raw, head_dim)
    dims = raw["rotary_dim"]
    if not isinstance(dims, int) or isinstance(dims, bool) or not 2 <= dims <= head_dim or dims % 2:
        raise ValueError(f"rotary_dim is {dims!r}, but it must be an even number of dims from 2 to the head's "
                         f"{head_dim}")
    return dims


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "intermediate_size", "num_local_experts", "num_experts_per_tok")
    refused = [f"{key} {raw[key]!r}" for key, allowed in (("qk_norm_type", "per_layer"), ("scoring_func", "sigmoid"))
               if key in raw and raw[key] != allowed]
    refused += [f"{key} {raw[key]!r}" for key in ("use_qk_norm", "use_routing_bias") if raw.get(key) is False]
    refused += [f"shared_intermediate_size {raw['shared_intermediate_size']}"] \
        if raw.get("shared_intermediate_size") else []
    if refused:
        raise UnsupportedModelError(f"minimax_m2 with {', '.join(refused)} is not supported: Tandem runs MiniMax-M2 "
                                    "as transformers does (q/k RMSNorm over all heads, sigmoid routing with a "
                                    "correction bias, no shared expert)")
    fields = decoder_fields(raw, eps=1e-6, theta=5000000.0, max_pos=196608)
    return ModelConfig(
        **fields,
        rotary_dim=rotated_dims(raw, fields["head_dim"]),
        qk_norm="full",
        num_experts=raw["num_local_experts"],
        top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["intermediate_size"],
        norm_topk_prob=True,  # always renormalised, whatever config.json says
        scoring="sigmoid",
        router_correction=True,  # every MoE block holds one (a buffer, zeros until trained)
    )


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    """As llama.cpp's converter writes MiniMax-M2 (its MiniMaxM2Model): the experts' width in
    expert_feed_forward_length, the rotated dims in rope.dimension_count; sigmoid routing with a correction bias is
    the architecture's own."""
    a = "minimax-m2"
    return common_config(meta, a, vocab) | {
        "model_type": "minimax_m2", "num_local_experts": read_int(meta, f"{a}.expert_count", bound="num_local_experts"),
        "intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length"),
        "rotary_dim": read_int(meta, f"{a}.rope.dimension_count")}


SPEC = FamilySpec(
    "minimax_m2", "MiniMax-M2", parse,
    tiny={"intermediate_size": 48, "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 32, "rotary_dim": 16},
    shapes=(BenchShape("minimax-m2", "MiniMaxAI/MiniMax-M2", {
        "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
        "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64,
        "num_local_experts": 256, "num_experts_per_tok": 8, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
        "use_routing_bias": True, "rope_theta": 5000000.0, "max_position_embeddings": 196608, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "bos_token_id": 200034, "eos_token_id": 200020,
    }, aliases=("minimax",)),),
    moe_prefix="block_sparse_moe", expert_proj=("w1", "w3", "w2"), correction="e_score_correction_bias",
    gguf=GGUFArch("minimax-m2", gguf_config),
)
