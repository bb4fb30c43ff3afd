"""`tandem bench chat --turns N`: a conversation through the server API, turn after turn, Tandem and llama.cpp's
llama-server on the same GGUF file in the same run.

Each turn's prompt is the whole history so far (the earlier prompts and answers, as text) and about `words` new
words; answers are greedy, `new_len` tokens, and the history carries on with the same answer text for every engine
(`answer_texts`), so that they prefill the same prompts. Per turn: the prompt's tokens, how many a KV cache held
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

from tandem.app.serve.bench import running_llama_server, served_to_a_child
from tandem.app.serve.openai_api import sse_payloads
from tandem.app.serve.serving import EngineService
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


def answer_texts(turns: int, words: int, seed: int = 8) -> list[str]:
    """The answer each turn's history carries on: the same words for every engine (a random model's own answers
    differ from engine to engine, and some are special tokens that print as nothing), so that both prefill the
    same prompts; the cache holds the engine's own answer, so a turn's new tokens are this and its new text."""
    rng = random.Random(seed)
    return [" " + " ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(turns)]


def one_turn(client: httpx.Client, url: str, model: str | None, prompt: str, new_len: int, **extra: Any
             ) -> dict[str, Any]:
    """A streamed greedy completion of `prompt`: its text, TTFT, decode rate and what the server said it reused.
    A token's chunk is one with a choice not yet finished (its text may be empty: a special token)."""
    body = {"prompt": prompt, "max_tokens": new_len, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}, **extra} | ({"model": model} if model else {})
    sent = time.perf_counter()
    arrivals: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    with client.stream("POST", url + "/completions", json=body) as response:
        if response.status_code != 200:  # (a conversation grown past the context, most likely: said as is)
            raise TandemError(f"the server answered {response.status_code}: {response.read()[:300]!r}; a longer "
                              "conversation needs a larger --context")
        for data in sse_payloads(response.iter_lines()):
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                if choice.get("finish_reason") is None:
                    arrivals.append(time.perf_counter())
                text.append(choice.get("text") or "")
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings  # (llama-server's)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", timings.get("cache_n"))
    prompt_tokens = usage.get("prompt_tokens") or (timings.get("prompt_n", 0) + timings.get("cache_n", 0)) or None
    tokens = usage.get("completion_tokens") or timings.get("predicted_n") or len(arrivals)
    decode = (tokens - 1) / (arrivals[-1] - arrivals[0]) if tokens > 1 and len(arrivals) > 1 and \
        arrivals[-1] > arrivals[0] else 0.0
    return {"text": "".join(text), "prompt_tokens": prompt_tokens, "cached_tokens": cached, "new_tokens": tokens,
            "ttft_s": round(arrivals[0] - sent, 6) if arrivals else None, "decode_tok_s": round(decode, 3)}


def conversation(url: str, model: str | None, texts: list[str], new_len: int, **extra: Any) -> list[dict[str, Any]]:
    """Every turn, one after another, each prompt the history so far and its new text; `extra`: more of each body
    (llama-server's `ignore_eos`, so that it decodes as many tokens)."""
    history, out = "", []
    answers = answer_texts(len(texts), new_len)
    with httpx.Client(timeout=httpx.Timeout(1800.0, connect=10.0)) as client:
        one_turn(client, url, model, "Warm up.", 4, **extra)
        for t, new in enumerate(texts):
            history += new
            got = one_turn(client, url, model, history, new_len, **extra)
            got.pop("text")
            history += answers[t]
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
        return conversation(url + "/v1", None, texts, new_len, ignore_eos=True)


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
