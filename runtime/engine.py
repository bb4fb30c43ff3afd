"""The generation engine: token ids in, token ids out, one at a time, as a generator.

The CLI, the chat app, benchmarks and tests all consume `Engine.generate`. Prefill runs the whole
prompt in one forward pass; each decode step feeds one token and reuses the KV cache.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from runtime.errors import GenerationError
from runtime.model import MoEModel
from runtime.sampling import SamplingParams, next_token

FinishReason = Literal["eos", "length", "context", ""]


@dataclass
class GenerationStats:
    """Filled in live while a generation runs; times exclude time the consumer spends between tokens."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # prefill + first sample
    decode_s: float = 0.0  # every later step
    finish_reason: FinishReason = ""

    @property
    def decode_tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "ttft_s": round(self.ttft_s, 6),
            "decode_tok_s": round(self.decode_tok_s, 3),
            "prompt_tok_s": round(self.prompt_tok_s, 3),
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
        }


class Engine:
    def __init__(self, model: MoEModel, eos_ids: Iterable[int]) -> None:
        self.model = model
        self.eos_ids = frozenset(eos_ids)

    @property
    def context(self) -> int:
        return self.model.context

    def generate(
        self, prompt_ids: list[int], params: SamplingParams | None = None, stats: GenerationStats | None = None
    ) -> Iterator[int]:
        """Validate the request now, then return a generator of new token ids (EOS is not yielded)."""
        params = params or SamplingParams()
        params.check()
        if not prompt_ids:
            raise GenerationError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.context:
            raise GenerationError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.context} "
                f"(the model allows up to {self.model.cfg.max_position_embeddings}); "
                "shorten the prompt or raise --context"
            )
        vocab = self.model.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise GenerationError(f"prompt token ids must be in [0, {vocab}); the tokenizer does not match the model")
        return self._run(prompt_ids, params, stats if stats is not None else GenerationStats())

    def _run(self, prompt_ids: list[int], params: SamplingParams, stats: GenerationStats) -> Iterator[int]:
        generator = torch.Generator()
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        n_prompt = len(prompt_ids)
        history = torch.empty(self.context, dtype=torch.long)  # prompt + generated ids
        history[:n_prompt] = torch.tensor(prompt_ids)
        stats.prompt_tokens, stats.new_tokens, stats.finish_reason = n_prompt, 0, ""
        stats.ttft_s = stats.decode_s = 0.0

        start = time.perf_counter()
        logits = self.model.forward(history[None, :n_prompt], 0, last_only=True)[0, -1]  # [V]
        budget = min(params.max_new_tokens, self.context - n_prompt)
        pos = n_prompt
        for step in range(budget):
            token = next_token(logits, params, history[:pos], generator)
            elapsed = time.perf_counter() - start
            if step == 0:
                stats.ttft_s = elapsed
            else:
                stats.decode_s += elapsed
            if token in self.eos_ids:
                stats.finish_reason = "eos"
                return
            history[pos] = token
            pos += 1
            stats.new_tokens += 1
            yield token
            if step + 1 == budget:
                break
            start = time.perf_counter()
            logits = self.model.forward(history[None, pos - 1 : pos], pos - 1, last_only=True)[0, -1]
        stats.finish_reason = "length" if budget == params.max_new_tokens else "context"
