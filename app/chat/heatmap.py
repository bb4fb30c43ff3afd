"""The expert-activity panel (Ctrl+E): layers × experts, how often each expert fired for the current answer, and
where it ran.

It reads a `ChatBackend` (`activity()`, `where()`) and draws text; it keeps no model and starts nothing. While an
answer streams it redraws at most every `LIVE_EVERY_S` (reading the counts costs a copy of a [layers, experts]
table). The panel scrolls (keyboard when focused, mouse wheel): a deep model has more layers than rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.markup import escape
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.timer import Timer
from textual.widgets import Static

from tandem.app.chat.backend import ChatBackend

SHADES = " ░▒▓█"  # fuller = more tokens: the same on dark and light themes (unlike darker or lighter)
LIVE_EVERY_S = 0.5  # while an answer streams: at most twice a second
ROW_LABEL = 4  # "{layer:>3} " before each row's cells
# where an expert ran: its legend name and colour. Theme text colours ($text-*) are made legible on the theme's
# own background, dark or light; raw "green"/"yellow" are not (yellow on a light background is unreadable).
PLACES = {"gpu": ("GPU", "$text-success"), "fetched": ("copied", "$text-warning"), "cpu": ("CPU", "")}


def _place(places: set[str]) -> str:
    """A cell's colour key for the experts it stands for: the GPU wins, then a copy, else the CPU."""
    return "gpu" if "gpu" in places else "fetched" if "fetched" in places else "cpu" if "cpu" in places else ""


def heatmap_text(counts: Sequence[Sequence[int]], width: int = 64,
                 where: Sequence[Sequence[str]] | None = None) -> str:
    """The panel's text (Textual markup): a legend, then a row per layer of at most `width` cells. Wide expert
    counts (128) are folded into groups so a row still fits; the legend says how many experts a cell stands for.
    `where` (optional, "gpu" | "fetched" | "cpu" | "" per expert) colours each cell by where its experts mostly
    ran; the legend names only the places that occur, and none when everything ran on the CPU."""
    if not counts or not counts[0]:
        return "no expert activity yet"
    experts = len(counts[0])
    group = max(1, -(-experts // max(8, width)))
    peak = max(1, max(max(row) for row in counts))
    lines = [f"experts per cell: {group} · rows: layers", f"tokens: {SHADES[1:]} few → many"]
    used = {w for row in where for w in row} if where is not None else set()
    if used & {"gpu", "fetched"}:  # (only the CPU, or nothing recorded: one colour, no legend)
        lines.append(" · ".join(f"[{color}]█[/] {name}" if color else f"█ {name}"
                                for key, (name, color) in PLACES.items() if key in used))
    for i, row in enumerate(counts):
        cells = [sum(row[j : j + group]) for j in range(0, experts, group)]
        if not any(cells):
            lines.append(f"{i:>3} (dense)")
            continue
        out = []
        for k, c in enumerate(cells):
            glyph = SHADES[min(4, (4 * c + peak - 1) // peak)]
            color = ""
            if where is not None:
                color = PLACES.get(_place(set(where[i][k * group : (k + 1) * group])), ("", ""))[1]
            out.append(f"[{color}]{glyph}[/]" if color and c else glyph)
        lines.append(f"{i:>{ROW_LABEL - 1}} " + "".join(out))
    return "\n".join(lines)


class ExpertHeatmap(VerticalScroll):
    """The panel: hidden until toggled (the `visible` class), its text in one Static that scrolls."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.text = "no expert activity yet"  # what it shows now (markup), also before it is mounted
        self._shown_at = float("-inf")  # when it last read the backend (monotonic seconds)
        self._later: Timer | None = None  # a live redraw put off by the limit
        self._shown: tuple[Sequence[Sequence[int]], Sequence[Sequence[str]] | None] | None = None  # counts, where

    def compose(self) -> ComposeResult:
        yield Static(self.text, id="heatmap-rows")

    def show(self, counts: Sequence[Sequence[int]], width: int = 64,
             where: Sequence[Sequence[str]] | None = None) -> None:
        self._shown = (counts, where)
        self.text = heatmap_text(counts, width, where)
        for rows in self.query("#heatmap-rows").results(Static):
            rows.update(self.text)

    def follow(self, backend: ChatBackend | None, live: bool = False) -> None:
        """Show `backend`'s activity if the panel is visible. `live` (tokens arriving): at most every `LIVE_EVERY_S`
        so a fast stream does not redraw it every batch; a redraw put off is done when the time is up, so what
        arrived last is shown even when the stream pauses."""
        if backend is None or not self.has_class("visible"):
            return
        now = time.monotonic()
        if live and now - self._shown_at < LIVE_EVERY_S:
            if self._later is None:
                self._later = self.set_timer(self._shown_at + LIVE_EVERY_S - now, lambda: self.follow(backend))
            return
        if self._later is not None:
            self._later.stop()
            self._later = None
        self._shown_at = now
        if backend.remote is not None:
            self.say(f"expert activity is shown for models run here; this chat runs on {backend.remote}")
            return
        self.show(backend.activity(), width=self.cells(), where=backend.where())

    def say(self, text: str) -> None:
        """A line instead of the rows (why there are none)."""
        self._shown = None
        self.text = escape(text)
        for rows in self.query("#heatmap-rows").results(Static):
            rows.update(self.text)

    def cells(self) -> int:
        """How many cells a row has room for (at least 8)."""
        return max(8, self.scrollable_content_region.width - ROW_LABEL)

    def on_resize(self) -> None:
        """Drawn again for the new width: a panel shown the moment it is toggled on has no width yet, and the
        terminal may be resized."""
        if self._shown is not None:
            self.show(self._shown[0], width=self.cells(), where=self._shown[1])
