"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention sinks (a learned logit per head that joins the softmax), biases on
q/k/v/o, sliding-window layers alternating with full attention (`layer_types`), YaRN RoPE; a router with a bias,
top-k of its logits then a softmax over those; experts with biases computing a clamped SwiGLU (`swiglu_alpha`,
`swiglu_limit`), stored fused per layer with gate and up interleaved (moe.ClampedSwiGLUExpert). No shared expert,
no dense layers.

As transformers 5 (`modeling_gpt_oss.py`, `GptOssConfig`), the reference, including its defaults for absent keys.
Published checkpoints store the experts as MXFP4 (`*_blocks`, `*_scales`, with `quantization_config.quant_method`
"mxfp4"): they stay 4-bit in RAM and run on the C kernels (moe.MXFP4Expert). Experts stored as bf16/fp16/float32
(what transformers writes for tiny models, or after dequantizing) run in torch (moe.ClampedSwiGLUExpert).
"""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.config import ModelConfig, decoder_fields, require, sliding_layer_pattern
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.gguf_meta import Meta, common_config, read_float, read_int, read_text

# GptOssConfig's RoPE when config.json names none (what gpt-oss-20b/120b ship as rope_scaling)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "num_local_experts", "num_experts_per_tok", "intermediate_size")
    quant = raw.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in (None, "mxfp4"):
        raise UnsupportedModelError(
            f"gpt_oss with {method} quantized experts (quantization_config) is not supported: Tandem runs gpt-oss "
            "experts stored as MXFP4 (as published) or as bf16/fp16/float32. Use the published MXFP4 checkpoint, or "
            "a bf16 copy")
    if method == "mxfp4" and (raw.get("hidden_size", 0) % 32 or raw["intermediate_size"] % 32):
        raise UnsupportedModelError(
            f"gpt_oss with MXFP4 experts needs hidden_size and intermediate_size in whole blocks of 32 values, not "
            f"{raw.get('hidden_size')} and {raw['intermediate_size']}; the checkpoint is damaged")
    alpha, limit = raw.get("swiglu_alpha", 1.702), raw.get("swiglu_limit", 7.0)
    layers = raw["num_hidden_layers"]
    # transformers' GptOssExperts compute their clamped SwiGLU whatever hidden_act says (gpt-oss has no dense layer
    # that would read it), so the key is not checked here
    given = {**raw, "hidden_act": "silu"}
    if "rope_parameters" not in raw and "rope_scaling" not in raw:
        given["rope_parameters"] = dict(DEFAULT_ROPE)
    fields = decoder_fields(given, eps=1e-5, theta=150000.0, max_pos=131072)
    # GptOssConfig: layer_types default to sliding, full, sliding, ... (the first layer slides)
    types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    bias = raw.get("attention_bias", True)
    return ModelConfig(
        **(fields | {"head_dim": raw.get("head_dim", 64)}),  # GptOssConfig's default, not hidden / heads
        qkv_bias=bias,
        o_bias=bias,
        num_experts=raw["num_local_experts"],
        top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["intermediate_size"],
        sliding_window=raw.get("sliding_window", 128),
        sliding_layers=sliding_layer_pattern({"layer_types": types}, layers),
        scoring="softmax_topk",  # GptOssTopKRouter: the top-k logits, then a softmax over those alone
        attention_sinks=True,
        router_bias=True,
        clamped_swiglu=(float(alpha), float(limit)),
        experts_mxfp4=method == "mxfp4",
    )


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    """gpt-oss: sliding layers alternating with full ones (the first slides), YaRN; the clamped SwiGLU's alpha and
    limit are not in the file (llama.cpp takes gpt-oss's own, 1.702 and 7.0, as the family does). MXFP4 experts are
    read as the published checkpoint stores them (`quantization_config`: mxfp4; see `GGUFFile.tensor`)."""
    a = "gpt-oss"
    raw = common_config(meta, a, vocab)
    out = raw | {
        "model_type": "gpt_oss", "num_local_experts": read_int(meta, f"{a}.expert_count", bound="num_local_experts"),
        "intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length"),
        "sliding_window": read_int(meta, f"{a}.attention.sliding_window"),
        "head_dim": read_int(meta, f"{a}.attention.key_length", raw["hidden_size"] // raw["num_attention_heads"])}
    if read_text(meta, f"{a}.rope.scaling.type") == "yarn":
        out["rope_scaling"] = {
            "rope_type": "yarn", "factor": read_float(meta, f"{a}.rope.scaling.factor"),
            "original_max_position_embeddings": read_int(meta, f"{a}.rope.scaling.original_context_length"),
            "beta_fast": read_float(meta, f"{a}.rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": read_float(meta, f"{a}.rope.scaling.yarn_beta_slow", 1.0), "truncate": False}
    if types.get("blk.0.ffn_gate_exps.weight") == "MXFP4":
        out["quantization_config"] = {"quant_method": "mxfp4"}  # its experts read as the published layout
    return out


SPEC = FamilySpec(
    "gpt_oss", "gpt-oss", parse,
    tiny={"intermediate_size": 48, "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16,
          "sliding_window": 4, "rms_norm_eps": 1e-5},
    # openai/gpt-oss-20b's config.json (its experts bf16 here: published as MXFP4, with a quantization_config); the
    # 120b differs in 36 layers and 128 experts
    shapes=(BenchShape("gpt-oss-20b", "openai/gpt-oss-20b", {
        "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "sliding_window": 128,  # layer_types left out: the default alternation (sliding
        # first) is what the published config lists, and it follows --layers
        "rope_theta": 150000, "rope_scaling": dict(DEFAULT_ROPE), "max_position_embeddings": 131072,
        "initial_context_length": 4096, "rms_norm_eps": 1e-5, "attention_bias": True, "swiglu_limit": 7.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "eos_token_id": 200002, "pad_token_id": 199999,
    }, aliases=("gpt-oss",)),),
    moe_prefix="mlp", router="router", fused_experts=True,
    gguf=GGUFArch("gpt-oss", gguf_config),
)
