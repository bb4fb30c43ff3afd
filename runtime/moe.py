"""The reference MoE expert layer, in plain PyTorch. Every fast path is tested against it.

Letters: T tokens, H hidden size, E routed experts, K experts per token (top-k), I expert width, n tokens
routed to one expert.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RoutingRule:
    """Softmax over all experts, keep the top-k, optionally renormalise them to sum to one."""

    top_k: int
    normalize: bool


@dataclass(frozen=True)
class ExpertWeights:
    """One SwiGLU feed-forward network: down(silu(gate x) * up x). Weights may be memory-mapped views."""

    gate: torch.Tensor  # [I, H]
    up: torch.Tensor  # [I, H]
    down: torch.Tensor  # [H, I]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        dt = x.dtype  # weights stored in another dtype are converted per call, never kept converted
        return F.linear(F.silu(F.linear(x, self.gate.to(dt))) * F.linear(x, self.up.to(dt)), self.down.to(dt))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down))


@dataclass(frozen=True)
class SharedExpert:
    """An expert every token goes through (Qwen2-MoE), scaled by sigmoid(gate · x)."""

    mlp: ExpertWeights
    gate: torch.Tensor  # [1, H]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return torch.sigmoid(F.linear(x, self.gate)) * self.mlp(x)


@dataclass(frozen=True)
class MoEBlockWeights:
    """One MoE layer: router, routed experts (host: RAM copies or memory-mapped), routing rule, optional shared
    expert."""

    router: torch.Tensor  # [E, H]
    experts: list[ExpertWeights]
    rule: RoutingRule
    shared: SharedExpert | None = None


def route(router_logits: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, K] float32, expert ids [T, K] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, rule.top_k, dim=-1)  # [T, K], [T, K]
    if rule.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def reference_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    rule: RoutingRule,
    experts: Sequence[ExpertWeights],
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """hidden [T, H], router logits [T, E] -> combined expert output [T, H]."""
    weights, ids = route(router_logits, rule)  # [T, K], [T, K]
    return combine(hidden, weights, ids, experts, shared)


def combine(
    hidden: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: Sequence[ExpertWeights],
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """hidden [T, H], routing weights [T, K] and expert ids [T, K] -> sum of weighted expert outputs [T, H]."""
    weights = weights.to(hidden.dtype)
    out = torch.zeros_like(hidden)  # [T, H]
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)  # [n], [n]
        y = experts[e](hidden[tok])  # [n, H]
        out.index_add_(0, tok, y * weights[tok, slot].unsqueeze(-1))
    if shared is not None:
        out += shared(hidden)
    return out
