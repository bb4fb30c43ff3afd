"""LFM2-MoE (LFM2-8B-A1B): a hybrid of gated short convolutions (runtime/shortconv.py: a rolling state of the last
inputs, no KV cache) on most layers and grouped-query attention on a few (`layer_types` "conv" / "full_attention"),
the first `num_dense_layers` feed-forwards a dense SwiGLU, the others routed experts.

What differs from the plain decoder, as transformers' `modeling_lfm2_moe.py` computes it:
- attention's per-head q/k RMSNorms (`q_layernorm`, `k_layernorm`), its output projection named `out_proj`;
- sigmoid router scores, an `expert_bias` added for choosing only (`use_expert_bias`), the chosen renormalised
  (`norm_topk_prob`) and times `routed_scaling_factor`; no shared expert;
- the files' names: `operator_norm` and `ffn_norm` around each half of a layer, `feed_forward` for the MoE block and
  the dense SwiGLU (w1, w3, w2: gate, up, down), the final norm `model.embedding_norm`."""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import CheckpointError, UnsupportedModelError
from tandem.runtime.config import ModelConfig, decoder_fields, dense_first_pattern, require
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.gguf_meta import Meta, common_config, per_layer, read_float, read_int
from tandem.runtime.gguf_source import Source

MIXER = {"conv": "shortconv", "full_attention": "attention"}


def mixers(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if not isinstance(types, list) or len(types) != layers or any(t not in MIXER for t in types):
        raise CheckpointError(f"config.json's layer_types must list {layers} entries, each one of "
                              f"{', '.join(MIXER)}; it is {types!r}")
    return tuple(MIXER[t] for t in types)


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "num_experts", "num_experts_per_tok", "moe_intermediate_size", "layer_types")
    layers = raw["num_hidden_layers"]
    flat = raw | {"rms_norm_eps": raw.get("norm_eps", 1e-5),
                  "tie_word_embeddings": raw.get("tie_embedding", raw.get("tie_word_embeddings", True))}
    sparse = dense_first_pattern({"first_k_dense_replace": raw.get("num_dense_layers", 2)}, layers)
    return ModelConfig(
        **decoder_fields(flat, eps=1e-5, theta=1000000.0, max_pos=128000),
        mixers=mixers(raw, layers),
        qk_norm="head",
        num_experts=raw["num_experts"],
        top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob", True),
        dense_intermediate_size=raw.get("intermediate_size", 7168) if not all(sparse) else 0,
        sparse_layers=sparse,
        scoring="sigmoid",
        router_correction=bool(raw.get("use_expert_bias", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        conv_kernel=raw.get("conv_L_cache", 3),
        conv_bias=bool(raw.get("conv_bias", False)),
    )


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    """llama.cpp's `lfm2moe` files: key/value heads per layer (0 in the convolution layers: their kind), the
    dense layers first, the short convolutions' width, sigmoid routing (expert_gating_func 2) with an expert bias
    where the file holds one."""
    a = "lfm2moe"
    kv = per_layer(meta, f"{a}.attention.head_count_kv", read_int(meta, f"{a}.block_count",
                                                                  bound="num_hidden_layers"), int,
                   "")
    raw = common_config(meta | {f"{a}.attention.head_count_kv": max(kv) or 1}, a, vocab)
    if read_int(meta, f"{a}.expert_gating_func", 2) != 2:
        raise UnsupportedModelError("this lfm2moe file routes its experts otherwise than by sigmoid scores; Tandem "
                                    "runs LFM2-MoE as published")
    return raw | {
        "model_type": "lfm2_moe", "norm_eps": raw["rms_norm_eps"],
        "layer_types": ["full_attention" if k else "conv" for k in kv],
        "num_experts": read_int(meta, f"{a}.expert_count", bound="num_experts"),
        "moe_intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length", bound="moe_intermediate_size"),
        "intermediate_size": read_int(meta, f"{a}.feed_forward_length", 0) or 1,
        "num_dense_layers": read_int(meta, f"{a}.leading_dense_block_count", 0, "num_dense_layers"),
        "conv_L_cache": read_int(meta, f"{a}.shortconv.l_cache", bound="conv_L_cache"),
        "conv_bias": any(n.endswith("shortconv.conv.bias") for n in types),
        "use_expert_bias": any(n.endswith("exp_probs_b.bias") for n in types),
        "routed_scaling_factor": read_float(meta, f"{a}.expert_weights_scale", 1.0),
        "norm_topk_prob": True,
        "tie_word_embeddings": "output.weight" not in types,
    }


def gguf_sources(cfg: ModelConfig) -> dict[str, Source]:
    """LFM2's own GGUF names: its final norm as `token_embd_norm`, its convolutions under `shortconv.`."""
    conv = {f"conv.{part}.{kind}": Source(f"shortconv.{part}.{kind}") for part in ("conv", "in_proj", "out_proj")
            for kind in ("weight", "bias")}
    return conv | {"model.norm.weight": Source("token_embd_norm.weight"),
                   "self_attn.q_layernorm.weight": Source("attn_q_norm.weight"),
                   "self_attn.k_layernorm.weight": Source("attn_k_norm.weight")}


SPEC = FamilySpec(
    "lfm2_moe", "LFM2-MoE", parse,
    tiny={"intermediate_size": 96, "moe_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
          "num_dense_layers": 1, "conv_L_cache": 3, "norm_eps": 1e-6, "layer_types": ["conv", "full_attention"],
          "use_expert_bias": True, "routed_scaling_factor": 1.0, "tie_word_embeddings": True},
    shapes=(BenchShape("lfm2-8b-a1b", "LiquidAI/LFM2-8B-A1B", {
        "vocab_size": 65536, "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 7168, "moe_intermediate_size": 1792, "num_experts": 32,
        "num_experts_per_tok": 4, "num_dense_layers": 2, "conv_L_cache": 3, "norm_eps": 1e-5,
        "use_expert_bias": True, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "rope_theta": 1000000.0,
        "max_position_embeddings": 128000, "tie_word_embeddings": True, "eos_token_id": 7,
        "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv",
                        "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv",
                        "full_attention", "conv", "conv", "full_attention", "conv", "conv"]},
        aliases=("lfm2-moe",)),),
    moe_prefix="feed_forward",
    dense_mlp="feed_forward",
    expert_proj=("w1", "w3", "w2"),
    qk_norms=("q_layernorm", "k_layernorm"),
    correction="expert_bias",
    shared_expert_gate=None,
    renames=(("input_layernorm.", "operator_norm."), ("post_attention_layernorm.", "ffn_norm."),
             ("model.norm.", "model.embedding_norm."), ("self_attn.o_proj.", "self_attn.out_proj."),
             ("feed_forward.gate_proj.", "feed_forward.w1."), ("feed_forward.up_proj.", "feed_forward.w3."),
             ("feed_forward.down_proj.", "feed_forward.w2.")),
    gguf=GGUFArch("lfm2moe", gguf_config, sources=gguf_sources),
)
