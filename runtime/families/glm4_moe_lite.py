"""GLM-4.7-Flash (`glm4_moe_lite`): GLM-4.5's routing over DeepSeek-V3's latent attention.

As transformers' `modular_glm4_moe_lite.py` computes it: DeepSeek-V3's Multi-head Latent Attention (runtime/mla.py;
q through q_a/q_b under `q_lora_rank`, RoPE interleaved unless `rope_interleave` is false), and GLM-4.5's MoE: sigmoid
router scores, `e_score_correction_bias` for choosing only, groups scored by their two best experts,
`norm_topk_prob`, `routed_scaling_factor`, ungated shared experts; each layer dense or MoE as `mlp_layer_types` says
(by default the first dense). The multi-token-prediction layer of the published checkpoint is not read.

llama.cpp writes these models as its `deepseek2` architecture (sigmoid gating), which runtime/families/deepseek_v2.py
reads as the DeepSeek-V3 family: the same computation.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tandem.kernels.errors import CheckpointError
from tandem.runtime.config import ModelConfig
from tandem.runtime.families import BenchShape, FamilySpec
from tandem.runtime.families.deepseek_v3 import v3_config

# Glm4MoeLiteConfig's defaults (GLM-4.7-Flash's dimensions), for a config.json that leaves a key out
DEFAULTS: dict[str, Any] = {"n_routed_experts": 64, "n_shared_experts": 1, "moe_intermediate_size": 1536,
                            "intermediate_size": 10240, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
                            "qk_rope_head_dim": 64, "v_head_dim": 256, "routed_scaling_factor": 1.8}


def mlp_types(raw: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Each layer MoE ("sparse") or dense, as `mlp_layer_types` says (default: the first dense, the rest MoE)."""
    types = raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    if not isinstance(types, list) or len(types) != layers or set(types) - {"dense", "sparse"}:
        raise CheckpointError(f"config.json's mlp_layer_types must list \"dense\" or \"sparse\" for each of the "
                              f"{layers} layers; fix config.json")
    return tuple(t == "sparse" for t in types)


def parse(raw: dict[str, Any]) -> ModelConfig:
    sparse = mlp_types(raw, raw["num_hidden_layers"])
    cfg = v3_config(DEFAULTS | raw, max_pos=202752, experts=64, first_dense=1, groups=1, topk_group=1)
    width = raw.get("intermediate_size", DEFAULTS["intermediate_size"]) if not all(sparse) else 0
    return replace(cfg, sparse_layers=sparse, dense_intermediate_size=width)


SPEC = FamilySpec(
    "glm4_moe_lite", "GLM-4.7-Flash", parse,
    tiny={"num_key_value_heads": 4, "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 8,
          "num_experts_per_tok": 2, "n_shared_experts": 1, "kv_lora_rank": 32, "q_lora_rank": 24,
          "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24, "n_group": 1, "topk_group": 1,
          "norm_topk_prob": True, "routed_scaling_factor": 1.8, "rope_interleave": True},
    shapes=(BenchShape("glm-4.7-flash", "zai-org/GLM-4.7-Flash", {
        "vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240, "moe_intermediate_size": 1536,
        "num_hidden_layers": 47, "num_attention_heads": 20, "num_key_value_heads": 20, "n_routed_experts": 64,
        "n_shared_experts": 1, "num_experts_per_tok": 4, "kv_lora_rank": 512, "q_lora_rank": 768,
        "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 1.8, "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "rope_interleave": True, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1,
    }, aliases=("glm-flash",)),),
    moe_prefix="mlp", router="gate", shared_expert="shared_experts", shared_expert_gate=None,
)
