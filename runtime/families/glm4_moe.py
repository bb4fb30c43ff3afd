"""GLM-4.5 and GLM-4.5-Air (`glm4_moe`): DeepSeek-V3-style routing on a Llama-style decoder.

What differs from the plain decoder, each as transformers' `modeling_glm4_moe.py` computes it:
- partial rotary: only the first head_dim * `partial_rotary_factor` dims of each head rotate (0.5 unless the config
  says otherwise), rotate-half style like Llama (not GLM-4's interleaved pairs), the rest pass through;
- q/k/v biases (`attention_bias`), never an o bias; optional per-head q/k RMSNorm (`use_qk_norm`);
- sigmoid router scores; `e_score_correction_bias` added for choosing only; group-limited choice (`n_group`,
  `topk_group`, each group scored by its two best experts); `norm_topk_prob`; `routed_scaling_factor`;
- `n_shared_experts` shared experts as one ungated SwiGLU of n_shared_experts * moe_intermediate_size;
- the first `first_k_dense_replace` layers dense (width `intermediate_size`).

The multi-token-prediction layer of the published checkpoints (`model.layers.<num_hidden_layers>.*`) is not read:
transformers does not run it either.
"""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import CheckpointError
from tandem.runtime.config import ModelConfig, decoder_fields, dense_first_pattern, require
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.families.deepseek_v2 import check_top2_groups, sigmoid_routing
from tandem.runtime.gguf_meta import Meta, common_config, read_flag, read_float, read_int

DEFAULT_PARTIAL_ROTARY = 0.5  # transformers' Glm4MoeConfig assigns it when the config names none (older configs)


def rotary_dim(raw: dict[str, Any], head_dim: int) -> int:
    """The rotated dims of a head: int(head_dim * partial_rotary_factor), as transformers computes them. The factor
    is in `rope_parameters` (transformers 5) or at the top level (the published configs)."""
    params = raw.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)))
    if not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor is {factor}, but it must be above 0 and at most 1")
    dims = int(head_dim * factor)
    if dims < 2 or dims % 2:
        raise ValueError(f"partial_rotary_factor {factor} rotates {dims} dims of a head of {head_dim}, but RoPE turns "
                         "pairs of dims: the rotated dims must be an even number, at least 2")
    return dims


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "num_experts_per_tok", "moe_intermediate_size")
    experts = raw.get("n_routed_experts", raw.get("num_local_experts"))  # the attribute_map's two names
    if experts is None:
        require(raw, "n_routed_experts")
    fields = decoder_fields(raw, eps=1e-5, theta=10000.0, max_pos=131072)
    layers = raw["num_hidden_layers"]
    sparse = dense_first_pattern({"first_k_dense_replace": raw.get("first_k_dense_replace", 1)}, layers)
    shared = int(raw.get("n_shared_experts", 1))
    cfg = ModelConfig(
        **fields,
        rotary_dim=rotary_dim(raw, fields["head_dim"]),
        qkv_bias=raw.get("attention_bias", False),
        o_bias=False,  # o_proj never has a bias, whatever attention_bias says
        qk_norm="head" if raw.get("use_qk_norm", False) else "none",
        num_experts=experts,
        top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob", True),
        shared_expert_intermediate_size=shared * raw["moe_intermediate_size"],
        dense_intermediate_size=raw.get("intermediate_size", 10944) if not all(sparse) else 0,
        sparse_layers=sparse,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        **sigmoid_routing(raw),
    )
    return check_top2_groups(raw, cfg)


# The published configs as zai-org ships them (config.json of each model); MTP layer keys kept as published.
_COMMON: dict[str, Any] = {
    "vocab_size": 151552, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "partial_rotary_factor": 0.5, "rope_theta": 1000000, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "attention_bias": True, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "tie_word_embeddings": False, "hidden_act": "silu", "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338], "num_nextn_predict_layers": 1,
}

def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    """GLM-4.5(-Air): block_count includes the multi-token-prediction layers (not run, as transformers does not),
    rope.dimension_count the rotated dims of a head (partial rotary)."""
    a = "glm4moe"
    raw = common_config(meta, a, vocab)
    nextn = read_int(meta, f"{a}.nextn_predict_layers", 0)
    raw["num_hidden_layers"] -= nextn
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])
    if head_dim < 1:
        raise CheckpointError(f"the GGUF file's {a}.embedding_length ({raw['hidden_size']}) is less than its "
                              f"{raw['num_attention_heads']} attention heads; the file is damaged: re-download it")
    rotary = read_int(meta, f"{a}.rope.dimension_count", head_dim // 2)
    return raw | {
        "model_type": "glm4_moe", "head_dim": head_dim, "partial_rotary_factor": rotary / head_dim,
        "n_routed_experts": read_int(meta, f"{a}.expert_count", bound="num_local_experts"),
        "moe_intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length"),
        "intermediate_size": read_int(meta, f"{a}.feed_forward_length"),
        "n_shared_experts": read_int(meta, f"{a}.expert_shared_count", 1),
        "first_k_dense_replace": read_int(meta, f"{a}.leading_dense_block_count", 1),
        "routed_scaling_factor": read_float(meta, f"{a}.expert_weights_scale", 1.0),
        "norm_topk_prob": read_flag(meta, f"{a}.expert_weights_norm", True),
        "n_group": read_int(meta, f"{a}.expert_group_count", 1),
        "topk_group": read_int(meta, f"{a}.expert_group_used_count", 1),
        "num_nextn_predict_layers": nextn}


SPEC = FamilySpec(
    "glm4_moe", "GLM-4.5", parse,
    # Like GLM-4.5-Air: a dense first layer, one shared expert, q/k/v biases, half the head rotated.
    tiny={"intermediate_size": 128, "moe_intermediate_size": 48, "n_routed_experts": 8, "num_experts_per_tok": 2,
          "n_shared_experts": 1, "head_dim": 32, "partial_rotary_factor": 0.5, "first_k_dense_replace": 1,
          "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
          "use_qk_norm": False, "attention_bias": True},
    shapes=(
        BenchShape("glm-4.5-air", "zai-org/GLM-4.5-Air", _COMMON | {
            "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46,
            "n_routed_experts": 128, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "use_qk_norm": False,
        }, aliases=("glm-air",)),
        BenchShape("glm-4.5", "zai-org/GLM-4.5", _COMMON | {
            "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92,
            "n_routed_experts": 160, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "use_qk_norm": True,
        }, aliases=("glm",)),
    ),
    shared_expert="shared_experts",
    shared_expert_gate=None,
    gguf=GGUFArch("glm4moe", gguf_config),
)
