"""The architecture of a decoder-only MoE model, normalised across families.

Every family parses its `config.json` into this one dataclass; the decoder, the weight-name spec and
the RAM estimate read only from it. Fields are what the forward pass needs, nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from runtime.errors import UnsupportedModelError

QKNorm = Literal["none", "head", "full"]  # no q/k norm; RMSNorm per head (Qwen3); over the projection (OLMoE)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # attention variant
    qkv_bias: bool
    o_bias: bool
    qk_norm: QKNorm
    clip_qkv: float | None
    # mixture of experts
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0 = no shared expert
    dense_intermediate_size: int  # for layers without experts (0 if there are none)
    sparse_layers: tuple[bool, ...]  # per layer: True if its feed-forward is a MoE block
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None = None

    @property
    def num_moe_layers(self) -> int:
        return sum(self.sparse_layers)


def rope_theta(raw: dict[str, Any], default: float) -> float:
    """`rope_theta` from either the transformers 5 `rope_parameters` dict or the older flat keys."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(
            f"RoPE scaling type {rope_type!r} is not supported yet (only plain RoPE with rope_theta); "
            "remove 'rope_scaling' from config.json to run it with a shorter context"
        )
    return float(params.get("rope_theta", raw.get("rope_theta", default)))


def token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def sparse_layer_pattern(raw: dict[str, Any], num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Qwen-style dense/sparse interleaving: `decoder_sparse_step` and `mlp_only_layers`."""
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def require(raw: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if k not in raw]
    if missing:
        raise UnsupportedModelError(
            f"config.json of this {raw.get('model_type')} model lacks {', '.join(missing)}; "
            "is it a complete Hugging Face config?"
        )


def decoder_fields(raw: dict[str, Any], *, eps: float, theta: float, max_pos: int) -> dict[str, Any]:
    """The fields every family reads the same way (with its own defaults)."""
    require(raw, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    heads = raw["num_attention_heads"]
    return {
        "model_type": raw["model_type"],
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "num_layers": raw["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": raw.get("num_key_value_heads") or heads,
        "head_dim": raw.get("head_dim") or raw["hidden_size"] // heads,
        "rms_norm_eps": raw.get("rms_norm_eps", eps),
        "rope_theta": rope_theta(raw, theta),
        "max_position_embeddings": raw.get("max_position_embeddings", max_pos),
        "tie_word_embeddings": raw.get("tie_word_embeddings", False),
        "eos_token_ids": token_ids(raw.get("eos_token_id")),
        "bos_token_id": raw.get("bos_token_id"),
    }
