"""A conversation and its turns, and the rules a saved one must follow to be read back.

Ids are generated (12 hex digits) and checked wherever one names a file, so no id read from disk can point
outside the conversations folder. Every field of a saved conversation is checked for its type and range
when read; a file that fails says which field is wrong.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

SCHEMA = 2  # every turn has an id, so the turns of two writers merge
READS = (1, SCHEMA)  # schema 1's turns have no ids: each is derived from the turn when read (the same in every reader)
ROLES = ("user", "assistant", "system")
ID_FORM = re.compile(r"[0-9a-f]{12}")


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def valid_id(value: object) -> bool:
    """Whether `value` has the generated form: anything else (a path, `..`, upper case) is never a file name."""
    return isinstance(value, str) and ID_FORM.fullmatch(value) is not None


@dataclass
class Turn:
    role: str  # "user" | "assistant" | "system"
    content: str
    id: str = field(default_factory=new_id)


@dataclass
class Conversation:
    id: str = field(default_factory=new_id)
    title: str = "New chat"
    created: float = field(default_factory=time.time)
    turns: list[Turn] = field(default_factory=list)
    schema: int = SCHEMA
    # what this copy last read from or wrote to disk: the base that a save merges other writers' changes onto
    synced_turns: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    synced_title: str | None = field(default=None, repr=False, compare=False)

    def messages(self, system: str = "") -> list[dict[str, str]]:
        """The prompt's messages. A question left without an answer (it failed, or was stopped before a word)
        and the next one go as one message: chat templates want user and assistant to alternate."""
        out = [{"role": "system", "content": system}] if system else []
        for t in self.turns:
            if out and out[-1]["role"] == t.role == "user":
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{t.content}"}
            else:
                out.append({"role": t.role, "content": t.content})
        return out

    def to_markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        for t in self.turns:
            lines += [f"**{t.role}**", "", t.content, ""]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "created": self.created, "schema": SCHEMA,
                "turns": [{"role": t.role, "content": t.content, "id": t.id} for t in self.turns]}

    def mark_synced(self) -> None:
        self.synced_turns = frozenset(t.id for t in self.turns)
        self.synced_title = self.title


def _get(data: dict[str, Any], name: str, kind: type, what: str) -> Any:
    if name not in data:
        raise ValueError(f"'{name}' is missing")
    value = data[name]
    if not isinstance(value, kind) or isinstance(value, bool):  # (bool is an int in Python, never one here)
        raise ValueError(f"'{name}' is {value!r}, not {what}")
    return value


def conversation_from_dict(data: Any, file_id: str) -> Conversation:
    """A conversation read from the file named `<file_id>.json`; raises ValueError naming the first bad field."""
    if not isinstance(data, dict):
        raise ValueError("it is not a JSON object")
    schema = data.get("schema")
    if isinstance(schema, bool) or schema not in READS:
        raise ValueError(f"schema {schema!r}, this Tandem reads {' and '.join(map(str, READS))}")
    unknown = set(data) - {"id", "title", "created", "turns", "schema"}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    conv_id = _get(data, "id", str, "a text")
    if not valid_id(conv_id):
        raise ValueError(f"'id' is {conv_id!r}, not 12 hex digits")
    if conv_id != file_id:
        raise ValueError(f"'id' is {conv_id!r} but the file is named {file_id}.json")
    title = _get(data, "title", str, "a text")
    created = _get(data, "created", (int, float), "a time in seconds")
    if not math.isfinite(created):
        raise ValueError(f"'created' is {created!r}, not a finite number")
    raw_turns = _get(data, "turns", list, "a list")
    turns: list[Turn] = []
    for i, raw in enumerate(raw_turns):
        turns.append(_turn(raw, i, conv_id, schema))
    if len({t.id for t in turns}) != len(turns):
        raise ValueError("two turns have the same id")
    conv = Conversation(conv_id, title, float(created), turns)
    conv.mark_synced()
    return conv


def _turn(raw: Any, i: int, conv_id: str, schema: int) -> Turn:
    where = f"turn {i + 1}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} is not a JSON object")
    allowed = {"role", "content"} | ({"id"} if schema >= 2 else set())
    unknown = set(raw) - allowed
    if unknown or not {"role", "content"} <= set(raw):
        raise ValueError(f"{where} has the fields {sorted(raw)}, expected {sorted(allowed)}")
    role, content = raw["role"], raw["content"]
    if role not in ROLES:
        raise ValueError(f"{where} has the role {role!r}, not one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise ValueError(f"{where} has the content {content!r}, not a text")
    if schema < 2:  # the same id in every process that reads this file, so their saves still merge
        turn_id = hashlib.sha256(f"{conv_id}/{i}/{role}/{content}".encode()).hexdigest()[:12]
    else:
        turn_id = raw.get("id")
        if not valid_id(turn_id):
            raise ValueError(f"{where} has the id {turn_id!r}, not 12 hex digits")
    return Turn(role, content, turn_id)


def merge_turns(disk: list[Turn], mine: list[Turn], synced: frozenset[str]) -> list[Turn]:
    """The turns to save when another writer may have changed the file since this copy last read or wrote it.

    `synced` holds the ids this copy last saw on disk. A turn it has since removed (retry, edit) stays removed;
    a turn the other writer removed stays removed; everyone's new turns are kept: the file's first, in its
    order, then this copy's. So no writer ever loses a turn to another."""
    mine_ids = {t.id for t in mine}
    disk_ids = {t.id for t in disk}
    removed_here = synced - mine_ids
    kept = [t for t in disk if t.id not in removed_here]
    added_here = [t for t in mine if t.id not in disk_ids and t.id not in synced]
    return kept + added_here
