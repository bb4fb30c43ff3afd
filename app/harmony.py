"""gpt-oss's "harmony" answers, folded for the chat: only the final channel is shown.

A harmony answer is a run of messages, each `<|start|>assistant<|channel|>NAME<|message|>TEXT<|end|>` (the first
without `<|start|>assistant`, which the prompt already holds; the last may end in `<|return|>`, `<|call|>` or not at
all, when generation stopped). NAME is `analysis` (the chain of thought), `commentary` (tool calls, preambles) or
`final` (the answer). The chat shows the final channel's text alone: the analysis is hidden, not turned into a
"thinking…" note, because whatever the answer text holds is saved as the answer and sent back to the model in the
next prompt (where harmony puts only final answers). Pure functions over the text streamed so far, special tokens
included (StreamDecoder(keep_special=True)); nothing here knows of tokens or screens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
SHOWN = "final"


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes harmony messages (gpt-oss's)."""
    return bool(template) and CHANNEL in template and MESSAGE in template  # type: ignore[operator]


def final_text(answer: str) -> str:
    """What the chat shows of a harmony answer streamed so far: the final channel's text. The result only grows as
    the answer does (each message's part depends on that message alone, and a message's channel is known once its
    `<|message|>` arrives), so the chat can show it by deltas. Text that does not start as harmony (a model that
    ignores the format) is shown as it is."""
    if not answer.startswith((CHANNEL, START)):
        return answer if not (CHANNEL.startswith(answer) or START.startswith(answer)) else ""
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


class FinalChannel:
    """The deltas of `final_text` as the answer streams, a chunk (StreamDecoder's, special tokens kept) at a time."""

    def __init__(self) -> None:
        self.answer, self.sent = "", 0

    def push(self, chunk: str) -> str:
        self.answer += chunk
        view = final_text(self.answer)
        delta = view[self.sent :]
        self.sent += len(delta)
        return delta


def fold(chunks: Iterable[str]) -> Iterator[str]:
    """FinalChannel over a stream of chunks: its deltas, the empty ones left out."""
    final = FinalChannel()
    for chunk in chunks:
        delta = final.push(chunk)
        if delta:
            yield delta
