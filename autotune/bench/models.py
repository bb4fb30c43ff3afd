"""`tandem make-bench-model`: random-weight checkpoints of published models' shapes (every dimension as published,
from the table in `shapes`), with trained-like routing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.autotune.bench.shapes import checkpoint_shapes, find_shape
from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.synth import write_test_model

DEFAULT_SKEW = 0.15  # a few popular experts per layer
DEFAULT_ROUTER_SCALE = 10.0  # token-dependence of routing: the next token reuses about half of a layer's experts, as
# in a trained model (measured per scale: docs/bench/README.md)


EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # the families' names for the count
TOP_K_KEYS = ("num_experts_per_tok", "top_k_experts")
PER_LAYER_LISTS = ("layer_types", "no_rope_layers")  # config lists of one entry per layer


def bench_config(shape: str, layers: int | None = None, experts: int | None = None,
                 heads: int | None = None) -> dict[str, Any]:
    """The shape's config.json; `layers`, `experts` and `heads` (query heads) scale it down (a full-depth model with
    fewer experts a layer, or narrower attention, fits a disk or RAM the real one would not). Grouped routing falls
    back to one group when the groups no longer divide the experts."""
    try:
        found = find_shape(shape)
    except KeyError:
        known = ", ".join(checkpoint_shapes())
        raise UnsupportedModelError(f"unknown shape {shape!r}; choose one of {known}") from None
    if found.config is None:
        raise UnsupportedModelError(f"--shape {shape}: {found.refused}")
    config = dict(found.config)
    if layers is not None:
        before = config["num_hidden_layers"]
        config["num_hidden_layers"] = max(1, min(layers, before))
        for key in PER_LAYER_LISTS:  # the first layers' entries (Gemma 4's first six: five sliding, one global)
            if isinstance(config.get(key), list) and len(config[key]) == before:
                config[key] = config[key][: config["num_hidden_layers"]]
    if experts is not None:
        top_k = max(config.get(k, 1) for k in TOP_K_KEYS)
        if experts < top_k:
            raise UnsupportedModelError(f"--experts {experts}: each token picks {top_k} experts, so a layer needs at "
                                        f"least {top_k}")
        for key in EXPERT_KEYS:
            if key in config:
                config[key] = min(experts, config[key])
        if config.get("n_group", 1) > 1 and experts % config["n_group"]:
            config["n_group"] = config["topk_group"] = 1
    if heads is not None:
        kv = config.get("num_key_value_heads") or config["num_attention_heads"]
        if heads % kv or heads > config["num_attention_heads"]:
            raise UnsupportedModelError(f"--attention-heads {heads}: it must be a multiple of the {kv} key/value "
                                        f"heads and at most the {config['num_attention_heads']} the model has")
        config["num_attention_heads"] = heads
    return config


# the quantization_config gpt-oss publishes its MXFP4 experts with
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def make_bench_model(shape: str, out: str | Path, layers: int | None = None, dtype: torch.dtype = torch.bfloat16,
                     routing_skew: float = DEFAULT_SKEW, router_scale: float = DEFAULT_ROUTER_SCALE, seed: int = 0,
                     experts: int | None = None, mxfp4: bool = False, heads: int | None = None,
                     **overrides: Any) -> Path:
    """Write a random-weight checkpoint of the real shape, one shard (≤ 2 GiB) at a time. `mxfp4`: the experts as
    gpt-oss publishes them (random MXFP4 codes and scales), the rest in `dtype`."""
    config = bench_config(shape, layers, experts, heads) | overrides
    vocab = config["vocab_size"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # (a smaller vocabulary than published: the
        ids = config.get(key)  # special tokens it no longer has are left out, as config checks refuse them)
        if isinstance(ids, list):
            config[key] = [i for i in ids if isinstance(i, int) and 0 <= i < vocab] or None
        elif isinstance(ids, int) and not 0 <= ids < vocab:
            config[key] = None
    config.setdefault("architectures", [causal_lm_class(config["model_type"])])  # as save_pretrained writes it:
    # what other tools read first (llama.cpp's convert_hf_to_gguf.py finds the model's kind by it alone)
    if mxfp4:
        if config["model_type"] != "gpt_oss":
            raise UnsupportedModelError(f"--dtype mxfp4: {shape} is not published with MXFP4 experts (gpt-oss is)")
        config["quantization_config"] = MXFP4_CONFIG
    return write_test_model(out, config, seed=seed, dtype=dtype, std=0.02, routing_skew=routing_skew,
                            router_scale=router_scale)


def causal_lm_class(model_type: str) -> str:
    """transformers' causal language model class for a model type (its auto mapping; "<Type>ForCausalLM" for one
    it does not map)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or f"{model_type.title().replace('_', '')}ForCausalLM"


def reuse(sequence: np.ndarray) -> float:
    """Mean share of a layer's experts (batch 1) that the next token chooses again; sequence [steps, layers, k]."""
    steps, layers, k = sequence.shape
    shared = [len(set(sequence[t, i]) & set(sequence[t - 1, i])) / k
              for t in range(1, steps) for i in range(layers) if sequence[t, i, 0] >= 0]
    return float(np.mean(shared)) if shared else 0.0
