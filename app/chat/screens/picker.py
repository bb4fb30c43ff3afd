"""Choosing a model to chat with, from what `runtime/discover.py` finds: the built-in model, the configured folders,
the Hugging Face cache, LM Studio's folders and Ollama's store. The search (every GGUF header, every manifest, and the
GPU's memory) runs in a worker: the picker opens at once and fills when it is done."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psutil
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label, Static

from tandem.kernels.errors import TandemError
from tandem.runtime.discover import ModelEntry


@dataclass
class Found(Message):
    """What the search found: the models, and the GPU's memory in bytes (None without a GPU)."""

    entries: list[ModelEntry]
    vram: int | None
    error: str = ""  # why the search stopped short, if it did


def _human(n: float, unit: str) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f} {suffix}{unit}"
    return f"{n:.0f} {unit}"


class PickerScreen(ModalScreen[ModelEntry | None]):
    """Choose a model; Escape keeps the current one. An error from a failed load is shown on top. `find` searches
    (in a worker thread) and returns the models and the GPU's memory."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, find: Callable[[], tuple[list[ModelEntry], int | None]], error: str = "") -> None:
        super().__init__()
        self.find = find
        self.entries: list[ModelEntry] | None = None  # None until the search is done
        self.error = error
        self.vram: int | None = None  # bytes of GPU memory, None without a GPU

    def compose(self) -> ComposeResult:
        with Vertical(id="picker"):
            yield Label("Models (Enter loads, Esc cancels)")
            yield Static(self.error, id="picker-error")
            yield Static("Looking for models…", id="picker-status")
            yield DataTable(id="models", cursor_type="row")

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("model", "family", "quant", "params", "experts", "on disk", "fits RAM",
                                              "on GPU", "from")
        self.search()

    @work(thread=True, exclusive=True, group="picker")
    def search(self) -> None:
        try:
            entries, vram = self.find()
        except (OSError, TandemError) as e:  # an unreadable store must not end the chat
            self.post_message(Found([], None, f"the search for models failed: {e}"))
            return
        self.post_message(Found(entries, vram))

    def on_found(self, message: Found) -> None:
        self.entries, self.vram = message.entries, message.vram
        self.query_one("#picker-status", Static).update(message.error or f"{len(self.entries)} found")
        table = self.query_one(DataTable)
        ram = psutil.virtual_memory().total
        for e in self.entries:
            if e.source.startswith("server"):  # a model on a server: its size and shape are the server's business
                table.add_row(e.name, e.family, "", "–", "–", "–", "–", "–", e.source)
                continue
            unbuilt = e.source == "built-in" and e.size_bytes == 0
            family = e.family if e.runs else f"{e.family} (not run)" if not e.problem else f"{e.family}: {e.problem}"
            table.add_row(e.name, family, e.quant,
                          "135 M ×8" if unbuilt else _human(e.params, ""), str(e.experts),
                          "built on first use" if unbuilt else _human(e.size_bytes, "B"),
                          "yes" if e.fits(ram) else "no (streams)", e.fits_vram(self.vram), e.source)
        table.focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if self.entries is None:
            return
        entry = self.entries[event.cursor_row]
        if entry.problem:  # a damaged model: why, here, rather than a load that fails on some other account
            self.notify(entry.problem, title="This model cannot be loaded", severity="error", timeout=20)
            return
        self.dismiss(entry)
