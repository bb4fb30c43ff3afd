"""The help dialog (F1 or ?): every key, how to switch chats and copy text, and where the chats are stored.

The keys are read from the bindings of the app, the chat screen and Tandem's own widgets when the dialog opens,
so a binding added anywhere shows up here without editing this file; a binding whose action copies something is
listed under "Copying". Every key is spelled one way: "Ctrl+N", "F1, ?", "Esc".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.dom import DOMNode
from textual.keys import key_to_character
from textual.screen import ModalScreen
from textual.widgets import Label, Static

MODIFIERS = {"ctrl": "Ctrl", "shift": "Shift", "alt": "Alt", "meta": "Meta", "super": "Super"}
NAMES = {"escape": "Esc", "enter": "Enter", "tab": "Tab", "space": "Space", "backspace": "Backspace",
         "delete": "Del", "insert": "Ins", "home": "Home", "end": "End", "pageup": "PgUp", "pagedown": "PgDn",
         "up": "↑", "down": "↓", "left": "←", "right": "→"}


def key_label(keys: str) -> str:
    """A binding's keys as a user reads them: "f1,question_mark" → "F1, ?", "ctrl+n" → "Ctrl+N"."""
    return ", ".join(_one_key(key.strip()) for key in keys.split(","))


def _one_key(key: str) -> str:
    *mods, base = key.split("+")
    if base in NAMES:
        name = NAMES[base]
    elif base[:1] == "f" and base[1:].isdigit():
        name = base.upper()
    else:
        char = key_to_character(base) or base
        # a letter with a modifier is written upper case (Ctrl+N); alone it is the character typed (q, ?)
        name = (char.upper() if mods else char) if len(char) == 1 else base.replace("_", " ").title()
    return "+".join([*(MODIFIERS.get(m, m.title()) for m in mods), name])


@dataclass(frozen=True)
class KeyRow:
    keys: str  # as shown: "F1, ?"
    what: str  # the binding's description
    action: str


def key_rows(bindings: Iterable[Binding]) -> list[KeyRow]:
    """One row per action and description (its keys joined, "F1, ?"), in the order first bound; bindings without a
    description are internal (Textual's Ctrl+C quit hint) and left out."""
    keys: dict[tuple[str, str], list[str]] = {}
    for b in bindings:
        if b.description:
            keys.setdefault((b.action, b.description), []).append(b.key)
    return [KeyRow(key_label(",".join(k)), what, action) for (action, what), k in keys.items()]


def bindings_of(node: DOMNode) -> list[Binding]:
    """Every binding `node` answers to: its class's, the classes' it inherits and those bound at run time (the
    app's command palette key). (`_bindings`: Textual keeps them there; it has no public list but the focused
    ones.)"""
    return [b for bound in node._bindings.key_to_bindings.values() for b in bound]


def own_widget_bindings(nodes: Iterable[DOMNode]) -> list[Binding]:
    """The bindings Tandem's own widget classes declare (a copy key on a message, say), once per class. Textual's
    widgets' keys (the text area's editing keys) are theirs to document."""
    out: list[Binding] = []
    seen: set[type] = set()
    for node in nodes:
        for cls in type(node).__mro__:
            if cls in seen or not cls.__module__.startswith("tandem."):
                continue
            seen.add(cls)
            out += [b for b in Binding.make_bindings(cls.__dict__.get("BINDINGS", []))]
    return out


def is_copy(row: KeyRow) -> bool:
    return "copy" in row.action.lower()


@dataclass(frozen=True)
class HelpContent:
    keys: list[KeyRow]  # every key, copy keys included
    store_folder: Path  # where the conversations are saved
    exports_folder: Path  # where Ctrl+S exports them unless told otherwise


class HelpScreen(ModalScreen[None]):
    """Every key, switching chats, copying, where chats are stored."""

    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close")]

    def __init__(self, content: HelpContent) -> None:
        super().__init__()
        self.content = content

    def compose(self) -> ComposeResult:
        keys = self.content.keys
        width = max((len(r.keys) for r in keys), default=0) + 2

        def table(rows: list[KeyRow]) -> str:
            return "\n".join(f"{r.keys:<{width}}{r.what}" for r in rows)

        new_chat = next((r.keys for r in keys if r.action == "new_conversation"), None)
        copying = [r for r in keys if is_copy(r)]
        # markup off: paths and key names may hold "[" (a folder name, a bracket key)
        with VerticalScroll(id="help"):
            yield Label("Keys")
            yield Static(table([r for r in keys if not is_copy(r)]), markup=False)
            yield Label("Switching chats", classes="section")
            yield Static("The chats are listed on the left. Tab moves there (or click it), ↑ and ↓ pick a chat, "
                         "Enter opens it" + (f"; {new_chat} starts a new one." if new_chat else "."), markup=False)
            yield Label("Copying", classes="section")
            yield Static((table(copying) + "\n" if copying else "") +
                         "Drag the mouse over text to select it, then press a copy key. Where the terminal allows "
                         "it, dragging with Shift held selects for the terminal's own copy instead.", markup=False)
            yield Label("Where chats are stored", classes="section")
            yield Static(f"{self.content.store_folder}\none JSON file per chat (its turns, settings and model)\n"
                         f"Ctrl+S exports to {self.content.exports_folder} unless you pick another path",
                         markup=False)
