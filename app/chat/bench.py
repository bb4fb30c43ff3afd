"""`tandem bench chat`: what the chat app costs the engine. The app runs headless (Textual's Pilot, rendering as it
would into a terminal) on a loaded model; the same question is answered through it and without it (the answer's
stream consumed as `generate` consumes it), alternating, on the same model, greedy, so both decode the same tokens.
The figure is the decode tokens/s the status bar shows over that of the bare stream, medians of the rounds: the chat
may cost at most a tenth of it (a ratio of at least 0.9).

The question asks for a long answer, and `--new-tokens` bounds it; both runs stop at the same token. Each round's
app starts afresh with 30 earlier conversations in its sidebar (`--chats`), as a user's app has some.

`--turns N --app`: one conversation of N turns typed into the app (each message `--words` ordinary words), each
turn's time to the first token, prompt and reused tokens as the status bar has them: with prefix reuse the wait
stays flat as the conversation grows (`last_over_second`: the last turn's TTFT over the second's).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tandem.app.chat.backend import RuntimeBackend
from tandem.kernels.errors import TandemError
from tandem.runtime.loader import LoadedModel
from tandem.runtime.sampling import SamplingParams

QUESTION = ("Write a long story about a lighthouse keeper who finds a map in a bottle, with many places, names "
            "and events, and tell it slowly, in many paragraphs.")
SIZE = (120, 40)  # the headless terminal's columns and rows
TURN_MOST_S = 3600  # a turn's answer, at most


class _Chatting(RuntimeBackend):
    """The runtime's backend as the app has it once a user chats (the wizard that a first load of a model offers
    would take the keys: not offered)."""

    def tuning_target(self) -> None:  # type: ignore[override]
        return None


def bare(backend: RuntimeBackend, params: SamplingParams) -> dict[str, float]:
    """The answer's stream consumed with nothing else running: its decode tokens/s and tokens."""
    for _ in backend.stream([{"role": "user", "content": QUESTION}], params):
        pass
    return {"decode_tok_s": backend.stats.decode_tok_s, "tokens": backend.stats.new_tokens}


async def _in_the_app(backend: RuntimeBackend, params: SamplingParams) -> dict[str, float]:
    from tandem.app.chat.tui import TandemApp

    app = TandemApp(lambda _: backend, params=params)
    async with app.run_test(size=SIZE) as pilot:
        while app.lifecycle.backend is None:
            await pilot.pause(0.02)
        composer = app.query_one("#composer")
        composer.focus()
        composer.insert(QUESTION)
        await pilot.press("enter")
        cpu, wall = time.thread_time(), time.monotonic()  # (this thread is the app's: its event loop, its painting)
        while app.lifecycle.generating or len(app.chat.current.turns) < 2:  # (the question, then the answer)
            await asyncio.sleep(0.25)  # (slept, not Pilot's pause, which waits for a repaint: no extra work)
        cpu, wall = time.thread_time() - cpu, time.monotonic() - wall
        usage = backend.usage()
    return {"decode_tok_s": usage.tok_s or 0.0, "tokens": backend.stats.new_tokens,
            "app_cpu_share": round(cpu / wall, 3)}


def in_the_app(backend: RuntimeBackend, params: SamplingParams) -> dict[str, float]:
    """The same answer through the chat app, headless: the status bar's decode tokens/s, and tokens."""
    return asyncio.run(_in_the_app(backend, params))


