"""Editing an earlier message (Ctrl+Up): choose one of the chat's questions; the chat forks there."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList

from tandem.app.chat.text import fit


class ForkScreen(ModalScreen[int | None]):
    """Dismisses with the index of the chosen question's turn (newest listed first); Escape cancels."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, questions: list[tuple[int, str]]) -> None:
        """`questions`: (turn index, text) of each question, oldest first."""
        super().__init__()
        self.questions = list(reversed(questions))

    def compose(self) -> ComposeResult:
        with Vertical(id="fork"):
            yield Label("Edit which message? A new chat starts from there; this one stays as it is.")
            yield OptionList(*(fit(text, 70) for _, text in self.questions), id="questions")

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.questions[event.option_index][0])
