"""The export dialog (Ctrl+S): where the conversation goes, as Markdown or JSON, with its metadata."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, RadioButton, RadioSet

FORMATS = {"md": "Markdown", "json": "JSON"}


@dataclass(frozen=True)
class ExportChoice:
    path: Path
    fmt: str  # "md" | "json"


class ExportScreen(ModalScreen[ExportChoice | None]):
    """A path (prefilled with the default, `~` understood) and a format; Enter exports, Escape cancels."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, defaults: dict[str, Path]) -> None:
        """`defaults`: the default file for each format."""
        super().__init__()
        self.defaults = defaults
        self.fmt = "md"

    def compose(self) -> ComposeResult:
        with Vertical(id="export"):
            yield Label("Export the conversation (Enter exports, Esc cancels)")
            with RadioSet(id="format"):
                for fmt, name in FORMATS.items():
                    yield RadioButton(name, value=fmt == self.fmt, name=fmt)
            yield Label("to the file (or a folder):")
            yield Input(str(self.defaults[self.fmt]), id="path")

    def on_mount(self) -> None:
        self.query_one("#path", Input).focus()

    @on(RadioSet.Changed)
    def format_changed(self, event: RadioSet.Changed) -> None:
        """The path follows the format while it is the default one (a path the user typed stays)."""
        path = self.query_one("#path", Input)
        new = event.pressed.name or "md"
        if path.value == str(self.defaults[self.fmt]):
            path.value = str(self.defaults[new])
        self.fmt = new

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if text:
            self.dismiss(ExportChoice(Path(text).expanduser(), self.fmt))