async def _turns_in_the_app(backend: RuntimeBackend, texts: list[str], params: SamplingParams
                            ) -> list[dict[str, Any]]:
    from tandem.app.chat.tui import TandemApp

    app = TandemApp(lambda _: backend, params=params)
    rows: list[dict[str, Any]] = []
    async with app.run_test(size=SIZE) as pilot:
        while app.lifecycle.backend is None:
            await pilot.pause(0.02)
        composer = app.query_one("#composer")
        for i, text in enumerate(texts):
            composer.focus()
            composer.insert(text)
            asked = backend.stats
            await pilot.press("enter")
            # (an answer that came back empty is not kept as a turn: its end is the stream's, not the turns')
            deadline = time.monotonic() + TURN_MOST_S
            while app.lifecycle.generating or backend.stats is asked:
                if time.monotonic() > deadline:
                    raise TandemError(f"turn {i + 1} had no answer after {TURN_MOST_S} s")
                await asyncio.sleep(0.05)
            usage = backend.usage()
            if not backend.stats.new_tokens:
                raise TandemError(f"turn {i + 1} got an empty answer (the model ended it at once); try other --words")
            rows.append({"turn": i + 1, "prompt_tokens": backend.stats.prompt_tokens, "cached": usage.cached,
                         "ttft_s": round(usage.ttft_s, 6), "decode_tok_s": round(usage.tok_s, 2)})
    return rows


def turns_in_the_app(loaded: LoadedModel, texts: list[str], new_tokens: int) -> dict[str, Any]:
    """One conversation of `texts` through the chat app, headless, in a temporary folder of its own."""
    backend = _Chatting(loaded)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    with _own_home():
        rows = asyncio.run(_turns_in_the_app(backend, texts, params))
    second, last = rows[min(1, len(rows) - 1)]["ttft_s"], rows[-1]["ttft_s"]
    return {"model": str(loaded.checkpoint.path), "placement": backend.placement, "turns": rows,
            "last_over_second": round(last / second, 3) if second else None}


@contextmanager
def _own_home() -> Iterator[None]:
    """TANDEM_HOME set to a temporary folder meanwhile: the app's conversations and settings there, never the
    user's."""
    home = os.environ.get("TANDEM_HOME")
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-bench-chat-") as folder:
            os.environ["TANDEM_HOME"] = folder
            yield
    finally:
        if home is None:
            os.environ.pop("TANDEM_HOME", None)
        else:
            os.environ["TANDEM_HOME"] = home


def saved_chats(count: int) -> None:
    """`count` earlier conversations of a few turns each in the store (TANDEM_HOME's): the sidebar a user has."""
    from tandem.app.chat.store import Conversation, ConversationStore, Turn

    store = ConversationStore()
    for i in range(count):
        store.save(Conversation(title=f"chat {i}", turns=[Turn("user", f"question {i} about something"),
                                                          Turn("assistant", f"answer {i}. " * 40)]))


def bench_chat(loaded: LoadedModel, new_tokens: int = 128, repeats: int = 3, chats: int = 30) -> dict[str, Any]:
    """Alternating rounds of the bare stream and of the chat app on `loaded`; each round's app starts with `chats`
    earlier conversations in a temporary folder of its own (the user's are never touched)."""
    backend = _Chatting(loaded)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    bare(backend, SamplingParams(max_new_tokens=4, temperature=0.0))  # warm-up
    rows: list[dict[str, Any]] = []
    for _ in range(repeats):
        with _own_home():
            saved_chats(chats)
            rows.append({"generate": bare(backend, params), "chat": in_the_app(backend, params)})
    gen = statistics.median(r["generate"]["decode_tok_s"] for r in rows)
    chat = statistics.median(r["chat"]["decode_tok_s"] for r in rows)
    ratios = [r["chat"]["decode_tok_s"] / r["generate"]["decode_tok_s"] for r in rows if r["generate"]["decode_tok_s"]]
    return {
        "model": str(loaded.checkpoint.path),
        "placement": backend.placement,
        "new_tokens": new_tokens,
        "saved_chats": chats,
        "generate_decode_tok_s": round(gen, 2),
        "chat_decode_tok_s": round(chat, 2),
        # each round's chat over the bare stream just before it (the machine's memory bandwidth drifts between
        # rounds more than the app costs: a ratio of neighbours, then their median)
        "chat_over_generate": round(statistics.median(ratios), 3) if ratios else None,
        "ratios": [round(r, 3) for r in ratios],
        "rounds": rows,
    }
