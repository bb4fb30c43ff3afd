"""What the benchmarks feed a model: the bundled texts as prompt ids, and teacher-forced passes over token ids."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tandem.runtime.model import MoEModel
from tandem.runtime.synth import ASSETS


def teacher_forced(model: MoEModel, ids: list[int], sizes: Iterable[int]) -> Iterator[torch.Tensor]:
    """Feed `ids` through the model in chunks of `sizes` tokens (each after the ones before it, from the KV cache),
    yielding each chunk's float32 logits [n, V]: row i predicts the token after the chunk's i-th."""
    pos = 0
    for size in sizes:
        if pos >= len(ids):
            return
        chunk = ids[pos : pos + size]
        yield model.forward(torch.tensor([chunk]), pos, phase="prefill" if pos == 0 else "decode")[0]
        pos += len(chunk)


def bench_prompt_ids(tokenizer: object, n: int) -> list[int]:
    """`n` prompt tokens from the bundled chat-like texts (repeated as needed)."""
    text = (ASSETS / "bench_prompts.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text)  # type: ignore[attr-defined]
    return (ids * (1 + n // max(1, len(ids))))[:n]
