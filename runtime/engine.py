"""The generation engine: token ids in, token ids out, one at a time, as a generator.

The CLI, the chat app, benchmarks and tests all consume `Engine.generate`. Prefill runs the prompt in one forward
pass (or chunks), from the first position the KV cache does not hold already when reuse is on (runtime/prefix.py:
a chat's next turn prefills only its new tokens); each decode step feeds one token and reuses the KV cache.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from tandem.kernels.errors import GenerationError
from tandem.kernels.openmp import release_thread_pool
from tandem.runtime.model import MoEModel
from tandem.runtime.prefix import PrefixStore
from tandem.runtime.sampling import SamplingParams, next_token

FinishReason = Literal["eos", "length", "context", ""]


@dataclass
class GenerationStats:
    """Filled in live while a generation runs; times exclude time the consumer spends between tokens."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # prefill + first sample
    decode_s: float = 0.0  # every later step
    finish_reason: FinishReason = ""
    cached_tokens: int = 0  # of the prompt's, held by the KV cache already: not prefilled again

    @property
    def decode_tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0

    @property
    def prompt_tok_s(self) -> float:
        """The prompt tokens prefilled (not those the KV cache held) over the time to the first token."""
        return (self.prompt_tokens - self.cached_tokens) / self.ttft_s if self.ttft_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "ttft_s": round(self.ttft_s, 6),
            "decode_tok_s": round(self.decode_tok_s, 3),
            "prompt_tok_s": round(self.prompt_tok_s, 3),
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
        }


def check_scores(logits: torch.Tensor, step: int) -> None:
    """Scores with NaN or infinities come from damaged weights (or an overflow in them): sampling would fail
    inside torch and greedy or beam search would print nonsense, so they end the generation with an error.
    One pass over a row of V scores per step, in numpy: one thread, where torch's elementwise ops on a row this long
    wake every OpenMP thread (milliseconds a token on a 16-core machine whose threads slept while a GPU worked)."""
    if not bool(np.isfinite(logits.numpy()).all()):
        raise GenerationError(f"the model produced NaN or infinite scores at token {step + 1}; its weights may be "
                              "damaged (download or convert the model again)")


