"""DeepSeek-V2 (DeepSeek-V2-Lite, DeepSeek-Coder-V2-Lite): Multi-head Latent Attention (runtime/mla.py) with
interleaved RoPE, softmax routing (greedy or group-limited, each group scored by its best expert) scaled by
`routed_scaling_factor`, ungated shared experts, the first `first_k_dense_replace` layers dense.

As transformers 5 (`modeling_deepseek_v2.py`), the reference: `norm_topk_prob` is not applied (the chosen softmax
scores are the weights) and `scoring_func` is always softmax. `deepseek_v3.py` reuses `deepseek_fields`.
"""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.config import ModelConfig, decoder_fields, dense_first_pattern, require
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.gguf_meta import Meta, common_config, read_flag, read_float, read_int, read_text


def deepseek_fields(raw: dict[str, Any], *, max_pos: int, experts: int, shared: int, q_lora_rank: int,
                    first_dense: int) -> dict[str, Any]:
    """The fields DeepSeek-V2 and V3 read alike, with transformers' defaults for the keys that are absent, but one: a
    key set to null counts as absent (config.clean_raw drops it), and `q_lora_rank: null` (V2-Lite, Moonlight) must
    mean a plain q_proj, so an absent q_lora_rank does too (transformers: 1536). Every published config names it;
    a wrong guess would be refused by the checkpoint's tensor names, never run."""
    require(raw, "num_experts_per_tok")
    name = raw["model_type"]
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise UnsupportedModelError(f"{name} with attention_bias or mlp_bias set is not supported (no published "
                                    "DeepSeek model has them); set them to false only if the weights have no biases")
    if raw.get("moe_layer_freq", 1) != 1:
        raise UnsupportedModelError(
            f"{name} with moe_layer_freq {raw['moe_layer_freq']} is not supported: transformers builds a MoE block in "
            "every layer after first_k_dense_replace whatever it says, DeepSeek's own code every moe_layer_freq-th, "
            "and no published model sets it"
        )
    heads = raw["num_attention_heads"]
    if raw.get("num_key_value_heads", heads) != heads:
        raise UnsupportedModelError(f"{name} with num_key_value_heads {raw['num_key_value_heads']} != "
                                    f"num_attention_heads {heads} is not supported: latent attention expands every "
                                    "head's keys and values; fix config.json")
    n_experts = raw.get("n_routed_experts", experts)
    nope, rope = raw.get("qk_nope_head_dim", 128), raw.get("qk_rope_head_dim", 64)
    layers = raw["num_hidden_layers"]
    sparse = dense_first_pattern({"first_k_dense_replace": raw.get("first_k_dense_replace", first_dense)}, layers)
    moe_width = raw.get("moe_intermediate_size", 1407)
    return {
        **decoder_fields(raw, eps=1e-6, theta=10000.0, max_pos=max_pos),
        "num_kv_heads": heads,
        "head_dim": nope + rope,  # the query/key heads; the values have v_head_dim
        "rotary_dim": rope,  # the rope tables cover the rotated dims alone (runtime/mla.py rotates them apart)
        "num_experts": n_experts,
        "top_k": raw["num_experts_per_tok"],
        "moe_intermediate_size": moe_width,
        "shared_expert_intermediate_size": raw.get("n_shared_experts", shared) * moe_width,
        "dense_intermediate_size": raw.get("intermediate_size", 11008) if not all(sparse) else 0,
        "sparse_layers": sparse,
        "kv_lora_rank": raw.get("kv_lora_rank", 512),
        "q_lora_rank": raw.get("q_lora_rank", q_lora_rank),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": raw.get("v_head_dim", 128),
        "routed_scaling_factor": float(raw.get("routed_scaling_factor", 1.0)),
    }


