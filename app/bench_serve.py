"""`tandem bench serve`: the local server under load, beside `generate` on the same model in the same run.

First `Engine.generate` decodes three requests of the workload's shape (the reference: no HTTP, no batching). Then the
model is served on a free loopback port and `requests` streamed completions go to it, `concurrency` at a time, from
client threads of this process. Reported: requests/s and generated tokens/s over the whole run, time to first token
and inter-token latency percentiles, each request's decode rate as its client saw it, and `serve_vs_generate` (that
rate's median over generate's decode tokens/s: the serving overhead, meaningful at concurrency 1).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch

from tandem.app.server import BackgroundServer, make_app
from tandem.app.serving import EngineService
from tandem.runtime.engine import GenerationStats
from tandem.runtime.loader import LoadedModel
from tandem.runtime.sampling import SamplingParams


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * scale, 3)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    """A prompt of n ordinary token ids (the first hundred, specials among them, left out)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(min(100, vocab - 1), vocab, (n,), generator=gen).tolist()


def generate_reference(loaded: LoadedModel, prompt_len: int, new_len: int, runs: int = 3) -> dict[str, float]:
    """Requests of the workload's shape through Engine.generate, one after another, after a short warm-up: the
    median run's figures."""
    vocab = loaded.model.cfg.vocab_size
    list(loaded.engine.generate(prompt_ids(vocab, prompt_len, 1), SamplingParams(max_new_tokens=4)))
    runs_ = []
    for i in range(runs):
        stats = GenerationStats()
        list(loaded.engine.generate(prompt_ids(vocab, prompt_len, 10 + i), SamplingParams(max_new_tokens=new_len),
                                    stats))
        runs_.append(stats)
    stats = sorted(runs_, key=lambda s: s.decode_tok_s)[len(runs_) // 2]
    return {"decode_tok_s": round(stats.decode_tok_s, 3), "ttft_s": round(stats.ttft_s, 4),
            "new_tokens": stats.new_tokens}


def one_request(client: httpx.Client, url: str, model: str, ids: list[int], new_len: int) -> dict[str, Any]:
    """A streamed completion, timed from here: when it was sent, each text chunk's arrival, the usage."""
    sent = time.perf_counter()
    arrivals: list[float] = []
    usage: dict[str, int] = {}
    body = {"model": model, "prompt": ids, "max_tokens": new_len, "stream": True}
    with client.stream("POST", url + "/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    tokens = usage.get("completion_tokens", len(arrivals))
    decode = (tokens - 1) / (arrivals[-1] - arrivals[0]) if tokens > 1 and len(arrivals) > 1 and \
        arrivals[-1] > arrivals[0] else 0.0
    return {"ttft": arrivals[0] - sent if arrivals else 0.0,
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
            "tokens": tokens, "decode_tok_s": decode, "end": time.perf_counter()}


def bench_serve(loaded: LoadedModel, name: str, requests: int, concurrency: int, prompt_len: int, new_len: int,
                batch: int, step_tokens: int) -> dict[str, Any]:
    """The engine runs on this thread (the one that loaded the model, as `tandem serve` runs it); the server and its
    clients on others."""
    reference = generate_reference(loaded, prompt_len, new_len)
    service = EngineService(loaded, name, batch, step_tokens)
    vocab = loaded.model.cfg.vocab_size
    results: list[dict[str, Any]] = []
    timing: dict[str, float] = {}
    failed: list[BaseException] = []

    def load_it() -> None:
        try:
            with BackgroundServer(make_app(service, SamplingParams())) as server, \
                    httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0),
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
                one_request(client, server.url, name, prompt_ids(vocab, prompt_len, 1), 4)  # warm-up
                lock = threading.Lock()

                def run(i: int) -> None:
                    r = one_request(client, server.url, name, prompt_ids(vocab, prompt_len, 10 + i), new_len)
                    with lock:
                        results.append(r)

                timing["start"] = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    list(pool.map(run, range(requests)))
                timing["wall"] = time.perf_counter() - timing["start"]
        except BaseException as e:  # (re-raised on the engine's thread)
            failed.append(e)
        finally:
            service.queue.close()

    clients = threading.Thread(target=load_it, name="bench-clients")
    clients.start()
    service.run()
    clients.join()
    service.stop()
    if failed:
        raise failed[0]
    wall = timing["wall"]
    tokens = sum(r["tokens"] for r in results)
    decode = statistics.median(r["decode_tok_s"] for r in results)
    return {
        "model": name, "requests": requests, "concurrency": concurrency, "prompt_tokens": prompt_len,
        "max_tokens": new_len, "batch": batch, "threads": torch.get_num_threads(),
        "requests_per_s": round(requests / wall, 3), "tokens_per_s": round(tokens / wall, 3),
        "ttft_ms": percentiles([r["ttft"] for r in results], 1000),
        "itl_ms": percentiles([x for r in results for x in r["itl"]], 1000),
        "request_decode_tok_s": round(decode, 3), "generate": reference,
        "serve_vs_generate": round(decode / reference["decode_tok_s"], 3) if reference["decode_tok_s"] else None,
        "seconds": round(wall, 3),
    }
