"""The settings dialog (F2): the chat's system prompt and sampling settings, checked before they apply; ticked,
they become the defaults for new chats too.

It opens on the system prompt (several lines: Enter starts a new one there). In any other field Enter saves, and
Ctrl+S saves from anywhere; Escape cancels.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Static, TextArea

from tandem.app.chat.settings import FORM_FIELDS, Settings
from tandem.kernels.errors import SettingsError


@dataclass(frozen=True)
class SettingsChoice:
    settings: Settings
    for_new_chats: bool  # also the defaults that new chats start with


class SettingsScreen(ModalScreen[SettingsChoice | None]):
    """Edit the generation settings; Save (Enter in a field, Ctrl+S) validates them, Escape cancels."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"),
                Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, current: Settings, title: str = "Settings for this chat") -> None:
        super().__init__()
        self.current = current
        self.title_text = title

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="form"):
            yield Label(self.title_text)
            yield Label("system prompt (Enter starts a new line; Ctrl+S saves)")
            yield TextArea(self.current.system_prompt, id="system_prompt", soft_wrap=True, show_line_numbers=False)
            for name in FORM_FIELDS:
                yield Label(name.replace("_", " "))
                yield Input(str(getattr(self.current, name)), id=name)
            yield Checkbox("Also use these for new chats", id="for_new")
            yield Static("", id="error")
            with Horizontal():
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        prompt = self.query_one("#system_prompt", TextArea)
        prompt.focus()
        prompt.move_cursor(prompt.document.end)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
        else:
            self.action_save()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_save()

    def action_save(self) -> None:
        values = {i.id: i.value for i in self.query(Input) if i.id}
        values["system_prompt"] = self.query_one("#system_prompt", TextArea).text
        try:
            new = Settings.from_strings(values)
        except SettingsError as e:
            self.query_one("#error", Static).update(str(e))
            return
        kept = {f.name: getattr(self.current, f.name) for f in fields(Settings)
                if f.name not in values and f.name != "schema"}  # what the form does not show (the theme)
        for name, value in kept.items():
            setattr(new, name, value)
        self.dismiss(SettingsChoice(new, self.query_one("#for_new", Checkbox).value))
