"""HunYuan MoE (`hunyuan_v1_moe`: Hunyuan-A13B): Llama-style attention whose per-head q/k RMSNorm comes after RoPE,
NTK-alpha RoPE, softmax routing, one shared SwiGLU beside the experts.

What differs from the plain decoder, each as transformers' `modular_hunyuan_v1_moe.py` computes it:
- q and k rotated, then each head RMSNorm'ed (`query_layernorm`, `key_layernorm`: `qk_norm_after_rope`);
- RoPE "dynamic" with a fixed `alpha`: the base stretched once to rope_theta * alpha^(D / (D - 2)) (transformers'
  ntk_alpha; no dependence on the length);
- the router (`gate.wg`) scores every expert by softmax, takes the top k, renormalises them;
- one shared SwiGLU (`shared_mlp`) every token goes through beside the experts, both of width `intermediate_size`;
- q/k/v/o biases where `attention_bias` says.
"""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.config import ModelConfig, decoder_fields, require
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.gguf_meta import Meta, common_config, read_int


def one_value(raw: dict[str, Any], key: str) -> Any:
    """A per-layer setting the published configs list per layer (`moe_topk`, ...), one value for every layer."""
    value = raw[key]
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise UnsupportedModelError(f"hunyuan_v1_moe with {key} differing between layers ({value[:4]}...) is not "
                                        "supported: transformers builds every layer alike")
        return value[0]
    return value


def ntk_alpha(raw: dict[str, Any]) -> dict[str, Any]:
    """The config with RoPE "dynamic" and its fixed alpha as the plain RoPE of the stretched base it amounts to."""
    params, scaling = raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if kind != "dynamic":
        return raw
    alpha = params.get("alpha", scaling.get("alpha"))
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise UnsupportedModelError("hunyuan_v1_moe with RoPE \"dynamic\" but no positive alpha is not supported: "
                                    "Tandem runs its fixed-alpha form (transformers' ntk_alpha)")
    dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rest = {k: v for k, v in raw.items() if k != "rope_scaling"}
    return rest | {"rope_parameters": {"rope_type": "default", "rope_theta": theta * alpha ** (dim / (dim - 2))}}


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "num_experts", "moe_topk", "intermediate_size")
    width = raw["intermediate_size"]
    for key, allowed in (("moe_intermediate_size", width), ("num_shared_expert", 1)):
        if key in raw and one_value(raw, key) != allowed:
            raise UnsupportedModelError(f"hunyuan_v1_moe with {key} {one_value(raw, key)} is not supported: "
                                        f"transformers builds experts of intermediate_size ({width}) and one shared "
                                        "expert")
    bias = raw.get("attention_bias", False)
    return ModelConfig(
        **decoder_fields(ntk_alpha(raw), eps=1e-5, theta=10000.0, max_pos=2048),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        qk_norm_after_rope=True,
        num_experts=one_value(raw, "num_experts"),
        top_k=one_value(raw, "moe_topk"),
        moe_intermediate_size=width,
        shared_expert_intermediate_size=width,
        norm_topk_prob=True,
    )


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    """As llama.cpp's converter writes HunYuan MoE (its HunYuanMoEModel): the base already stretched by alpha (plain
    RoPE), the experts' width, top-k and the shared expert's count."""
    a = "hunyuan-moe"
    return common_config(meta, a, vocab) | {
        "model_type": "hunyuan_v1_moe", "num_experts": read_int(meta, f"{a}.expert_count", bound="num_local_experts"),
        "moe_topk": read_int(meta, f"{a}.expert_used_count", bound="num_experts_per_tok"),
        "intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length"),
        "num_shared_expert": read_int(meta, f"{a}.expert_shared_count", 1)}


SPEC = FamilySpec(
    "hunyuan_v1_moe", "HunYuan MoE", parse,
    tiny={"intermediate_size": 48, "num_experts": 8, "moe_topk": 2, "head_dim": 16, "tie_word_embeddings": False},
    shapes=(BenchShape("hunyuan-a13b", "tencent/Hunyuan-A13B-Instruct", {
        "vocab_size": 128167, "hidden_size": 4096, "intermediate_size": 3072, "moe_intermediate_size": [3072] * 32,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "num_experts": 64, "moe_topk": [8] * 32, "num_shared_expert": [1] * 32,
        "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0}, "rope_theta": 10000.0,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "attention_bias": False, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 127960,
    }, aliases=("hunyuan",)),),
    router="gate.wg", shared_expert="shared_mlp", shared_expert_gate=None,
    qk_norms=("query_layernorm", "key_layernorm"),
    gguf=GGUFArch("hunyuan-moe", gguf_config),
)