class Engine:
    def __init__(self, model: MoEModel, eos_ids: Iterable[int], reuse: bool = False,
                 store: PrefixStore | None = None) -> None:
        """`reuse`: a prompt whose first tokens KV cache row 0 holds already prefills only the rest (off by default:
        a benchmark that runs one prompt twice measures its prefill twice); `store`: with reuse, prefixes kept in
        RAM when another prompt overwrites them, and copied back for a prompt that begins as one of them."""
        self.model = model
        self.eos_ids = frozenset(eos_ids)
        self.reuse = reuse
        self.store = store

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
        if params.beams > self.model.cache.batch:
            raise GenerationError(
                f"{params.beams} beams need the model loaded for {params.beams} sequences (it holds "
                f"{self.model.cache.batch}); pass --beams when loading"
            )
        stats = stats if stats is not None else GenerationStats()
        if params.beams > 1:
            return _then_release(self._beam_search(prompt_ids, params, stats))
        return _then_release(self._run(prompt_ids, params, stats))

    def _run(self, prompt_ids: list[int], params: SamplingParams, stats: GenerationStats) -> Iterator[int]:
        generator = torch.Generator()
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        n_prompt = len(prompt_ids)
        history = torch.empty(self.context, dtype=torch.long)  # prompt + generated ids
        history[:n_prompt] = torch.tensor(prompt_ids)
        self._begin(stats, n_prompt)
        start = time.perf_counter()
        stats.cached_tokens = self._reusable(history[:n_prompt])
        logits = self._prefill(history[None, :n_prompt], stats.cached_tokens)[0]  # [V]
        budget = min(params.max_new_tokens, self.context - n_prompt)
        pos = n_prompt
        for step in range(budget):
            check_scores(logits, step)
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
            if self._rope_switches(pos):
                logits = self._prefill(history[None, :pos])[0]
            else:
                logits = self.model.forward(history[None, pos - 1 : pos], pos - 1, last_only=True,
                                            phase="decode")[0, -1]
        stats.finish_reason = "length" if budget == params.max_new_tokens else "context"

    def _prefill(self, ids: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Sequences ids [R, n], of which the KV cache holds the first `first` positions already -> their last
        position's logits [R, V]: in passes of the model's `prefill_chunk` tokens (one pass without it). Under
        LongRoPE every pass rotates as the whole length decides, as one pass would."""
        n = ids.shape[1]
        chunk = self.model.prefill_chunk or n
        long = self._long(n)
        # A recurrent state holds at one position: the one before the prompt's last token is marked, where a retry
        # or an edited last message takes up again (runtime/state.py), so the last token is a pass of its own.
        stop = n - 1 if self.model.recurrent and n - first > 1 else n
        if self.model.recurrent and 0 < first < stop:  # (and where the reused part ends, when the state is there:
            # an edited last message takes up there, the answer before it not read again)
            for r in range(ids.shape[0]):
                self.model.cache.mark(r, first)  # type: ignore[union-attr]
        for start in range(first, stop, chunk):
            logits = self.model.forward(ids[:, start : min(start + chunk, stop)], start, last_only=True,
                                        long=long)  # [R, 1, V]
        if stop < n:
            for r in range(ids.shape[0]):
                self.model.cache.mark(r, stop)  # type: ignore[union-attr]
            logits = self.model.forward(ids[:, stop:], stop, last_only=True, long=long)
        return logits[:, -1]

    def _long(self, length: int) -> bool:
        """Whether a sequence `length` tokens long rotates with LongRoPE's long tables."""
        return self.model.rope_switch is not None and length > self.model.rope_switch

    def _reusable(self, prompt: torch.Tensor) -> int:
        """How many of the prompt's first positions KV cache row 0 holds already, a saved prefix copied in where
        one shares more (0 with reuse off)."""
        if not self.reuse:
            return 0
        cache, long = self.model.cache, self._long(len(prompt))
        held = cache.held.reusable(0, prompt, long)
        return self.store.take(cache, 0, prompt, long, held) if self.store is not None else held

    def persist(self) -> None:
        """KV cache row 0's prefix (the conversation it holds) written to the prefix store's disk, where there is
        one: the program is done with it (runtime/prefix_disk.py)."""
        if self.reuse and self.store is not None:
            self.store.persist(self.model.cache, 0)

    def _rope_switches(self, length: int) -> bool:
        """Whether the step that makes the sequence `length` tokens long crosses LongRoPE's switch: the cached keys
        were rotated with the short tables, so the step runs the whole sequence again with the long ones, once (as
        transformers' generate does for Phi-3 and PhiMoE, by dropping its cache)."""
        return self.model.rope_switch is not None and length - 1 == self.model.rope_switch

    def _begin(self, stats: GenerationStats, n_prompt: int) -> None:
        self.model.dispatcher.begin_request()
        stats.prompt_tokens, stats.new_tokens, stats.finish_reason, stats.cached_tokens = n_prompt, 0, "", 0
        stats.ttft_s = stats.decode_s = 0.0

    def _beam_search(self, prompt_ids: list[int], params: SamplingParams, stats: GenerationStats) -> Iterator[int]:
        """Beam search over `params.beams` rows of the KV cache; yields the best sequence when it is done.

        Scores are summed log-probabilities; finished hypotheses (ended by EOS) and the final beams are
        compared by score per token. Each step runs all beams as one batch, so experts see K tokens."""
        k, n_prompt = params.beams, len(prompt_ids)
        self._begin(stats, n_prompt)
        start = time.perf_counter()
        budget = min(params.max_new_tokens, self.context - n_prompt)
        prompt = torch.tensor(prompt_ids)
        stats.cached_tokens = self._reusable(prompt)
        logits = self._prefill(prompt[None], stats.cached_tokens)[0]  # [V]
        if budget:
            check_scores(logits, 0)
        scores = torch.log_softmax(logits, -1)[None]  # [1, V]: one row until the beams diverge
        rows: list[list[int]] = [[]]  # the tokens of the beam held in each KV cache row
        row_scores = torch.zeros(1)
        finished: list[tuple[float, list[int]]] = []
        pos = n_prompt
        for step in range(budget):
            if step and self._rope_switches(pos):  # every beam again from the start (see _rope_switches)
                whole = torch.tensor([prompt_ids + r for r in rows])  # [R, pos]
                logits = self._prefill(whole)  # [R, V]
            elif step:
                last = torch.tensor([[r[-1]] for r in rows])  # [R, 1]
                logits = self.model.forward(last, pos - 1, last_only=True, phase="decode")[:, -1]  # [R, V]
            if step:
                check_scores(logits, step)
                scores = row_scores[:, None] + torch.log_softmax(logits, -1)  # [R, V]
            top, flat = scores.flatten().topk(min(2 * k, scores.numel()))  # [2K]
            vocab = scores.shape[-1]
            alive: list[tuple[float, int, int]] = []  # (score, source row, token)
            for s, i in zip(top.tolist(), flat.tolist(), strict=True):
                src, tok = divmod(i, vocab)
                if tok in self.eos_ids:
                    finished.append((s / max(1, len(rows[src])), rows[src]))
                elif len(alive) < k:
                    alive.append((s, src, tok))
            if len(finished) >= k or not alive:
                break
            rows, row_scores = self._place_beams(alive, rows, pos)
            pos += 1
        candidates = finished + [(float(s) / len(b), b) for s, b in zip(row_scores.tolist(), rows, strict=True) if b]
        best = max(candidates, key=lambda c: c[0])[1] if candidates else []
        stats.ttft_s = time.perf_counter() - start
        stats.finish_reason = "eos" if finished and best is max(finished, key=lambda c: c[0])[1] else "length"
        for token in best:
            stats.new_tokens += 1
            yield token

    def _place_beams(self, alive: list[tuple[float, int, int]], rows: list[list[int]], length: int
                     ) -> tuple[list[list[int]], torch.Tensor]:
        """The next beams into KV cache rows 0..len(alive)-1: each source row keeps its first continuation in
        place, and only further continuations are copied (their source's first `length` positions) into rows
        whose beam ended. Returns the beams' tokens and scores by row."""
        n = len(alive)
        target = [-1] * n
        kept: set[int] = set()
        for j, (_, src, _) in enumerate(alive):
            if src < n and src not in kept:
                kept.add(src)
                target[j] = src
        free = iter(r for r in range(n) if r not in kept)
        copies = []
        for j, (_, src, _) in enumerate(alive):
            if target[j] < 0:
                target[j] = next(free)
                copies.append((target[j], src))
        if copies:  # sources are kept rows or rows past n: none of them is overwritten here
            self.model.cache.copy_rows(copies, length)
        new_rows: list[list[int]] = [[] for _ in range(n)]
        scores = torch.empty(n)
        for j, (s, src, tok) in enumerate(alive):
            new_rows[target[j]] = rows[src] + [tok]
            scores[target[j]] = s
        return new_rows, scores


def _then_release(steps: Iterator[int]) -> Iterator[int]:
    """`steps`, then the consuming thread's OpenMP workers given back, however the answer ends (kernels/openmp.py:
    a thread that answered and stays must not slow down the next answer's thread)."""
    try:
        yield from steps
    finally:
        release_thread_pool()
