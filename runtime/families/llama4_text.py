"""Llama 4 (`llama4_text`: Llama-4-Scout-17B-16E, -Maverick-17B-128E, their text model): attention in chunks with a
global layer without RoPE every few layers, and one routed expert a token beside a shared one.

What differs from the plain decoder, each as transformers' `modeling_llama4.py` computes it:
- RoPE over adjacent pairs of dims (`rope_interleave`), Llama 3's scaling where the config asks (Scout);
- the layers listed by `no_rope_layers` (0: no RoPE; default every `no_rope_layer_interval`-th) rotate nothing,
  see every earlier position, and scale their queries by the position's temperature (`attn_temperature_tuning`,
  `floor_scale`, `attn_scale`); the others attend within chunks of `attention_chunk_size` positions and, with
  `use_qk_norm`, scale each head of the rotated q and k to unit RMS (no weight: "l2");
- the router takes the top logit (one expert a token), its sigmoid is the weight, and the expert takes the token
  times that weight (`scale_expert_input`); a shared SwiGLU of the experts' width takes the token itself;
- experts on the layers `moe_layers` lists (default every `interleave_moe_layer_step`-th), the others a SwiGLU of
  `intermediate_size_mlp`, under `feed_forward` both; the experts stored as x @ W (`experts.gate_up_proj` [E, H,
  2I], `experts.down_proj` [E, I, H]).

Published checkpoints hold the whole model (`llama4`, with its vision tower): Tandem opens the text model as its
own folder (`llama4_text`) or as llama.cpp's GGUF file, which keeps only the text model."""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import CheckpointError, UnsupportedModelError
from tandem.runtime.config import ModelConfig, decoder_fields, require
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.gguf_meta import Meta, common_config, read_int

# transformers' Llama4TextConfig defaults, for the keys a config.json may leave out
DEFAULTS: dict[str, Any] = {
    "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_local_experts": 16,
    "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
}


def layer_list(raw: dict[str, Any], key: str, layers: int) -> list[Any] | None:
    """A per-layer list of config.json (None where absent, or empty where transformers reads an empty one as absent:
    `no_rope_layers`, as the published configs have it), checked against the layer count."""
    value = raw.get(key)
    if value is None or value == [] and key == "no_rope_layers":
        return None
    if not isinstance(value, list) or len(value) != layers and key != "moe_layers":
        raise CheckpointError(f"config.json's {key} must be a list of one entry per layer ({layers}), not {value!r}")
    return value


def parse(raw: dict[str, Any]) -> ModelConfig:
    raw = DEFAULTS | raw
    require(raw, "num_hidden_layers")
    layers = raw["num_hidden_layers"]
    if raw["num_experts_per_tok"] != 1:
        raise UnsupportedModelError(f"llama4_text with num_experts_per_tok {raw['num_experts_per_tok']} is not "
                                    "supported: Tandem runs Llama 4's routing as published, one expert a token")
    step = raw["interleave_moe_layer_step"]
    moe = layer_list(raw, "moe_layers", layers)
    moe = set(range(step - 1, layers, step) if moe is None else moe)
    if any(not isinstance(i, int) or not 0 <= i < layers for i in moe):
        raise CheckpointError(f"config.json's moe_layers must list layer numbers from 0 to {layers - 1}")
    ropes = layer_list(raw, "no_rope_layers", layers)  # (1: the layer rotates)
    interval = raw["no_rope_layer_interval"]
    nope = tuple(not r for r in ropes) if ropes else tuple((i + 1) % interval == 0 for i in range(layers))
    chunk = raw["attention_chunk_size"]
    types = layer_list(raw, "layer_types", layers)
    chunked = tuple(t == "chunked_attention" for t in types) if types else \
        tuple(not n and chunk is not None for n in nope)
    bias = raw.get("attention_bias", False)
    return ModelConfig(
        **decoder_fields(raw, eps=1e-5, theta=500000.0, max_pos=131072),
        num_experts=raw["num_local_experts"],
        top_k=1,
        moe_intermediate_size=raw["intermediate_size"],
        shared_expert_intermediate_size=raw["intermediate_size"],
        dense_intermediate_size=raw["intermediate_size_mlp"],
        sparse_layers=tuple(i in moe for i in range(layers)),
        norm_topk_prob=False,
        scoring="sigmoid",
        scale_expert_input=True,
        qkv_bias=bias,
        o_bias=bias,
        rope_interleave=True,
        qk_norm="l2" if raw["use_qk_norm"] else "none",
        qk_norm_after_rope=bool(raw["use_qk_norm"]),
        attention_chunk=chunk,
        chunked_layers=chunked,
        nope_layers=nope,
        attention_temperature=(float(raw["floor_scale"]), float(raw["attn_scale"]))
        if raw["attn_temperature_tuning"] else None,
    )


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    """As llama.cpp reads its `llama4` files: the experts' width and interleave step from the metadata, the rest as
    llama.cpp fixes it (chunks of 8192 with every fourth layer global and without RoPE, the temperature's 8192 and
    0.1, q/k norms unless the model has 128 experts: Maverick)."""
    a = "llama4"
    experts = read_int(meta, f"{a}.expert_count", bound="num_local_experts")
    if f"{a}.attention.sliding_window" in meta and read_int(meta, f"{a}.attention.sliding_window") == 0:
        raise UnsupportedModelError("this llama4 GGUF file turns chunked attention off (sliding_window 0, as "
                                    "llama.cpp writes MobileLLM-style models); Tandem runs Llama 4 as published")
    return common_config(meta, a, vocab) | {
        "model_type": "llama4_text", "num_local_experts": experts,
        "intermediate_size": read_int(meta, f"{a}.expert_feed_forward_length"),
        "intermediate_size_mlp": read_int(meta, f"{a}.feed_forward_length"),
        "interleave_moe_layer_step": read_int(meta, f"{a}.interleave_moe_layer_step"),
        "use_qk_norm": experts != 128, "attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1,
    }


SPEC = FamilySpec(
    "llama4_text", "Llama 4", parse,
    tiny={"intermediate_size": 48, "intermediate_size_mlp": 96, "num_local_experts": 8, "head_dim": 16,
          "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2, "attention_chunk_size": 4, "floor_scale": 4,
          "attn_scale": 0.5, "tie_word_embeddings": False},
    shapes=(
        BenchShape("llama4-scout", "meta-llama/Llama-4-Scout-17B-16E-Instruct", {
            "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
            "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
            "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
            "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            "rope_theta": 500000.0, "max_position_embeddings": 10485760, "rms_norm_eps": 1e-5,
            "attention_chunk_size": 8192, "use_qk_norm": True, "tie_word_embeddings": False,
            "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
        }, aliases=("scout", "llama4")),
        BenchShape("llama4-maverick", "meta-llama/Llama-4-Maverick-17B-128E-Instruct", {
            "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
            "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
            "num_local_experts": 128, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
            "rope_theta": 500000.0, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5,
            "attention_chunk_size": 8192, "use_qk_norm": False, "tie_word_embeddings": False,
            "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
        }, aliases=("maverick",)),
    ),
    moe_prefix="feed_forward", router="router", dense_mlp="feed_forward",
    stacked_experts=("experts.gate_up_proj", "experts.down_proj"), stacked_by_input=True,
    shared_expert="shared_expert", shared_expert_gate=None,
    gguf=GGUFArch("llama4", gguf_config),
)
