"""The help dialog (F1 or ?): every key, in one place."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, Static


class HelpScreen(ModalScreen[None]):
    """Every key, in one place."""

    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close")]

    def __init__(self, keys: list[tuple[str, str]]) -> None:
        super().__init__()
        self.keys = keys

    def compose(self) -> ComposeResult:
        rows = "\n".join(f"{key:<16} {what}" for key, what in self.keys)
        with Vertical(id="help"):
            yield Label("Keys")
            yield Static(rows)
            yield Label("Ctrl+P opens the command palette with every action.")
