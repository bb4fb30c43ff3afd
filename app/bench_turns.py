"""`tandem bench chat --turns N`: a conversation through the server API, turn after turn, Tandem and llama.cpp's
llama-server on the same GGUF file in the same run.

Each turn's prompt is the whole history so far (the earlier prompts and answers, as text) and about
`words` new words; answers are greedy, `new_len` tokens. Per turn: the prompt's tokens, how many a KV cache held
already (Tandem's `usage.prompt_tokens_details.cached_tokens`, llama-server's `timings.cache_n`), the time to the
first token and the decode rate as the client saw them. `ttft_vs_new_alone`: each turn's TTFT over what prefilling
only its new tokens would take at the rate the first turn prefilled (its prompt tokens over its TTFT): 1.0 is
perfect reuse, the prompt's tokens over the new ones is none.
"""

from __future__ import annotations

import json
import random
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx

from tandem.app.bench_serve import running_llama_server, served_to_a_child
from tandem.app.openai_api import sse_payloads
from tandem.app.serving import EngineService
from tandem.kernels.errors import TandemError
from tandem.runtime.loader import LoadedModel

WORDS = ("the river stone garden window quiet morning letter bright yellow table story simple reason travel "
         "forest winter market number silver island answer careful ancient music orange valley bridge paper "
         "mountain gentle summer").split()


def turn_texts(turns: int, words: int, seed: int = 7) -> list[str]:
    """Each turn's new text: `words` ordinary words (the same for every engine in a run)."""
    rng = random.Random(seed)
    return [f"\n\nTurn {t + 1}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\nAnswer:"
            for t in range(turns)]


def one_turn(client: httpx.Client, url: str, model: str | None, prompt: str, new_len: int) -> dict[str, Any]:
    """A streamed greedy completion of `prompt`: its text, TTFT, decode rate and what the server said it reused."""
    body = {"prompt": prompt, "max_tokens": new_len, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}} | ({"model": model} if model else {})
    sent = time.perf_counter()
    arrivals: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    with client.stream("POST", url + "/completions", json=body) as response:
        response.raise_for_status()
        for data in sse_payloads(response.iter_lines()):
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    arrivals.append(time.perf_counter())
                    text.append(choice["text"])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings  # (llama-server's)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", timings.get("cache_n"))
    prompt_tokens = usage.get("prompt_tokens") or (timings.get("prompt_n", 0) + timings.get("cache_n", 0)) or None
    tokens = usage.get("completion_tokens") or timings.get("predicted_n") or len(arrivals)
    decode = (tokens - 1) / (arrivals[-1] - arrivals[0]) if tokens > 1 and len(arrivals) > 1 and \
        arrivals[-1] > arrivals[0] else 0.0
    return {"text": "".join(text), "prompt_tokens": prompt_tokens, "cached_tokens": cached, "new_tokens": tokens,
            "ttft_s": round(arrivals[0] - sent, 4) if arrivals else None, "decode_tok_s": round(decode, 3)}


def conversation(url: str, model: str | None, texts: list[str], new_len: int) -> list[dict[str, Any]]:
    """Every turn, one after another, each prompt the history so far and its new text."""
    history, out = "", []
    with httpx.Client(timeout=httpx.Timeout(1800.0, connect=10.0)) as client:
        one_turn(client, url, model, "Warm up.", 4)
        for t, new in enumerate(texts):
            history += new
            got = one_turn(client, url, model, history, new_len)
            history += got.pop("text")
            out.append({"turn": t + 1, **got})
    return out


def _client(url: str, model: str, texts: list[str], new_len: int, conn: Connection) -> None:
    """The conversation in a process of its own (its Python does not share the server's), the turns sent back."""
    try:
        conn.send(conversation(url, model, texts, new_len))
    except Exception as e:  # noqa: BLE001 - said to the parent, which raises it as the benchmark's failure
        conn.send(f"{type(e).__name__}: {e}")


def tandem_turns(loaded: LoadedModel, name: str, texts: list[str], new_len: int) -> list[dict[str, Any]]:
    """The conversation against `tandem serve`'s app over `loaded` (one sequence: as a chat uses it); the engine on
    this thread, the server on another, the client in a child process."""
    service = EngineService(loaded, name, 1, 512)
    got: list[Any] = []

    def serve_them() -> None:
        try:
            with served_to_a_child(service, _client, (name, texts, new_len)) as mine:
                got.append(mine.recv())
        except (EOFError, OSError) as e:
            got.append(f"the client process failed ({e})")
        finally:
            service.queue.close()

    thread = threading.Thread(target=serve_them, name="bench-turns-server")
    thread.start()
    service.run()
    thread.join()
    service.stop()
    if not got or isinstance(got[0], str):
        raise TandemError(f"the multi-turn benchmark failed: {got[0] if got else 'no result'}")
    return got[0]


def llama_server_turns(server: Path, gguf: Path, threads: int, context: int, texts: list[str], new_len: int
                       ) -> list[dict[str, Any]]:
    """The same conversation against llama.cpp's llama-server (one slot, its default prompt cache) on the file."""
    with running_llama_server(server, gguf, threads, context) as url:
        return conversation(url + "/v1", None, texts, new_len)


def against_new_alone(turns: list[dict[str, Any]]) -> list[float | None]:
    """Each turn's TTFT over its new tokens' prefill at the first turn's rate (see the module docstring)."""
    first = turns[0]
    if not first["ttft_s"] or not first["prompt_tokens"]:
        return [None] * len(turns)
    per_token = first["ttft_s"] / first["prompt_tokens"]
    out: list[float | None] = []
    for t in turns:
        new = (t["prompt_tokens"] or 0) - (t["cached_tokens"] or 0)
        out.append(round(t["ttft_s"] / (max(new, 1) * per_token), 3) if t["ttft_s"] and new > 0 else None)
    return out
