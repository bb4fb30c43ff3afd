"""The chat screen's widgets: the composer, a message, the status bar (the expert heatmap is `heatmap.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from markdown_it import MarkdownIt
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea

from tandem.app.chat.backend import Usage


class Composer(TextArea):
    """Multi-line input: Enter sends, Ctrl+J starts a new line (Shift+Enter too, in terminals that report it)."""

    @dataclass
    class Submitted(Message):
        text: str

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.prevent_default()
            event.stop()
            text = self.text.strip()
            if text:
                self.post_message(self.Submitted(text))
                self.clear()
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.prevent_default()
            event.stop()
            self.insert("\n")
            return
        await super()._on_key(event)


class ChatMessage(Vertical):
    """One turn of the conversation. The user's text is shown as typed (line breaks, `#`, `_` and `*` kept: it is
    what they wrote, not a document); an answer is rendered as Markdown (code blocks highlighted)."""

    def __init__(self, role: str, text: str = "", note: str = "", queued: bool = False) -> None:
        super().__init__(classes=f"{role} queued" if queued else role)
        self.role = role
        self.text = text
        self.note = note  # after the role in the border: the model that wrote it, its version (‹1/2›), "queued"
        self.body: Markdown | Static = Markdown(text, parser_factory=_parser) if role == "assistant" \
            else Static(_plain(text))
        self._title()

    def compose(self) -> ComposeResult:
        yield self.body

    def _title(self) -> None:
        who = "you" if self.role == "user" else "assistant"
        self.border_title = f"{who} · {self.note}" if self.note else who

    def set_text(self, text: str) -> None:
        self.text = text
        if isinstance(self.body, Markdown):
            self.body.update(text)
        else:
            self.body.update(_plain(text))

    async def append_text(self, more: str) -> None:
        """`more` at the end: an answer's Markdown parses and paints from its last block on, not the whole text again
        (a streamed answer grows by a few tokens a repaint; redoing all of it each time cost the engine half its
        speed on two cores). Returns once the new blocks are mounted: the caller's next message (the answer's end)
        then finds the whole answer on screen, not part of it still being parsed."""
        self.text += more
        if isinstance(self.body, Markdown):
            await self.body.append(more)
        else:
            self.body.update(_plain(self.text))

    async def finish(self) -> None:
        """The answer is whole: its Markdown is built once more from the whole text. A block updated in place while
        the answer streamed can keep the height of its earlier, shorter text (Textual 8 caches a widget's box model
        by a counter that an update landing while a layout of it is pending does not move: the answer then shows cut
        off until something else lays it out); blocks built afresh cannot."""
        if isinstance(self.body, Markdown):
            await self.body.update(self.text)

    def set_note(self, note: str) -> None:
        self.note = note
        self._title()

    def shown_text(self) -> str:
        """What the message shows, as plain text (the user's text exactly as typed)."""
        if isinstance(self.body, Static):
            return str(self.body.render())
        return self.text


@cache
def _parser() -> MarkdownIt:
    """One Markdown parser for every answer (Textual makes a new one for each fragment it appends otherwise, and
    making one costs more than parsing a fragment). Parsing keeps no state in it."""
    return MarkdownIt("gfm-like")


def _plain(text: str) -> Text:
    """Text as typed: no markup, no Markdown, every line kept."""
    return Text(text, no_wrap=False)


class StatusBar(Static):
    """What is happening (first, so a narrow window still shows it), the model and where it runs, the last answer's
    speed in this chat, the context this chat and its draft take, the memory in use."""

    def show(self, model: str, placement: str, state: str = "", usage: Usage | None = None,
             context: tuple[int, int] | None = None, memory: str = "") -> None:
        """`usage`: the numbers of this chat's last answer (None before one: no speed to show)."""
        parts = [state] if state else []
        parts += [model, placement]
        if usage is not None:
            parts.append(f"{usage.tok_s:.1f} tok/s" if usage.tok_s else "– tok/s")
            parts.append(f"TTFT {usage.ttft_s * 1000:.0f} ms")
            if usage.hit_rate is not None:
                parts.append(f"hits {usage.hit_rate:.0%}")
        if context is not None:
            parts.append(f"ctx {context[0]}/{context[1] or '?'}")
        if usage is not None and usage.cached:  # the last prompt's tokens the KV cache held: not read again
            parts.append(f"{usage.cached} cached")
        if memory:
            parts.append(memory)
        self.update(Text(" · ".join(parts)))

