"""`tandem bench decode`: decode speed of Tandem and, optionally, transformers on the same checkpoint.

Both run in this process, alternating, with the same prompt ids and greedy decoding; speeds are
reported as medians and as a ratio measured in one run (machines are noisy: compare ratios, not runs).
Decode tokens/s is (N - 1) / (time for N tokens - time for 1 token), measured the same way for both; prefill
tokens/s is the prompt's length over the time for 1 token (the prompt's pass and the first token's choice), warm,
as llama-bench's pp rows are.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tandem.runtime.engine import Engine
from tandem.runtime.loader import LoadedModel
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.synth import ASSETS


def _timed(fn: Callable[[int], None], n: int) -> float:
    start = time.perf_counter()
    fn(n)
    return time.perf_counter() - start


def _rates(fn: Callable[[int], None], prompt_tokens: int, new_tokens: int) -> tuple[float, float]:
    """(decode tokens/s, prefill tokens/s) of one round."""
    one = _timed(fn, 1)
    many = _timed(fn, new_tokens)
    return (new_tokens - 1) / max(many - one, 1e-9), prompt_tokens / max(one, 1e-9)


def bench_decode(
    loaded: LoadedModel, prompt_tokens: int = 32, new_tokens: int = 64, repeats: int = 3, peer: str | None = None
) -> dict[str, Any]:
    model_dir = loaded.checkpoint.path
    engine = Engine(loaded.model, ())  # no EOS: always produce exactly the requested count
    text = (ASSETS / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    prompt = (loaded.tokenizer.encode(text) * (1 + prompt_tokens))[:prompt_tokens]

    def tandem(n: int) -> None:
        for _ in engine.generate(prompt, SamplingParams(max_new_tokens=n)):
            pass

    runners: dict[str, Callable[[int], None]] = {"tandem": tandem}
    if peer == "transformers":
        import transformers

        ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=loaded.model.dtype).eval()
        ids = torch.tensor([prompt])

        def transformers_run(n: int) -> None:
            with torch.inference_mode():
                ref.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

        runners["transformers"] = transformers_run
    elif peer is not None:
        raise ValueError(f"unknown peer {peer!r}")

    for fn in runners.values():  # warm-up
        fn(2)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    prefill: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():  # alternate, so drift hits both alike
            decode_rate, prefill_rate = _rates(fn, prompt_tokens, new_tokens)
            rates[name].append(decode_rate)
            prefill[name].append(prefill_rate)
    result: dict[str, Any] = {
        "model": str(model_dir),
        "plan": loaded.model.dispatcher.describe(),
        "family": loaded.checkpoint.config.model_type,
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "decode_tok_s": {name: round(statistics.median(r), 2) for name, r in rates.items()},
        "samples": {name: [round(x, 2) for x in r] for name, r in rates.items()},
        "prefill_tok_s": {name: round(statistics.median(r), 1) for name, r in prefill.items()},
        "prefill_samples": {name: [round(x, 1) for x in r] for name, r in prefill.items()},
    }
    if "transformers" in rates:
        result["ratio"] = round(statistics.median(rates["tandem"]) / statistics.median(rates["transformers"]), 3)
    return result
