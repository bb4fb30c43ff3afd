"""The settings dialog (F2): the system prompt and the sampling settings, checked before they apply."""

from __future__ import annotations

from dataclasses import fields

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from tandem.app.settings import Settings
from tandem.kernels.errors import SettingsError


class SettingsScreen(ModalScreen[Settings | None]):
    """Edit the generation settings; Save validates them, Escape cancels."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, current: Settings) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="form"):
            yield Label("Settings")
            for f in fields(Settings):
                if f.name == "schema":
                    continue
                yield Label(f.name.replace("_", " "))
                yield Input(str(getattr(self.current, f.name)), id=f.name)
            yield Static("", id="error")
            with Horizontal():
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
            return
        values = {i.id: i.value for i in self.query(Input) if i.id}
        try:
            self.dismiss(Settings.from_strings(values))
        except SettingsError as e:
            self.query_one("#error", Static).update(str(e))
