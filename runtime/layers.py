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
from tandem.runtime.deltanet import GatedDeltaNet
from tandem.runtime.layer_kind import FeedForward, Mixer
from tandem.runtime.mamba2 import Mamba2
from tandem.runtime.mla import LatentAttention
from tandem.runtime.moe import DenseFeedForward, RoutedExperts
from tandem.runtime.parallel import DenseBesideExperts
from tandem.runtime.shortconv import ShortConv
from tandem.runtime.state import LayerCaches

MIXERS: dict[str, Mixer] = {kind.name: kind for kind in (GroupedQueryAttention(), LatentAttention(),
                                                          GatedDeltaNet(), ShortConv(), Mamba2())}
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
    """The cache the model's layers keep: their mixers' (`KVCache`, `LatentCache`, a recurrent state), or, where
    they keep different kinds (a hybrid), a `LayerCaches` of one of each."""
    kinds = {layer.mixer.cache for layer in plan(cfg)}
    return kinds.pop() if len(kinds) == 1 else LayerCaches


def cache_in_ram_serves(cfg: ModelConfig) -> bool:
    """Whether every layer's mixer can keep its cache in RAM beside an accelerator and run on the CPU there
    (`Mixer.host_cache`: batch mode's MoE-Lightning split)."""
    return all(layer.mixer.host_cache for layer in plan(cfg))
