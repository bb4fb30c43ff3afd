"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid. Three layers of four mix tokens with Gated DeltaNet
(runtime/deltanet.py: a recurrent state, no KV cache), the fourth with gated attention; every feed-forward routed
experts with a shared expert behind a sigmoid gate (as Qwen2-MoE).

What differs from the plain decoder, as transformers' `modeling_qwen3_next.py` computes it:
- `layer_types` ("linear_attention" / "full_attention"; else every `full_attention_interval`-th layer attends);
- the decoder's RMSNorms, and attention's per-head q/k norms, multiply by 1 + weight (zero-centred: the files store
  weight - 1);
- attention: q_proj gives each head its query and a gate, the heads' output times sigmoid(gate) before o_proj; RoPE
  turns a quarter of each head (`partial_rotary_factor`);
- Gated DeltaNet's projections stored as in_proj_qkvz and in_proj_ba, rows grouped by key head."""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import CheckpointError
from tandem.runtime.config import ModelConfig, decoder_fields, require, sparse_layer_pattern
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.families.glm4_moe import rotary_dim
from tandem.runtime.gguf_meta import Meta, common_config, per_layer, read_int
from tandem.runtime.gguf_source import Source

MIXER = {"linear_attention": "deltanet", "full_attention": "attention"}


def mixers(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Each layer's mixer, from `layer_types` (else every `full_attention_interval`-th layer attends)."""
    types = raw.get("layer_types")
    if types is None:
        interval = raw.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= 1024:
            raise CheckpointError(f"config.json's full_attention_interval is {interval!r}, but it must be a whole "
                                  "number from 1 to 1024; fix config.json")
        return tuple("attention" if (i + 1) % interval == 0 else "deltanet" for i in range(layers))
    if not isinstance(types, list) or len(types) != layers or any(t not in MIXER for t in types):
        raise CheckpointError(f"config.json's layer_types must list {layers} entries, each one of "
                              f"{', '.join(MIXER)}; it is {types!r}")
    return tuple(MIXER[t] for t in types)


def hybrid_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """What Qwen3-Next and Qwen3.5 share: the mixers, their geometry, gated attention, zero-centred norms, partial
    RoPE (multimodal RoPE's sections dropped: a text's positions are one number, for which it is plain RoPE)."""
    require(raw, "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim")
    if raw["linear_num_value_heads"] % raw["linear_num_key_heads"]:
        raise CheckpointError(f"config.json's linear_num_value_heads ({raw['linear_num_value_heads']}) must be a "
                              f"multiple of linear_num_key_heads ({raw['linear_num_key_heads']}); fix config.json")
    if raw["linear_conv_kernel_dim"] < 2:
        raise CheckpointError("config.json's linear_conv_kernel_dim must be at least 2; fix config.json")
    params = {k: v for k, v in (raw.get("rope_parameters") or {}).items() if not k.startswith("mrope")}
    flat = raw | {"rope_parameters": params} if params else raw
    fields = decoder_fields(flat, eps=1e-6, theta=10000.0, max_pos=32768)
    partial = {"partial_rotary_factor": raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 0.25))}
    return fields | {
        "mixers": mixers(raw, raw["num_hidden_layers"]),
        "rotary_dim": rotary_dim(flat | {"rope_parameters": params | partial}, fields["head_dim"]),
        "qkv_bias": raw.get("attention_bias", False),
        "o_bias": raw.get("attention_bias", False),
        "qk_norm": "head",
        "norm_offset": 1.0,
        "attention_gate": True,
        "linear_key_heads": raw["linear_num_key_heads"],
        "linear_value_heads": raw["linear_num_value_heads"],
        "linear_key_dim": raw["linear_key_head_dim"],
        "linear_value_dim": raw["linear_value_head_dim"],
        "conv_kernel": raw["linear_conv_kernel_dim"],
        "linear_tiled": bool(raw.get("linear_value_heads_tiled", False)),  # (llama.cpp's Qwen3.5 files)
    }


