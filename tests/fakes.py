"""Backends for the chat app's tests: they implement `ChatBackend` without a model, and import no Textual."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from tandem.app.chat.backend import TuningTarget, Usage
from tandem.runtime.loader import LoadedModel
from tandem.runtime.sampling import SamplingParams


class FakeBackend:
    """Deterministic words at a controllable pace."""

    name, family, placement = "fake-moe", "Mixtral", "CPU only · 2 threads · bf16"
    context = 4096
    remote: str | None = None

    def __init__(self, words: int = 12, delay: float = 0.0, path: str | None = None) -> None:
        self.words, self.delay, self.path = words, delay, path
        self.prompts: list[list[dict[str, str]]] = []  # the messages of every answer asked for
        self.started = threading.Event()
        self.produced = 0
        self.closed = False
        self.hold: threading.Event | None = None  # when given: after the first word, wait for it to be set
        self.on_gpu: tuple[int, int] | None = None  # accelerator memory (used, budget) it holds; None: none

    def prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        """One token a word, two a message for the template's markers."""
        return sum(len(m["content"].split()) + 2 for m in messages)

    def stream(self, messages: list[dict[str, str]], params: SamplingParams) -> Iterator[str]:
        self.prompts.append(messages)
        self.produced = 0
        self.started.set()
        for i in range(self.words):
            time.sleep(self.delay)
            if i == 1 and self.hold is not None:
                self.hold.wait(10)
            self.produced += 1
            yield f"word{i} "

    def usage(self) -> Usage:
        return Usage(42.5, 0.123, None, 10 + self.produced, 4096)

    def activity(self) -> list[list[int]]:
        return [[3, 0, 1, 0, 0, 0, 2, 0], [0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 5]]

    def close(self) -> None:
        self.closed = True

    def where(self) -> list[list[str]] | None:
        return None

    def vram(self) -> tuple[int, int] | None:
        return self.on_gpu

    def tuning_target(self) -> TuningTarget | None:
        return None

    def loaded_model(self) -> LoadedModel | None:
        return None


class TunableFake(FakeBackend):
    def tuning_target(self) -> TuningTarget | None:
        return TuningTarget("/models/fake", "bf16", {"model_type": "mixtral", "hidden_size": 64})
