"""DeepSeek-V3 architecture (DeepSeek-V3/R1, Kimi K2, Moonlight): DeepSeek-V2's latent attention and shared
experts, with sigmoid routing: a per-expert `e_score_correction_bias` added for choosing only, groups scored by
their two best experts, `norm_topk_prob`, `routed_scaling_factor`. RoPE is interleaved unless `rope_interleave` is
false. As transformers 5 (`modeling_deepseek_v3.py`), the reference; the multi-token-prediction layers
(`num_nextn_predict_layers`) are not run.
"""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.config import ModelConfig
from tandem.runtime.families import BenchShape, FamilySpec
from tandem.runtime.families.deepseek_v2 import check_top2_groups, deepseek_fields, sigmoid_routing


def v3_config(raw: dict[str, Any], *, max_pos: int = 4096, experts: int = 256, first_dense: int = 3, groups: int = 8,
              topk_group: int = 4) -> ModelConfig:
    """DeepSeek-V3's decoder from a config, with transformers' defaults for the keys it leaves out (GLM-4.7-Flash's
    are its own: glm4_moe_lite.py)."""
    if raw.get("scoring_func", "sigmoid") != "sigmoid" or raw.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedModelError(
            f"{raw['model_type']} with scoring_func {raw.get('scoring_func')!r} / topk_method "
            f"{raw.get('topk_method')!r} is not supported; it routes with sigmoid scores and noaux_tc (as transformers)"
        )
    cfg = ModelConfig(
        **deepseek_fields(raw, max_pos=max_pos, experts=experts, shared=1, q_lora_rank=0, first_dense=first_dense),
        norm_topk_prob=raw.get("norm_topk_prob", True),
        rope_interleave=raw.get("rope_interleave", True),
        **sigmoid_routing(raw, groups=groups, topk_group=topk_group),
    )
    return check_top2_groups(raw, cfg)


def parse(raw: dict[str, Any]) -> ModelConfig:
    return v3_config(raw)


SPEC = FamilySpec(
    "deepseek_v3", "DeepSeek-V3", parse,
    tiny={"num_key_value_heads": 4, "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 8,
          "num_experts_per_tok": 2, "n_shared_experts": 1, "kv_lora_rank": 32, "q_lora_rank": 24,
          "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24, "first_k_dense_replace": 1, "n_group": 2,
          "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_interleave": True},
    shapes=(BenchShape("moonlight-16b-a3b", "moonshotai/Moonlight-16B-A3B", {
        "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.446, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163585,
    }, aliases=("moonlight",)),),
    moe_prefix="mlp", router="gate", shared_expert="shared_experts", shared_expert_gate=None,
)
