"""Answers whose chain of thought the chat does not show: gpt-oss's "harmony" (only the final channel is shown),
Gemma 4's thought channels and the `<think>` blocks of Qwen3, GLM, MiniMax-M2, HunYuan and others (hidden).
`answer_view(template)` says which a model's answers are.

A harmony answer is a run of messages, each `<|start|>assistant<|channel|>NAME<|message|>TEXT<|end|>` (the first
without `<|start|>assistant`, which the prompt already holds; the last may end in `<|return|>`, `<|call|>` or not at
all, when generation stopped). NAME is `analysis` (the chain of thought), `commentary` (tool calls, preambles) or
`final` (the answer). The chat shows the final channel's text alone: the analysis is hidden, not turned into a
"thinking…" note, because whatever the answer text holds is saved as the answer and sent back to the model in the
next prompt (where harmony puts only final answers). Pure functions over the text streamed so far, special tokens
included (StreamDecoder(keep_special=True)); nothing here knows of tokens or screens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from tandem.runtime.chat_template import render

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
SHOWN = "final"


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes harmony messages (gpt-oss's)."""
    return bool(template) and CHANNEL in template and MESSAGE in template  # type: ignore[operator]


def final_text(answer: str, finished: bool = False) -> str:
    """What the chat shows of a harmony answer streamed so far (`finished`: all of it): the final channel's text.
    The result only grows as the answer does (each message's part depends on that message alone, and a message's
    channel is known once its `<|message|>` arrives), so the chat can show it by deltas. Text that does not start
    as harmony (a model that ignores the format) is shown as it is."""
    if not answer.startswith((CHANNEL, START)):
        return answer if finished or not (CHANNEL.startswith(answer) or START.startswith(answer)) else ""
    shown = []
    for message in answer.split(START):
        header, found, body = message.partition(MESSAGE)
        if not found:  # its channel is not known yet
            continue
        channel = header.partition(CHANNEL)[2].split(" ", 1)[0].split("<|", 1)[0]  # "final", "commentary to=..."
        if channel == SHOWN:
            for end in ENDS:
                body = body.split(end, 1)[0]
            shown.append(body)
    return "".join(shown)


# Gemma 4: a thought is `<|channel>thought\nTEXT<channel|>` before the answer (its template asks for one, empty,
# unless thinking is on, and strips them from earlier answers itself)
THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>", "<channel|>"


def has_thoughts(template: str | None) -> bool:
    """Whether a chat template writes Gemma 4's thought channels."""
    return bool(template) and THOUGHT_OPEN in template and THOUGHT_CLOSE in template  # type: ignore[operator]


def hidden_between(answer: str, opening: str, closing: str, finished: bool = False) -> str:
    """What the chat shows of an answer streamed so far (`finished`: all of it): its text outside `opening` ...
    `closing` blocks (a thought), an unclosed one hidden to its end, leading whitespace left out; until it is
    finished, a last tail that may be an opening's start is held back. The result only grows as the answer does."""
    shown, rest = [], answer
    while True:
        head, opened, tail = rest.partition(opening)
        if not opened:  # the last text: its end may be an opening arriving
            held = 0 if finished else next((k for k in range(len(opening) - 1, 0, -1) if head.endswith(opening[:k])),
                                           0)
            shown.append(head[: len(head) - held])
            break
        shown.append(head)
        _, closed, rest = tail.partition(closing)
        if not closed:
            break
    return "".join(shown).lstrip()


def without_thoughts(answer: str, finished: bool = False) -> str:
    """A Gemma 4 answer without its thought channels (`hidden_between`)."""
    return hidden_between(answer, THOUGHT_OPEN, THOUGHT_CLOSE, finished)


# Qwen3, GLM-4.5, MiniMax-M2, HunYuan, DeepSeek-R1-style models: the thought in <think> ... </think> before the
# answer; a template may open it in the prompt itself (the answer then starts inside it)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PROBE = "Tandem's probe message"


def without_think(answer: str, finished: bool = False) -> str:
    """An answer without its <think> blocks (`hidden_between`)."""
    return hidden_between(answer, THINK_OPEN, THINK_CLOSE, finished)


def without_opened_think(answer: str, finished: bool = False) -> str:
    """`without_think` of an answer whose prompt opened its <think> block."""
    return hidden_between(THINK_OPEN + answer, THINK_OPEN, THINK_CLOSE, finished)


@functools.lru_cache(maxsize=8)  # (asked once an answer: the probe is rendered once a template)
def opens_think(template: str) -> bool:
    """Whether the template's generation prompt opens a <think> block the answer then continues (a probe
    conversation rendered: its text after the user's message)."""
    try:
        text = render(template, [{"role": "user", "content": PROBE}], True, "", "")
    except Exception:  # noqa: BLE001 - a template that needs more than the probe: the answer opens its own
        return False
    tail = text.rpartition(PROBE)[2]
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)


View = Callable[..., str]  # (the answer so far, finished=False) -> what the chat shows of it


@dataclass(frozen=True)
class AnswerView:
    """How the chat shows a model's answers: `shown` (a view that only grows as the answer does), and whether the
    answer's special tokens must be kept for it (harmony's and Gemma 4's markers are special tokens; <think> is text
    in the tokenizers that use it, and a model's other special tokens stay hidden)."""

    shown: View
    keep_special: bool


class Deltas:
    """The deltas of a view of the answer (`final_text`, `hidden_between`'s) as it streams, a chunk (StreamDecoder's)
    at a time; `close` gives what the view held back for the end."""

    def __init__(self, view: View) -> None:
        self.view, self.answer, self.sent = view, "", 0

    def push(self, chunk: str) -> str:
        self.answer += chunk
        return self._delta(self.view(self.answer))

    def close(self) -> str:
        return self._delta(self.view(self.answer, finished=True))

    def _delta(self, shown: str) -> str:
        delta = shown[self.sent :]
        self.sent += len(delta)
        return delta


def answer_view(template: str | None) -> AnswerView | None:
    """How the chat shows a model's answers, by its chat template: harmony's final channel, the answer without its
    thoughts (Gemma 4's channels, <think> blocks), or (None) as they are."""
    if is_harmony(template):
        return AnswerView(final_text, keep_special=True)
    if has_thoughts(template):
        return AnswerView(without_thoughts, keep_special=True)
    if template and THINK_OPEN in template and THINK_CLOSE in template:
        return AnswerView(without_opened_think if opens_think(template) else without_think, keep_special=False)
    return None


def fold(chunks: Iterable[str], view: View = final_text) -> Iterator[str]:
    """A view's deltas over a stream of chunks (the held-back end last), the empty ones left out."""
    deltas = Deltas(view)
    for chunk in chunks:
        delta = deltas.push(chunk)
        if delta:
            yield delta
    delta = deltas.close()
    if delta:
        yield delta
