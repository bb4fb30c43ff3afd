"""The decoder's layer kinds by name, and the plan that says which kind each layer is.

A decoder layer is a token mixer and a feed-forward (runtime/layer_kind.py), each after a norm and into the residual
stream. A family declares its layers in its config: `ModelConfig.mixers` (each layer's mixer by name; by default
"attention", or "mla" where the config has `kv_lora_rank`) and `ModelConfig.sparse_layers` (routed experts, or a
dense feed-forward; with `ModelConfig.parallel_dense`, routed experts beside a dense MLP: runtime/parallel.py). The
decoder (runtime/model.py), its builder (runtime/build.py), the decode step (runtime/decode_step.py) and the tensor
list (runtime/weights.py) reach a layer only through `plan(cfg)`'s kinds, never by asking which family they run. A
new kind: its module (weights, load, reference, cache or state, fast paths) and its name here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.attention import GroupedQueryAttention
from tandem.runtime.config import ModelConfig
from tandem.runtime.layer_kind import FeedForward, Mixer
from tandem.runtime.mla import LatentAttention
from tandem.runtime.moe import DenseFeedForward, RoutedExperts
from tandem.runtime.parallel import DenseBesideExperts

MIXERS: dict[str, Mixer] = {kind.name: kind for kind in (GroupedQueryAttention(), LatentAttention())}
FEED_FORWARDS: dict[str, FeedForward] = {kind.name: kind for kind in (RoutedExperts(), DenseFeedForward(),
                                                                      DenseBesideExperts())}


@dataclass(frozen=True)
class LayerPlan:
    """One layer's kinds."""

    mixer: Mixer
    ffn: FeedForward


def plan(cfg: ModelConfig) -> tuple[LayerPlan, ...]:
    """Each layer's kinds, as the config declares them."""
    unknown = sorted(set(cfg.mixers) - MIXERS.keys())
    if unknown:
        raise UnsupportedModelError(f"token mixer {unknown[0]!r} is not supported yet; Tandem runs "
                                    f"{', '.join(sorted(MIXERS))}")
    routed, dense = FEED_FORWARDS["parallel" if cfg.parallel_dense else "routed"], FEED_FORWARDS["dense"]
    return tuple(LayerPlan(MIXERS[m], routed if sparse else dense)
                 for m, sparse in zip(cfg.mixers, cfg.sparse_layers, strict=True))


def cache_class(cfg: ModelConfig) -> type:
    """The cache the model's layers keep (`KVCache`, `LatentCache`). One class serves every layer of a model: a plan
    whose mixers keep different caches is refused until the decoder keeps a cache per kind."""
    kinds = {layer.mixer.cache for layer in plan(cfg)}
    if len(kinds) > 1:
        raise UnsupportedModelError("this model mixes token mixers that keep different caches "
                                    f"({', '.join(sorted(set(cfg.mixers)))}); that is not supported yet")
    return kinds.pop()