def check_groups(raw: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """Group-limited routing must split the experts evenly and keep enough of them for top-k."""
    if cfg.n_group > 1:
        per_group = cfg.num_experts // cfg.n_group
        if cfg.num_experts % cfg.n_group or cfg.topk_group > cfg.n_group or cfg.top_k > cfg.topk_group * per_group:
            raise UnsupportedModelError(
                f"{raw['model_type']}: {cfg.num_experts} experts in n_group {cfg.n_group} groups, topk_group "
                f"{cfg.topk_group} of them kept, cannot give top-k {cfg.top_k} (the groups must be equal and keep at "
                "least top-k experts); fix config.json"
            )
    return cfg


def sigmoid_routing(raw: dict[str, Any], groups: int = 1, topk_group: int = 1) -> dict[str, Any]:
    """DeepSeek-V3's routing, which GLM-4.5, GLM-4.7-Flash and dots.llm1 share: sigmoid scores, every router's
    correction bias (a buffer, zeros until trained) for choosing, groups scored by their two best experts."""
    return {"scoring": "sigmoid", "n_group": raw.get("n_group", groups),
            "topk_group": raw.get("topk_group", topk_group), "group_score": "top2", "router_correction": True}


def check_top2_groups(raw: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """`check_groups`, and groups of at least two experts, which their two best score."""
    if cfg.n_group > 1 and cfg.num_experts // cfg.n_group < 2:
        raise UnsupportedModelError(f"{raw['model_type']}: groups of {cfg.num_experts // cfg.n_group} expert cannot "
                                    "be scored by their two best experts; fix n_group in config.json")
    return check_groups(raw, cfg)


def parse(raw: dict[str, Any]) -> ModelConfig:
    method = raw.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModelError(f"deepseek_v2 with topk_method {method!r} is not supported; Tandem runs greedy "
                                    "and group_limited_greedy (as transformers)")
    if raw.get("scoring_func", "softmax") != "softmax":
        raise UnsupportedModelError(f"deepseek_v2 with scoring_func {raw['scoring_func']!r} is not supported "
                                    "(DeepSeek-V2 scores experts with softmax; sigmoid scoring is DeepSeek-V3's, "
                                    "model_type deepseek_v3)")
    grouped = method == "group_limited_greedy"
    if grouped:
        require(raw, "n_group", "topk_group")
    cfg = ModelConfig(
        **deepseek_fields(raw, max_pos=2048, experts=64, shared=2, q_lora_rank=0, first_dense=0),
        norm_topk_prob=False,  # not applied by transformers' DeepseekV2TopkRouter, whatever config.json says
        rope_interleave=True,  # transformers rotates the rope dims as complex pairs (apply_rotary_emb)
        n_group=raw["n_group"] if grouped else 1,
        topk_group=raw["topk_group"] if grouped else 1,
    )
    return check_groups(raw, cfg)


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    """DeepSeek-V2 (softmax gating) and V3 (sigmoid gating, expert_gating_func 2), and GLM-4.7-Flash, which llama.cpp
    writes as V3: MLA as one key/value head of kv_lora_rank + rope dims, the head's own sizes in the `_mla` keys; YaRN's
    mscale_all_dim as 0.1 times the log multiplier (and mscale equal to it, as the published configs have it); the
    multi-token-prediction layers counted in block_count (GLM-4.7-Flash's; not run, as transformers does not)."""
    a = "deepseek2"
    raw = common_config(meta, a, vocab)
    raw["num_hidden_layers"] -= read_int(meta, f"{a}.nextn_predict_layers", 0)
    raw.pop("head_dim", None)
    raw["num_key_value_heads"] = raw["num_attention_heads"]
    rope = read_int(meta, f"{a}.rope.dimension_count")
    sigmoid = read_int(meta, f"{a}.expert_gating_func", 1) == 2
    groups, used = read_int(meta, f"{a}.expert_group_count", 1), read_int(meta, f"{a}.expert_group_used_count", 1)
    out = raw | {
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "kv_lora_rank": read_int(meta, f"{a}.attention.kv_lora_rank"),
        "q_lora_rank": read_int(meta, f"{a}.attention.q_lora_rank", 0) or None,
        "qk_rope_head_dim": rope, "qk_nope_head_dim": read_int(meta, f"{a}.attention.key_length_mla") - rope,
        "v_head_dim": read_int(meta, f"{a}.attention.value_length_mla"),
        "n_routed_experts": read_int(meta, f"{a}.expert_count", bound="num_local_experts"),
        "n_shared_experts": read_int(meta, f"{a}.expert_shared_count", 0),
        "moe_intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length"),
        "intermediate_size": read_int(meta, f"{a}.feed_forward_length"),
        "first_k_dense_replace": read_int(meta, f"{a}.leading_dense_block_count", 0),
        "routed_scaling_factor": read_float(meta, f"{a}.expert_weights_scale", 1.0),
        "norm_topk_prob": read_flag(meta, f"{a}.expert_weights_norm", False),
        "n_group": groups, "topk_group": used,
        "scoring_func": "sigmoid" if sigmoid else "softmax",
        "topk_method": "noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy"}
    if read_text(meta, f"{a}.rope.scaling.type") == "yarn":
        log_mul = read_float(meta, f"{a}.rope.scaling.yarn_log_multiplier", 0.0) / 0.1
        out["rope_scaling"] = {
            "type": "yarn", "factor": read_float(meta, f"{a}.rope.scaling.factor"),
            "original_max_position_embeddings": read_int(meta, f"{a}.rope.scaling.original_context_length"),
            "beta_fast": read_float(meta, f"{a}.rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": read_float(meta, f"{a}.rope.scaling.yarn_beta_slow", 1.0),
            "mscale": log_mul, "mscale_all_dim": log_mul}
    return out


SPEC = FamilySpec(
    "deepseek_v2", "DeepSeek-V2", parse,
    tiny={"num_key_value_heads": 4, "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 8,
          "num_experts_per_tok": 2, "n_shared_experts": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
          "qk_rope_head_dim": 8, "v_head_dim": 24, "first_k_dense_replace": 1, "topk_method": "greedy",
          "routed_scaling_factor": 1.0, "norm_topk_prob": False},
    shapes=(BenchShape("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", {
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "scoring_func": "softmax",
        "routed_scaling_factor": 1.0, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "tie_word_embeddings": False, "bos_token_id": 100000, "eos_token_id": 100001,
    }, aliases=("deepseek",)),),
    moe_prefix="mlp", router="gate", shared_expert="shared_experts", shared_expert_gate=None,
    gguf=GGUFArch("deepseek2", gguf_config),
)
