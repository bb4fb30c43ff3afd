"""Choosing a model to chat with, from what `runtime/discover.py` finds: the built-in model, the configured folders,
the Hugging Face cache, LM Studio's folders and Ollama's store."""

from __future__ import annotations

import psutil
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label, Static

from tandem.runtime.discover import ModelEntry


def _human(n: float, unit: str) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f} {suffix}{unit}"
    return f"{n:.0f} {unit}"


class PickerScreen(ModalScreen[ModelEntry | None]):
    """Choose a model; Escape keeps the current one. An error from a failed load is shown on top."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, entries: list[ModelEntry], error: str = "", vram: int | None = None) -> None:
        super().__init__()
        self.entries = entries
        self.error = error
        self.vram = vram  # bytes of GPU memory, None without a GPU

    def compose(self) -> ComposeResult:
        with Vertical(id="picker"):
            yield Label("Models (Enter loads, Esc cancels)")
            yield Static(self.error, id="picker-error")
            yield DataTable(id="models", cursor_type="row")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("model", "family", "quant", "params", "experts", "on disk", "fits RAM", "on GPU", "from")
        ram = psutil.virtual_memory().total
        for e in self.entries:
            unbuilt = e.source == "built-in" and e.size_bytes == 0
            table.add_row(e.name, e.family if e.runs else f"{e.family} (not run)", e.quant,
                          "135 M ×8" if unbuilt else _human(e.params, ""), str(e.experts),
                          "built on first use" if unbuilt else _human(e.size_bytes, "B"),
                          "yes" if e.fits(ram) else "no (streams)", e.fits_vram(self.vram), e.source)
        table.focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(self.entries[event.cursor_row])
