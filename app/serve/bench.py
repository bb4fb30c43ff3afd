"""`tandem bench serve`: the local server under load, beside `generate` on the same model in the same run.

The model is served on a free loopback port and `requests` streamed completions go to it, `concurrency` at a time,
from a client process; `Engine.generate` decodes requests of the same shape as the reference (no HTTP, no batching):
at concurrency 1, one before each served request; above, three before and three after. Reported: requests/s and
generated tokens/s, time to first token and inter-token latency percentiles, each request's decode rate as its
client saw it, and `serve_vs_generate`, the serving overhead, meaningful at concurrency 1: there the median of each
served request's rate over the generate run just before it (above, the medians' ratio).
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import torch

from tandem.app.serve.openai_api import sse_payloads
from tandem.app.serve.server import BackgroundServer, bind, make_app
from tandem.app.serve.serving import EngineService
from tandem.kernels.errors import TandemError
from tandem.runtime.batch import RequestQueue
from tandem.runtime.engine import GenerationStats
from tandem.runtime.loader import LoadedModel
from tandem.runtime.sampling import SamplingParams

PEER_START_S = 300  # llama-server loading a model: generous, but never a hang


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


def generate_runs(loaded: LoadedModel, prompt_len: int, new_len: int, runs: int = 3, seed: int = 10
                  ) -> list[GenerationStats]:
    """Requests of the workload's shape through Engine.generate, one after another, after a short warm-up."""
    vocab = loaded.model.cfg.vocab_size
    list(loaded.engine.generate(prompt_ids(vocab, prompt_len, 1), SamplingParams(max_new_tokens=4)))
    out = []
    for i in range(runs):
        stats = GenerationStats()
        list(loaded.engine.generate(prompt_ids(vocab, prompt_len, seed + i),
                                    SamplingParams(max_new_tokens=new_len), stats))
        out.append(stats)
    return out


def reference(runs: list[GenerationStats]) -> dict[str, float]:
    """The median run's figures."""
    stats = sorted(runs, key=lambda s: s.decode_tok_s)[len(runs) // 2]
    return {"decode_tok_s": round(stats.decode_tok_s, 3), "ttft_s": round(stats.ttft_s, 4),
            "new_tokens": stats.new_tokens, "runs": len(runs)}


def one_request(client: httpx.Client, url: str, model: str | None, ids: list[int], new_len: int,
                **extra: Any) -> dict[str, Any]:
    """A streamed completion, timed from here: when it was sent, each token's chunk's arrival (a chunk with a choice
    not yet finished), the usage. `extra`: more of the body."""
    sent = time.perf_counter()
    arrivals: list[float] = []
    usage: dict[str, int] = {}
    body = {"prompt": ids, "max_tokens": new_len, "stream": True, **extra} | ({"model": model} if model else {})
    with client.stream("POST", url + "/completions", json=body) as response:
        response.raise_for_status()
        for data in sse_payloads(response.iter_lines()):
            chunk = json.loads(data)
            if any(c.get("finish_reason") is None for c in chunk.get("choices") or []):
                arrivals.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    tokens = usage.get("completion_tokens", len(arrivals))
    decode = (tokens - 1) / (arrivals[-1] - arrivals[0]) if tokens > 1 and len(arrivals) > 1 and \
        arrivals[-1] > arrivals[0] else 0.0
    return {"ttft": arrivals[0] - sent if arrivals else 0.0,
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
            "tokens": tokens, "decode_tok_s": decode, "sent": sent, "end": time.perf_counter()}


def clients(url: str, name: str, prompts: list[list[int]], new_len: int, concurrency: int, lockstep: bool,
            conn: Connection) -> None:
    """The load, in a process of its own (as real clients are: their Python does not share the server's): a
    warm-up request, then every prompt, `concurrency` at a time, and (results, wall seconds) sent back, once the
    parent says go. `lockstep` (one at a time): each request when the parent says so, its result sent back at
    once."""
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0),
                      limits=httpx.Limits(max_connections=concurrency)) as client:
        if lockstep:
            for ids in [prompts[0][:8], *prompts]:
                conn.recv()
                conn.send(one_request(client, url, name, ids, new_len))
            return
        conn.recv()
        one_request(client, url, name, prompts[0][:8], 4)
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda ids: one_request(client, url, name, ids, new_len), prompts))
        conn.send((results, time.perf_counter() - start))


@contextmanager
def served_to_a_child(service: EngineService, target: Callable[..., None], args: tuple[Any, ...]
                      ) -> Iterator[Connection]:
    """`service`'s app on a loopback port, and `target(url, *args, conn)` in a child process (as real clients are:
    their Python does not share the server's; spawned: no copy of the model's memory). Yields this side of their
    pipe; the child is waited for after."""
    spawn = multiprocessing.get_context("spawn")
    mine, theirs = spawn.Pipe()
    with BackgroundServer(make_app(service, SamplingParams())) as server:
        child = spawn.Process(target=target, args=(server.url, *args, theirs))
        child.start()
        theirs.close()
        yield mine
        child.join()


