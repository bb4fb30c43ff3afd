"""What a family's router does over a decode, for planning without a recorded trace: how skewed each layer's expert
popularity is and how often a token keeps the previous token's experts. Stated per family with their sources; a
family without published figures is planned for as uniform routing with no reuse beyond chance, the assumption
that never promises an expert cache more than it delivers (record a trace for a better plan)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoutingStats:
    skew: float  # Zipf exponent of a layer's expert popularity (0: uniform), as `synthetic_trace` draws it
    reuse: float  # chance each of the previous token's experts is kept, before the rest are drawn
    source: str


# Fiddler (ICLR 2025) App. C, ShareGPT: the 56 most popular of Mixtral's 256 experts take 25.2% of the routings
# (uniform: 21.9%); a Zipf exponent of 0.14 gives that share. Collaborative inference (§II-B, Fig. 2), MMLU: at
# least one of a token's two experts was the previous token's 40-60% of the time; chance alone gives 46% with 8
# experts, and keeping each with probability 0.03 gives 50%, the middle of that range.
MIXTRAL = RoutingStats(0.14, 0.03, "Mixtral 8x7B: Fiddler App. C (popularity), collaborative inference §II-B (reuse)")
UNKNOWN = RoutingStats(0.0, 0.0, "no published routing statistics: uniform, no reuse beyond chance")

FAMILIES: dict[str, RoutingStats] = {
    "mixtral": MIXTRAL,
    # no published figures: Mixtral's (the same top-2 of few large experts) are assumed
    "phimoe": RoutingStats(MIXTRAL.skew, MIXTRAL.reuse, "Phi-3.5-MoE: none published; Mixtral's assumed"),
}


def routing_stats(model_type: str) -> RoutingStats:
    return FAMILIES.get(model_type, UNKNOWN)


def popularity(layers: int, experts: int, skew: float, seed: int = 0) -> np.ndarray:
    """[layers, experts] routing probabilities: Zipf weights 1/rank^skew in a random order per layer, summing to 1."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, experts + 1) ** skew
    table = np.stack([rng.permutation(weights) for _ in range(layers)])  # [layers, experts]
    return table / table.sum(1, keepdims=True)
