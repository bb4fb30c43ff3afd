"""Next-token choice from logits: repetition penalty, temperature, top-k, top-p; greedy at temperature 0.

Processing order follows transformers' `generate` so seeded runs are comparable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tandem.kernels.errors import GenerationError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None
    beams: int = 1  # > 1: beam search (deterministic; sampling settings are ignored)

    def check(self) -> None:
        # NaN passes every comparison below unnoticed and infinity divides logits into NaN: refused first
        for name, value in (("temperature", self.temperature), ("top-p", self.top_p),
                            ("repetition penalty", self.repetition_penalty)):
            if not math.isfinite(value):
                raise GenerationError(f"{name}: {value} is not a finite number")
        if self.max_new_tokens < 0:
            raise GenerationError("max new tokens must be ≥ 0")
        if self.temperature < 0:
            raise GenerationError("temperature must be ≥ 0 (0 means greedy)")
        if self.top_k < 0:
            raise GenerationError("top-k must be ≥ 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            raise GenerationError("top-p must be in (0, 1]")
        if self.beams < 1:
            raise GenerationError("beams must be ≥ 1")
        if self.repetition_penalty <= 0:
            raise GenerationError("repetition penalty must be > 0 (1 turns it off)")


def process_logits(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor) -> torch.Tensor:
    """Apply repetition penalty, temperature, top-k and top-p: logits [V] -> filtered logits [V]."""
    if params.repetition_penalty != 1.0 and history.numel():
        seen = logits.gather(0, history)
        penalized = _penalize(seen, params.repetition_penalty)
        if not torch.isfinite(penalized).all():
            # a penalty so far from 1 that a score overflows (or is 0 in float32): computed in float64 and held at
            # the largest finite score, so the order of the other tokens survives and softmax never sees inf
            big = torch.finfo(logits.dtype).max
            penalized = _penalize(seen.double(), params.repetition_penalty).clamp(-big, big).to(logits.dtype)
        logits = logits.scatter(0, history, penalized)
    if params.temperature == 0:
        return logits
    scaled = logits / params.temperature
    if not torch.isfinite(scaled).all():
        # a temperature so small that logits / T overflows: the largest score is moved to 0 first (softmax does not
        # change) and the division done in float64, so the best tokens stay finite and the rest fall to -inf:
        # sampling becomes greedy, as the temperature asks
        shifted = (logits.double() - logits.max().double()) / params.temperature
        scaled = shifted.to(logits.dtype)
    logits = scaled
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - params.top_p
        drop[-1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def _penalize(scores: torch.Tensor, penalty: float) -> torch.Tensor:
    return torch.where(scores < 0, scores * penalty, scores / penalty)


def next_token(
    logits: torch.Tensor, params: SamplingParams, history: torch.Tensor, generator: torch.Generator
) -> int:
    """logits [V] float32, history [N] int64 (prompt + generated) -> the next token id."""
    logits = process_logits(logits, params, history)
    if params.temperature == 0:  # (numpy: one thread, as check_scores; the first of equal scores, as torch's)
        return int(np.argmax(logits.numpy()))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
