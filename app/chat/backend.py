"""What the chat app needs from a model, on top of the runtime's own generator and statistics API.

`ChatBackend` declares every member the app uses; `RuntimeBackend` wraps a loaded model, and tests substitute fakes
that implement the same protocol. Text is produced here, from the engine's token ids, by the runtime's
`StreamDecoder` — the engine itself never sees text.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.app.harmony import answer_view, fold
from tandem.runtime.engine import GenerationStats
from tandem.runtime.loader import LoadedModel
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.tokenizer import StreamDecoder


@dataclass(frozen=True)
class Usage:
    """Numbers for the status bar, read after (or during) a generation."""

    tok_s: float
    ttft_s: float
    hit_rate: float | None  # None without an accelerator tier
    context_used: int
    context_size: int
    cached: int = 0  # of the last prompt's tokens, held by the KV cache already (prefix reuse)


@dataclass(frozen=True)
class TuningTarget:
    """What a tuning profile for a model is keyed by."""

    path: str  # the model folder
    dtype: str  # "bf16" | "fp32"
    raw_config: dict  # its config.json


class ChatBackend(Protocol):
    """A loaded model as the chat app sees it. A member that some models cannot answer says so with None."""

    name: str
    family: str
    placement: str  # where work runs, in words
    remote: str | None  # the server it runs on (app/chat/remote.py); None: this machine's runtime

    def stream(self, messages: list[dict[str, str]], params: SamplingParams) -> Iterator[str]: ...
    def prompt_tokens(self, messages: list[dict[str, str]]) -> int: ...  # the chat prompt's length in tokens
    @property
    def context(self) -> int: ...  # the most tokens a prompt and its answer may take together (0: not known)
    def usage(self) -> Usage: ...
    def activity(self) -> list[list[int]]: ...  # [layers][experts] activation counts of the last answer
    def close(self) -> None: ...  # release its memory; it is not used afterwards
    # [layers][experts] -> "gpu" | "cpu" | "fetched" | "" (where each expert mostly ran during the last answer);
    # None: not recorded
    def where(self) -> list[list[str]] | None: ...
    def vram(self) -> tuple[int, int] | None: ...  # (bytes used, budget) on the accelerator; None: none is used
    def tuning_target(self) -> TuningTarget | None: ...  # None: this model cannot be tuned
    # the runtime's model, for a tuning run to reuse (a second copy might not fit beside it); None: there is none
    def loaded_model(self) -> LoadedModel | None: ...


class RuntimeBackend:
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        ckpt, model = loaded.checkpoint, loaded.model
        self.name = ckpt.path.name
        self.family = ckpt.spec.display_name
        self.remote: str | None = None
        plan = model.dispatcher.describe()
        cpu = plan["cpu"]
        dtype = str(model.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
        if model.accel is None:
            self.placement = f"CPU only · {cpu['threads']} threads · {dtype}"
        else:
            cached = plan["cache"]["indexes"] * plan["cache"]["ways"] + plan["static_experts"]
            self.placement = f"{plan['accelerator'].upper()}: {cached} experts cached · CPU: {cpu['threads']} threads"
        self.stats = GenerationStats()

    def stream(self, messages: list[dict[str, str]], params: SamplingParams) -> Iterator[str]:
        """The answer's text as it is generated; of a harmony answer (gpt-oss), the final channel alone, of Gemma 4's,
        the answer without its thoughts (app/harmony.py)."""
        view = answer_view(self.loaded.tokenizer.chat_template)
        if view is not None:
            return fold(self._text(messages, params, keep_special=view.keep_special), view.shown)
        return self._text(messages, params)

    def _text(self, messages: list[dict[str, str]], params: SamplingParams, keep_special: bool = False
              ) -> Iterator[str]:
        tok = self.loaded.tokenizer
        prompt = tok.encode_chat(messages)
        decoder = StreamDecoder(tok, keep_special)
        self.stats = GenerationStats()
        for token in self.loaded.engine.generate(prompt, params, self.stats):
            text = decoder.push(token)
            if text:
                yield text
        tail = decoder.flush()
        if tail:
            yield tail

    def prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        return len(self.loaded.tokenizer.encode_chat(messages))

    @property
    def context(self) -> int:
        return self.loaded.model.context

    def tuning_target(self) -> TuningTarget | None:
        dtype = "bf16" if self.loaded.model.dtype == torch.bfloat16 else "fp32"
        return TuningTarget(str(self.loaded.checkpoint.path), dtype, self.loaded.checkpoint.raw_config)

    def loaded_model(self) -> LoadedModel | None:
        return self.loaded

    def usage(self) -> Usage:
        s = self.stats
        dispatch = self.loaded.model.dispatcher.request_stats()
        hit = dispatch.hit_rate if self.loaded.model.accel is not None else None
        return Usage(s.decode_tok_s, s.ttft_s, hit, s.prompt_tokens + s.new_tokens, self.loaded.model.context,
                     s.cached_tokens)

    def activity(self) -> list[list[int]]:
        rec = self.loaded.model.dispatcher.recorder
        return (rec.prefill + rec.decode).tolist()

    def close(self) -> None:
        """The conversation's KV cache kept on disk first, where that is on (`--prefix-disk-gb`)."""
        try:
            self.loaded.engine.persist()
        finally:
            self.loaded.model.close()

    def vram(self) -> tuple[int, int] | None:
        accel = self.loaded.model.accel
        return None if accel is None else (accel.used, accel.budget)

    def where(self) -> list[list[str]] | None:
        """Where each expert mostly ran during the last answer: "gpu" (resident), "fetched", "cpu" or ""."""
        per = self.loaded.model.dispatcher.request_stats().per_expert  # [layers, experts, 3]
        names = ("gpu", "cpu", "fetched")
        return [[names[int(c.argmax())] if c.any() else "" for c in row] for row in per]