@contextmanager
def running_llama_server(server: Path, gguf: Path, threads: int, context: int) -> Iterator[str]:
    """llama.cpp's llama-server (one slot) on `gguf` on a free loopback port, until the block ends: its URL."""
    if not server.is_file():
        raise TandemError(f"--llama-server {server}: no such file (build llama-server from llama.cpp's source)")
    port = free_port()
    proc = subprocess.Popen([str(server), "-m", str(gguf), "-t", str(threads), "-c", str(context), "--port", str(port),
                             "-np", "1", "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=10.0) as client:
            deadline = time.monotonic() + PEER_START_S
            while not _healthy(client, url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    tail = (proc.communicate()[1].strip().splitlines() or ["(no output)"])[-1]
                    raise TandemError(f"llama-server did not start: {tail}")
                time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


def bench_serve(loaded: LoadedModel, name: str, requests: int, concurrency: int, prompt_len: int, new_len: int,
                batch: int, step_tokens: int) -> dict[str, Any]:
    """The engine runs on this thread (the one that loaded the model, as `tandem serve` runs it), the server on
    another, the clients in a child process. At concurrency 1, served requests and generate's alternate (the
    machine's speed drifts over minutes: the overhead is compared request by request); above, generate's runs come
    before and after."""
    service = EngineService(loaded, name, batch, step_tokens)
    vocab = loaded.model.cfg.vocab_size
    prompts = [prompt_ids(vocab, prompt_len, 10 + i) for i in range(requests)]
    lockstep = concurrency == 1
    rounds = requests + 1 if lockstep else 1  # (lockstep: the first round warms up)
    turn = threading.Semaphore(0)  # the engine's thread is free for the next round
    ready = threading.Semaphore(0)  # the next round's queue is in place
    got: list[Any] = []
    failed: list[str] = []

    def serve_them() -> None:
        try:
            with served_to_a_child(service, clients, (name, prompts, new_len, concurrency, lockstep)) as mine:
                for _ in range(rounds):
                    turn.acquire()
                    service.queue = RequestQueue()
                    ready.release()
                    mine.send("go")
                    got.append(mine.recv())
                    service.queue.close()  # this round's run of the engine ends
        except (EOFError, OSError):
            failed.append("the client process failed (its error is above)")
        finally:
            service.queue.close()
            for _ in range(rounds):
                ready.release()  # (after a failure the engine's thread must not wait for rounds that will not come)

    thread = threading.Thread(target=serve_them, name="bench-server")
    thread.start()
    alone = generate_runs(loaded, prompt_len, new_len, runs=0 if lockstep else 3)
    for i in range(rounds):
        if lockstep:  # (the first round warms up: its figures are not kept)
            alone += generate_runs(loaded, prompt_len, new_len, runs=1, seed=10 + i - 1)[:1 if i else 0]
        turn.release()
        ready.acquire()
        if failed:
            break
        service.run()
    thread.join()
    if failed or len(got) != rounds:
        raise TandemError(failed[0] if failed else "the benchmark's server failed")
    if lockstep:
        results = got[1:]
        wall = sum(r["end"] - r["sent"] for r in results)
    else:
        results, wall = got[0]
        alone += generate_runs(loaded, prompt_len, new_len)
    ref = reference(alone)
    service.stop()
    tokens = sum(r["tokens"] for r in results)
    decode = statistics.median(r["decode_tok_s"] for r in results)
    if lockstep:  # each served request over the generate run just before it: the drift between pairs cancels
        ratio = statistics.median(r["decode_tok_s"] / g.decode_tok_s for r, g in zip(results, alone, strict=True)
                                  if g.decode_tok_s)
    else:
        ratio = decode / ref["decode_tok_s"] if ref["decode_tok_s"] else 0.0
    return {
        "model": name, "requests": requests, "concurrency": concurrency, "prompt_tokens": prompt_len,
        "max_tokens": new_len, "batch": batch, "threads": torch.get_num_threads(),
        "requests_per_s": round(requests / wall, 3), "tokens_per_s": round(tokens / wall, 3),
        "ttft_ms": percentiles([r["ttft"] for r in results], 1000),
        "itl_ms": percentiles([x for r in results for x in r["itl"]], 1000),
        "request_decode_tok_s": round(decode, 3), "generate": ref,
        "serve_vs_generate": round(ratio, 3) if ratio else None,
        "seconds": round(wall, 3),
    }


def llama_server_peer(server: Path, bench: Path, gguf: Path, threads: int, prompts: list[list[int]], new_len: int
                      ) -> dict[str, Any]:
    """llama.cpp's serving overhead measured the same way: its `llama-server` (one slot) streaming each prompt to
    this process, alternating with its `llama-bench` decoding `new_len` tokens after as many as the prompt holds
    (`-d`); the medians and their ratio."""
    from tandem.autotune.bench.llama import run_tool

    context = max(len(p) for p in prompts) + new_len + 64
    with running_llama_server(server, gguf, threads, context) as url, \
            httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        one_request(client, url + "/v1", None, prompts[0][:8], 4, temperature=0, ignore_eos=True)  # warm-up
        served, tg = [], []
        for ids in prompts:
            out = run_tool(bench, "llama-bench", ["-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json",
                                                  "-p", "0", "-n", str(new_len), "-d", str(len(ids))])
            try:
                tg.append(float(json.loads(out)[0]["avg_ts"]))
            except (ValueError, LookupError, TypeError):
                raise TandemError("llama-bench printed no tg row as JSON; is it llama.cpp's llama-bench?") from None
            served.append(one_request(client, url + "/v1", None, ids, new_len, temperature=0,
                                      ignore_eos=True)["decode_tok_s"])
    ratio = statistics.median(s / t for s, t in zip(served, tg, strict=True) if t)  # pairs, as Tandem's
    return {"name": "llama.cpp", "server_decode_tok_s": round(statistics.median(served), 3),
            "bench_tg_tok_s": round(statistics.median(tg), 3), "serve_vs_generate": round(ratio, 3),
            "rounds": len(prompts)}


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    with bind("127.0.0.1", 0) as sock:
        return int(sock.getsockname()[1])
