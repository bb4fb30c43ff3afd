"""Real model shapes for benchmark checkpoints (random weights, every dimension as published)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.synth import write_test_model

SHAPES: dict[str, dict[str, Any]] = {
    "mixtral": {  # Mixtral-8x7B
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rope_theta": 1e6, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "rope_theta": 1e6, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "eos_token_id": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    "olmoe": {  # OLMoE-1B-7B
        "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
        "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
        "num_experts_per_tok": 8, "norm_topk_prob": False, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "eos_token_id": 2, "clip_qkv": None,
    },
}
UNSUPPORTED = {"deepseek-v2-lite": "DeepSeek-V2 (multi-head latent attention) is not a supported family yet"}
DEFAULT_SKEW = 0.15  # a few popular experts per layer
DEFAULT_ROUTER_SCALE = 10.0  # token-dependence of routing: the next token reuses about half of a layer's experts, as
# in a trained model (measured per scale: docs/bench/README.md)


def bench_config(shape: str, layers: int | None = None) -> dict[str, Any]:
    if shape in UNSUPPORTED:
        raise UnsupportedModelError(f"--shape {shape}: {UNSUPPORTED[shape]}")
    if shape not in SHAPES:
        raise UnsupportedModelError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    config = dict(SHAPES[shape])
    if layers is not None:
        config["num_hidden_layers"] = max(1, min(layers, config["num_hidden_layers"]))
    return config


def make_bench_model(shape: str, out: str | Path, layers: int | None = None, dtype: torch.dtype = torch.bfloat16,
                     routing_skew: float = DEFAULT_SKEW, router_scale: float = DEFAULT_ROUTER_SCALE, seed: int = 0,
                     **overrides: Any) -> Path:
    """Write a random-weight checkpoint of the real shape, one shard (≤ 2 GiB) at a time."""
    config = bench_config(shape, layers) | overrides
    return write_test_model(out, config, seed=seed, dtype=dtype, std=0.02, routing_skew=routing_skew,
                            router_scale=router_scale)


def reuse(sequence: np.ndarray) -> float:
    """Mean share of a layer's experts (batch 1) that the next token chooses again; sequence [steps, layers, k]."""
    steps, layers, k = sequence.shape
    shared = [len(set(sequence[t, i]) & set(sequence[t - 1, i])) / k
              for t in range(1, steps) for i in range(layers) if sequence[t, i, 0] >= 0]
    return float(np.mean(shared)) if shared else 0.0
