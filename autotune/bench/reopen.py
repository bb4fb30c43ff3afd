"""`tandem bench chat --reopen TOKENS`: a conversation of TOKENS tokens, kept on disk (runtime/prefix_disk.py), then
the first answer after a restart, against the same answer with the cache dropped.

A restart is played in the process: the KV cache's rows forget what they hold and a new engine, prefix store and
disk index (read from the folder again) take over, so nothing of the conversation is in RAM; the model's weights
stay loaded, as they would be by the time a restarted chat app sends its first message. The conversation is ordinary
words; the reopened prompt is it and a new message of 24 words. Each variant runs `repeats` times,
alternating; the figures are the best of each.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.loader import LoadedModel
from tandem.runtime.prefix import PrefixStore
from tandem.runtime.prefix_disk import DiskPrefixes
from tandem.runtime.sampling import SamplingParams

WORDS = ("the river stone garden window quiet morning letter bright yellow table story simple reason travel forest "
         "winter market number silver island answer careful ancient music orange valley bridge paper mountain").split()
ONE = SamplingParams(max_new_tokens=1, temperature=0.0)


def conversation(loaded: LoadedModel, tokens: int) -> tuple[list[int], list[int]]:
    """A conversation's ids, exactly `tokens` of them, and a new message's ids after it."""
    text, i = [], 0
    while len(loaded.tokenizer.encode(" ".join(text))) < tokens + 8:
        text.extend(WORDS[(i * 7 + j) % len(WORDS)] for j in range(50))
        text.append(f"\nTurn {i}:")
        i += 1
    ids = loaded.tokenizer.encode(" ".join(text))[:tokens]
    message = loaded.tokenizer.encode(" " + " ".join(WORDS[j % len(WORDS)] for j in range(3, 27)) + "\nAnswer:")
    return ids, message


def _restart(loaded: LoadedModel) -> None:
    """What a restart leaves of the conversation in the KV cache: nothing."""
    loaded.model.cache.held.forget()


def bench_reopen(loaded: LoadedModel, tokens: int, repeats: int = 2) -> dict[str, Any]:
    model = loaded.model
    if tokens + 64 > model.context:
        raise ValueError(f"a conversation of {tokens} tokens needs --context of at least {tokens + 64}")
    ids, message = conversation(loaded, tokens)
    prompt = ids + message
    eos = ()  # (an answer of exactly one token: TTFT alone)
    with tempfile.TemporaryDirectory(prefix="tandem-reopen-") as folder:
        budget = 1 << 40
        _restart(loaded)
        first = Engine(model, eos, True, PrefixStore(0, DiskPrefixes(Path(folder), budget)))
        list(first.generate(ids, ONE))
        start = time.perf_counter()
        first.persist()
        write_s = time.perf_counter() - start
        size = sum(p.stat().st_size for p in Path(folder).glob("*"))
        reopened, dropped, cached = [], [], 0
        for _ in range(repeats):
            _restart(loaded)
            stats = GenerationStats()
            store = PrefixStore(0, DiskPrefixes(Path(folder), budget))
            list(Engine(model, eos, True, store).generate(prompt, ONE, stats))
            reopened.append(stats.ttft_s)
            cached = stats.cached_tokens
            _restart(loaded)
            stats = GenerationStats()
            list(Engine(model, eos, True, None).generate(prompt, ONE, stats))
            dropped.append(stats.ttft_s)
    best_reopened, best_dropped = min(reopened), min(dropped)
    return {"model": str(loaded.checkpoint.path), "conversation_tokens": tokens, "prompt_tokens": len(prompt),
            "cached_tokens": cached, "file_bytes": size, "write_s": round(write_s, 3),
            "ttft_reopened_s": [round(t, 4) for t in reopened], "ttft_dropped_s": [round(t, 4) for t in dropped],
            "sooner": round(best_dropped / best_reopened, 2) if best_reopened else None,
            "dtype": str(model.dtype).removeprefix("torch."), "threads": model.threads}
