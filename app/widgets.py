"""The chat screen's widgets: the composer, a message, the status bar, the expert-activity heatmap."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea

from tandem.app.backend import Usage


class Composer(TextArea):
    """Multi-line input: Enter sends, Shift+Enter or Ctrl+J starts a new line."""

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


class ChatMessage(Markdown):
    """One turn of the conversation, rendered as Markdown (code blocks highlighted)."""

    def __init__(self, role: str, text: str = "") -> None:
        super().__init__(text, classes=role)
        self.role = role
        self.text = text
        self.border_title = "you" if role == "user" else "assistant"

    def set_text(self, text: str) -> None:
        self.text = text
        self.update(text)


class StatusBar(Static):
    """Model and family, where work runs, decode speed, time to first token, hit rate, context used."""

    def show(self, model: str, family: str, placement: str, usage: Usage | None, state: str = "") -> None:
        parts = [f"{model} ({family})", placement]
        if usage is not None:
            parts.append(f"{usage.tok_s:.1f} tok/s" if usage.tok_s else "– tok/s")
            parts.append(f"TTFT {usage.ttft_s * 1000:.0f} ms")
            if usage.hit_rate is not None:
                parts.append(f"hits {usage.hit_rate:.0%}")
            parts.append(f"ctx {usage.context_used}/{usage.context_size}")
        if state:
            parts.append(state)
        self.update(" · ".join(parts))


SHADES = " ░▒▓█"


class ExpertHeatmap(Static):
    """Layers × experts: how often each expert fired for the current answer. Wide expert counts (128) are
    folded into groups so a row still fits; the legend says how many experts a cell stands for."""

    COLORS = {"gpu": "green", "fetched": "yellow", "cpu": ""}

    def show(self, counts: list[list[int]], width: int = 64, where: list[list[str]] | None = None) -> None:
        """`where` (optional) colours each cell by where its experts mostly ran: green on the GPU (cache
        hit or static), yellow copied over on demand, plain on the CPU."""
        if not counts or not counts[0]:
            self.update("no expert activity yet")
            return
        experts = len(counts[0])
        group = max(1, -(-experts // max(8, width)))
        peak = max(1, max(max(row) for row in counts))
        lines = [f"experts per cell: {group} · darker = more tokens · rows are layers"]
        if where is not None:
            lines.append("[green]█ GPU[/] · [yellow]█ copied[/] · █ CPU")
        for i, row in enumerate(counts):
            cells = [sum(row[j : j + group]) for j in range(0, experts, group)]
            if not any(cells):
                lines.append(f"{i:>3} (dense)")
                continue
            out = []
            for k, c in enumerate(cells):
                glyph = SHADES[min(4, (4 * c + peak - 1) // peak)]
                places = {where[i][j] for j in range(k * group, min(experts, (k + 1) * group))} if where else set()
                place = "gpu" if "gpu" in places else "fetched" if "fetched" in places else ""
                color = self.COLORS.get(place, "")
                out.append(f"[{color}]{glyph}[/]" if color and c else glyph)
            lines.append(f"{i:>3} " + "".join(out))
        self.update("\n".join(lines))
