"""Conversations on disk: one versioned JSON file each under the data folder, written atomically.
A file that cannot be read is moved aside (never fatal) and reported as a notice."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runtime.paths import atomic_write_json, data_dir

SCHEMA = 1


@dataclass
class Turn:
    role: str  # "user" | "assistant" | "system"
    content: str


@dataclass
class Conversation:
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    title: str = "New chat"
    created: float = field(default_factory=time.time)
    turns: list[Turn] = field(default_factory=list)
    schema: int = SCHEMA

    def messages(self, system: str = "") -> list[dict[str, str]]:
        head = [{"role": "system", "content": system}] if system else []
        return head + [{"role": t.role, "content": t.content} for t in self.turns]

    def to_markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        for t in self.turns:
            lines += [f"**{t.role}**", "", t.content, ""]
        return "\n".join(lines)


class ConversationStore:
    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder or data_dir() / "conversations"

    def path(self, conv: Conversation) -> Path:
        return self.folder / f"{conv.id}.json"

    def save(self, conv: Conversation) -> None:
        atomic_write_json(self.path(conv), asdict(conv))

    def delete(self, conv: Conversation) -> None:
        self.path(conv).unlink(missing_ok=True)

    def load_all(self) -> tuple[list[Conversation], list[str]]:
        """Every readable conversation, newest first, and notices about files that were set aside."""
        convs: list[Conversation] = []
        notices: list[str] = []
        if not self.folder.is_dir():
            return convs, notices
        for path in sorted(self.folder.glob("*.json")):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if data.get("schema") != SCHEMA:
                    raise ValueError(f"schema {data.get('schema')}, expected {SCHEMA}")
                turns = [Turn(**t) for t in data.pop("turns")]
                convs.append(Conversation(**data, turns=turns))
            except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
                aside = path.with_name(f"{path.stem}.bad-{int(time.time())}.json.txt")
                path.rename(aside)
                notices.append(f"a conversation file could not be read ({e}); it was set aside as {aside.name}")
        convs.sort(key=lambda c: c.created, reverse=True)
        return convs, notices
