"""Granite 4.0-H (`granitemoehybrid`: granite-4.0-h-tiny, -small): a hybrid of Mamba-2 layers (runtime/mamba2.py: a
state-space state, no KV cache) and attention layers (`layer_types`: "mamba" / "attention"), each layer's
feed-forward routed experts beside a shared SwiGLU, with Granite's muP multipliers (granitemoe.py).

What differs from Granite MoE with a shared expert (granitemoeshared.py), as transformers'
`modeling_granitemoehybrid.py` computes it: the Mamba-2 layers; attention without RoPE unless
`position_embedding_type` is "rope" (Granite 4.0-H's attention sees positions only through the Mamba layers)."""

from __future__ import annotations

from typing import Any

from tandem.kernels.errors import CheckpointError, UnsupportedModelError
from tandem.runtime.config import ModelConfig
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.families.granitemoe import MUP, granite_fields
from tandem.runtime.gguf_meta import Meta, common_config, per_layer, read_flag, read_float, read_int
from tandem.runtime.gguf_source import Source

MIXER = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "attention", "full_attention": "attention"}


def mixers(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Each layer's mixer from `layer_types` (or the older `layers_block_type`; every layer Mamba-2 without)."""
    types = raw.get("layer_types", raw.get("layers_block_type"))
    if types is None:
        return ("mamba2",) * layers
    if not isinstance(types, list) or len(types) != layers or any(t not in MIXER for t in types):
        raise CheckpointError(f"config.json's layer_types must list {layers} entries, each one of mamba, attention; "
                              f"it is {types!r}")
    return tuple(MIXER[t] for t in types)


def limit_value(v: Any) -> float | None:
    """A bound of `time_step_limit`: a number, or infinity as transformers writes it ({"__float__": "Infinity"});
    None if it is neither."""
    if isinstance(v, dict) and v.get("__float__") in ("Infinity", "-Infinity"):
        return float(v["__float__"].lower().replace("infinity", "inf"))
    if isinstance(v, int | float) and not isinstance(v, bool) and v == v:
        return float(v)
    return None


def ssm_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The Mamba-2 layers' geometry, checked as transformers checks it."""
    hidden, heads = raw["hidden_size"], raw.get("mamba_n_heads", 128)
    inner = raw.get("mamba_expand", 2) * hidden
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in ("auto", None) else head_dim
    groups = raw.get("mamba_n_groups", 1)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim * heads != inner:
        raise CheckpointError(f"config.json's mamba_d_head ({head_dim!r}) times mamba_n_heads ({heads}) must be "
                              f"mamba_expand times hidden_size ({inner}); fix config.json")
    if heads % groups:
        raise CheckpointError(f"config.json's mamba_n_heads ({heads}) must be a multiple of mamba_n_groups "
                              f"({groups}); fix config.json")
    given = raw.get("time_step_limit") or (0.0, float("inf"))
    limit = [limit_value(v) for v in given] if isinstance(given, list | tuple) else []
    if len(limit) != 2 or None in limit or not limit[0] <= limit[1]:  # type: ignore[operator]
        raise CheckpointError(f"config.json's time_step_limit must be two numbers, the lower first, not {given!r}")
    return {"ssm_heads": heads, "ssm_head_dim": head_dim, "ssm_state": raw.get("mamba_d_state", 256),
            "ssm_groups": groups, "ssm_bias": bool(raw.get("mamba_proj_bias", False)),
            "ssm_dt_limit": (float(limit[0]), float(limit[1])), "conv_kernel": raw.get("mamba_d_conv", 4),
            "conv_bias": bool(raw.get("mamba_conv_bias", True))}


def parse(raw: dict[str, Any]) -> ModelConfig:
    if not raw.get("num_local_experts"):
        raise UnsupportedModelError("this Granite 4.0-H model has no experts (num_local_experts 0: a dense model); "
                                    "Tandem runs its MoE models (granite-4.0-h-tiny, -small)")
    layers = raw["num_hidden_layers"]
    rope = raw.get("position_embedding_type") == "rope"
    return ModelConfig(**granite_fields(raw), **ssm_fields(raw), mixers=mixers(raw, layers),
                       shared_expert_intermediate_size=int(raw.get("shared_intermediate_size", 1024)),
                       nope_layers=() if rope else (True,) * layers)


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    """llama.cpp's `granitehybrid` files (its GraniteHybridModel): Granite MoE's keys and scales, key/value heads
    per layer (0 in the Mamba-2 layers: their kind), the ssm.* keys (inner_size the heads' values, time_step_rank
    the heads, group_count, state_size, conv_kernel); RoPE where the converter says so (rope.scaling.finetuned)."""
    a = "granitehybrid"
    layers = read_int(meta, f"{a}.block_count", bound="num_hidden_layers")
    kv = per_layer(meta, f"{a}.attention.head_count_kv", layers, int)  # (0: a Mamba-2 layer)
    raw = common_config(meta | {f"{a}.attention.head_count_kv": max(kv) or 1}, a, vocab)
    dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    heads = read_int(meta, f"{a}.ssm.time_step_rank", bound="mamba_n_heads")
    inner = read_int(meta, f"{a}.ssm.inner_size")
    return raw | {
        "model_type": "granitemoehybrid",
        "layer_types": ["attention" if k else "mamba" for k in kv],
        "num_local_experts": read_int(meta, f"{a}.expert_count", bound="num_local_experts"),
        "intermediate_size": read_int(meta, f"{a}.feed_forward_length"),  # (the experts' width)
        "shared_intermediate_size": read_int(meta, f"{a}.expert_shared_feed_forward_length", 0),
        "embedding_multiplier": read_float(meta, f"{a}.embedding_scale", 1.0),
        "residual_multiplier": read_float(meta, f"{a}.residual_scale", 1.0),
        "attention_multiplier": read_float(meta, f"{a}.attention.scale", dim ** -0.5),
        "logits_scaling": read_float(meta, f"{a}.logit_scale", 1.0),
        "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_expand": inner // raw["hidden_size"],
        "mamba_n_groups": read_int(meta, f"{a}.ssm.group_count", bound="mamba_n_groups"),
        "mamba_d_state": read_int(meta, f"{a}.ssm.state_size", bound="mamba_d_state"),
        "mamba_d_conv": read_int(meta, f"{a}.ssm.conv_kernel", bound="mamba_d_conv"),
        "mamba_conv_bias": any(n.endswith("ssm_conv1d.bias") for n in types),
        "mamba_proj_bias": any(n.endswith("ssm_in.bias") for n in types),
        # (the converter's flag for RoPE: set only where no layer is Mamba-2, so never in a hybrid's file)
        "position_embedding_type": "rope" if read_flag(meta, f"{a}.rope.scaling.finetuned", False) else "nope",
        "tie_word_embeddings": "output.weight" not in types,
    }


def gguf_sources(cfg: ModelConfig) -> dict[str, Source]:
    """The Mamba-2 tensors as llama.cpp names them (A stored as -exp(A_log))."""
    return {"mamba.in_proj.weight": Source("ssm_in.weight"), "mamba.in_proj.bias": Source("ssm_in.bias"),
            "mamba.conv1d.weight": Source("ssm_conv1d.weight"), "mamba.conv1d.bias": Source("ssm_conv1d.bias"),
            "mamba.dt_bias": Source("ssm_dt.bias"), "mamba.A_log": Source("ssm_a", value="log_neg"),
            "mamba.D": Source("ssm_d"), "mamba.norm.weight": Source("ssm_norm.weight"),
            "mamba.out_proj.weight": Source("ssm_out.weight"), "mamba.out_proj.bias": Source("ssm_out.bias")}


SPEC = FamilySpec(
    "granitemoehybrid", "Granite 4.0-H", parse,
    tiny={"intermediate_size": 48, "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 64,
          "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_head": 16, "mamba_expand": 2,
          "mamba_d_conv": 4, "mamba_chunk_size": 16, "layer_types": ["mamba", "attention"],
          "position_embedding_type": "nope", **MUP},
    shapes=(BenchShape("granite-4.0-h-small", "ibm-granite/granite-4.0-h-small", {
        "vocab_size": 100352, "hidden_size": 4096, "num_hidden_layers": 40, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 1536, "num_local_experts": 72, "num_experts_per_tok": 10,
        "shared_intermediate_size": 1536, "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 128,
        "mamba_d_head": 64, "mamba_expand": 2, "mamba_d_conv": 4, "mamba_conv_bias": True,
        "mamba_proj_bias": False, "position_embedding_type": "nope", "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "attention_multiplier": 0.0078125, "logits_scaling": 8.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": True, "eos_token_id": 100257,
        "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)]},
        aliases=("granite-4.0-h",)),),
    moe_prefix="block_sparse_moe", router="router.layer",
    stacked_experts=("input_linear.weight", "output_linear.weight"),
    shared_expert="shared_mlp", shared_expert_gate=None, shared_in_block=False,
    stacked_mlp=("input_linear", "output_linear"),
    gguf=GGUFArch("granitehybrid", gguf_config, rope_permuted=True, sources=gguf_sources),
)