def hybrid_gguf_config(meta: Meta, arch: str, vocab: int) -> dict[str, Any]:
    """What llama.cpp's Qwen3-Next and Qwen3.5 files say alike, as config.json would (the converter's ssm.* keys:
    conv_kernel, state_size the key head dim, group_count the key heads, time_step_rank the value heads, inner_size
    all value dims; recurrent_layers each layer's kind)."""
    a = arch
    out = common_config(meta, a, vocab)
    blocks = out["num_hidden_layers"]
    out["num_hidden_layers"] -= read_int(meta, f"{a}.nextn_predict_layers", 0)  # (its multi-token prediction
    # layers, counted in block_count: not run, as transformers does not)
    layers, values = out["num_hidden_layers"], read_int(meta, f"{a}.ssm.time_step_rank", bound="linear_num_value_heads")
    if f"{a}.attention.recurrent_layers" in meta:  # (newer converters write each layer's kind; llama.cpp otherwise
        # takes every full_attention_interval-th layer as attention)
        recurrent = per_layer(meta, f"{a}.attention.recurrent_layers", blocks, bool)[:layers]
    else:
        interval = read_int(meta, f"{a}.full_attention_interval", 4, "decoder_sparse_step")
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    head = out.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
    return out | {
        "num_experts": read_int(meta, f"{a}.expert_count", bound="num_experts"),
        "moe_intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length", bound="moe_intermediate_size"),
        "shared_expert_intermediate_size": read_int(meta, f"{a}.expert_shared_feed_forward_length", 0),
        "linear_conv_kernel_dim": read_int(meta, f"{a}.ssm.conv_kernel", bound="linear_conv_kernel_dim"),
        "linear_key_head_dim": read_int(meta, f"{a}.ssm.state_size", bound="linear_key_head_dim"),
        "linear_num_key_heads": read_int(meta, f"{a}.ssm.group_count", bound="linear_num_key_heads"),
        "linear_num_value_heads": values,
        "linear_value_head_dim": read_int(meta, f"{a}.ssm.inner_size") // values,
        "partial_rotary_factor": read_int(meta, f"{a}.rope.dimension_count", head) / head,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "norm_topk_prob": True,
    }


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    return hybrid_gguf_config(meta, "qwen3next", vocab) | {
        "model_type": "qwen3_next", "intermediate_size": read_int(meta, "qwen3next.feed_forward_length", 0) or 1,
        "decoder_sparse_step": 1, "mlp_only_layers": []}


def gguf_sources(cfg: ModelConfig, split: bool = False) -> dict[str, Source]:
    """The tensors llama.cpp's converter changed (convert_hf_to_gguf.py Qwen3NextModel): the norms stored plus
    one, A as -exp(A_log), q, k and v in one tensor and z (the gate) in another; Qwen3-Next's b and a in one
    (`ssm_ba`, rows grouped by key head: picked apart here), Qwen3.5's apart (`split`)."""
    out = {
        "model.norm.weight": Source("output_norm.weight", value="less_one"),
        "input_layernorm.weight": Source("attn_norm.weight", value="less_one"),
        "post_attention_layernorm.weight": Source("post_attention_norm.weight", value="less_one"),
        "self_attn.q_norm.weight": Source("attn_q_norm.weight", value="less_one"),
        "self_attn.k_norm.weight": Source("attn_k_norm.weight", value="less_one"),
        "linear_attn.in_proj_qkv.weight": Source("attn_qkv.weight"),
        "linear_attn.in_proj_z.weight": Source("attn_gate.weight"),
        "linear_attn.conv1d.weight": Source("ssm_conv1d.weight"),
        "linear_attn.dt_bias": Source("ssm_dt.bias"),
        "linear_attn.A_log": Source("ssm_a", value="log_neg"),
        "linear_attn.norm.weight": Source("ssm_norm.weight"),
        "linear_attn.out_proj.weight": Source("ssm_out.weight"),
    }
    if split:
        return out | {"linear_attn.in_proj_b.weight": Source("ssm_beta.weight"),
                      "linear_attn.in_proj_a.weight": Source("ssm_alpha.weight")}
    r = cfg.linear_value_heads // cfg.linear_key_heads  # ssm_ba: per key head its r b rows, then its r a rows
    b = tuple(k * 2 * r + j for k in range(cfg.linear_key_heads) for j in range(r))
    return out | {"linear_attn.in_proj_b.weight": Source("ssm_ba.weight", pick=b),
                  "linear_attn.in_proj_a.weight": Source("ssm_ba.weight", pick=tuple(i + r for i in b))}


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    layers = raw["num_hidden_layers"]
    sparse = sparse_layer_pattern(raw, layers, raw["num_experts"])
    return ModelConfig(
        **hybrid_fields(raw),
        num_experts=raw["num_experts"],
        top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob", True),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0) or 0,
        dense_intermediate_size=raw.get("intermediate_size", 0) if not all(sparse) else 0,
        sparse_layers=sparse,
    )


# the linear mixers' geometry of the tiny test configs (heads of 16: Qwen3-Next's 2 value heads per key head)
TINY_LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
               "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "head_dim": 16,
               "partial_rotary_factor": 0.25, "layer_types": ["linear_attention", "full_attention"]}

SPEC = FamilySpec(
    "qwen3_next", "Qwen3-Next", parse,
    tiny={"intermediate_size": 96, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 64,
          "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, **TINY_LINEAR},
    shapes=(BenchShape("qwen3-next-80b-a3b", "Qwen/Qwen3-Next-80B-A3B-Instruct", {
        "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10,
        "norm_topk_prob": True, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4, "partial_rotary_factor": 0.25, "rope_theta": 10000000.0,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "eos_token_id": 151645}, aliases=("qwen3-next",)),),
    deltanet_grouped=True,
    gguf=GGUFArch("qwen3next", gguf_config, sources=gguf_sources, spec={"deltanet_grouped": False}),
)
