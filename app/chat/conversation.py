"""A conversation and its turns, and the rules a saved one must follow to be read back.

A conversation keeps its own settings (system prompt, sampling) and model when the app records them; each
answer keeps the model that wrote it and, after a regenerate, every version of itself. It can be forked from an
earlier turn, searched and rendered as Markdown. Plain data: no file is read or written here (that is
`tandem.app.chat.store`), and nothing here knows the UI.

Ids are generated (12 hex digits) and checked wherever one names a file, so no id read from disk can point
outside the conversations folder. Every field of a saved conversation is checked for its type and range
when read; a file that fails says which field is wrong.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tandem.app.chat.settings import GENERATION_FIELDS, Settings
from tandem.kernels.errors import SettingsError

# 3: a conversation records when it was last used, its settings and model; an answer its model and versions
SCHEMA = 3
# schema 1's turns have no ids: each is derived from the turn when read (the same in every reader);
# schemas 1 and 2 read as updated = created, no settings, model or versions recorded
READS = (1, 2, SCHEMA)
ROLES = ("user", "assistant", "system")
ID_FORM = re.compile(r"[0-9a-f]{12}")
SETTINGS_FIELDS = GENERATION_FIELDS  # saved per conversation


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def valid_id(value: object) -> bool:
    """Whether `value` has the generated form: anything else (a path, `..`, upper case) is never a file name."""
    return isinstance(value, str) and ID_FORM.fullmatch(value) is not None


@dataclass(frozen=True)
class ChatModel:
    """The model a conversation talks to."""

    path: str | None  # the model folder; None = the built-in model
    name: str  # shown to the user

    def __post_init__(self) -> None:
        """Refused here as when read (ValueError naming the field), so no save writes a model no reader takes."""
        if self.path is not None and (not isinstance(self.path, str) or not self.path):  # "" is the current folder
            raise ValueError(f"'model.path' is {self.path!r}, not a folder (a text) or none (the built-in model)")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"'model.name' is {self.name!r}, not a name (a text)")


@dataclass
class Version:
    """One version of an answer: regenerate adds one and the older ones stay."""

    content: str
    model: str  # the display name of the model that wrote it ("" = unknown)


@dataclass
class Turn:
    role: str  # "user" | "assistant" | "system"
    content: str  # what is shown and sent to the model: the shown version's content
    id: str = field(default_factory=new_id)
    model: str = ""  # the display name of the model that wrote this answer; "" for user/system turns or unknown
    # every version of an answer, once it has two or more (one version is just content + model: files stay
    # small). `content` and `model` are the truth for the shown one: the app may stream into `content`, and
    # `versions[shown]` takes them whenever the versions are read (`all_versions`) or switched.
    versions: list[Version] = field(default_factory=list)
    shown: int = 0  # the index (0-based) in `versions` of the version shown; 0 while there are none

    @property
    def version_count(self) -> int:
        return len(self.versions) or 1

    def all_versions(self) -> list[Version]:
        """Every version, in order, the shown one as `content` and `model` now hold it."""
        if not self.versions:
            return [Version(self.content, self.model)]
        out = list(self.versions)
        if 0 <= self.shown < len(out):  # (one set out of range by hand is left for the save to refuse)
            out[self.shown] = Version(self.content, self.model)
        return out

    def add_version(self, content: str, model: str) -> None:
        """A new version of this answer (regenerate), shown from now on; the first call also keeps the current
        answer as version 1. Only an answer has versions: ValueError for a user or system turn."""
        if self.role != "assistant":
            raise ValueError(f"a {self.role} turn has no versions; only an answer is regenerated")
        self.versions = self.all_versions() + [Version(content, model)]
        self.shown = len(self.versions) - 1
        self.content, self.model = content, model

    def show_version(self, k: int) -> None:
        """Show version `k` (0-based): `content` and `model` become its own. IndexError when there is none."""
        if not 0 <= k < self.version_count:
            raise IndexError(f"version {k} of an answer with {self.version_count} (they count from 0)")
        if not self.versions:
            return
        self.versions = self.all_versions()
        self.shown = k
        self.content, self.model = self.versions[k].content, self.versions[k].model

    def answer_state(self) -> tuple[str, str, tuple[tuple[str, str], ...], int]:
        """What a regenerate or a version switch changes: a save compares it with the last synced one."""
        versions = tuple((v.content, v.model) for v in self.all_versions()) if self.versions else ()
        return self.content, self.model, versions, self.shown

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content, "id": self.id}
        if self.model:  # left out when unknown (user and system turns): files stay small
            out["model"] = self.model
        if self.versions:
            out["versions"] = [{"content": v.content, "model": v.model} for v in self.all_versions()]
            out["shown"] = self.shown
        return out


@dataclass
class Conversation:
    id: str = field(default_factory=new_id)
    title: str = "New chat"
    created: float = field(default_factory=time.time)
    turns: list[Turn] = field(default_factory=list)
    schema: int = SCHEMA
    # the last use (a turn added, a rename, settings changed): the app calls `touch()`. NaN, which no file can
    # hold (times are checked to be finite), means "not given": it becomes `created`
    updated: float = math.nan
    settings: Settings | None = None  # None = none recorded (older files): the app uses its own
    model: ChatModel | None = None  # None = not recorded
    # what this copy last read from or wrote to disk: the base that a save merges other writers' changes onto
    synced_turns: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    synced_title: str | None = field(default=None, repr=False, compare=False)
    synced_settings: Settings | None = field(default=None, repr=False, compare=False)
    synced_model: ChatModel | None = field(default=None, repr=False, compare=False)
    synced_answers: dict[str, tuple[Any, ...]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if math.isnan(self.updated):
            self.updated = self.created

    def touch(self) -> None:
        """Record a use now (a turn added, a rename, settings changed): the list shows the newest first."""
        self.updated = time.time()

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

    def fork(self, upto: int, title: str | None = None) -> Conversation:
        """A new conversation holding copies of the first `upto` turns (to edit turn `upto` and go on from there),
        with this one's settings and model. This one is never changed. ValueError when `upto` is out of range."""
        if not 0 <= upto <= len(self.turns):
            raise ValueError(f"a fork keeps 0 to {len(self.turns)} turns, not {upto}")
        turns = [dataclasses.replace(copy.deepcopy(t), id=new_id()) for t in self.turns[:upto]]
        now = time.time()
        return Conversation(title=title if title is not None else f"{self.title} (fork)", created=now,
                            turns=turns, updated=now, settings=copy.deepcopy(self.settings), model=self.model)

    def matches(self, query: str) -> bool:
        """Whether every word of `query` (split at white space, any case) is in the title or in some turn,
        any version of it. An empty query matches every conversation."""
        words = query.casefold().split()
        if not words:
            return True
        texts = [self.title.casefold()] + [v.content.casefold() for t in self.turns for v in t.all_versions()]
        return all(any(w in text for text in texts) for w in words)

    def to_markdown(self, exported: float | None = None) -> str:
        """The conversation as Markdown: a metadata block (dates, model, system prompt, sampling), then every
        turn; an answer says which model wrote it and, with several versions, shows every one, marked."""
        lines = [f"# {self.title}", ""]
        lines.append(f"- Created: {iso_time(self.created)}")
        lines.append(f"- Updated: {iso_time(self.updated)}")
        if exported is not None:
            lines.append(f"- Exported: {iso_time(exported)}")
        if self.model is None:
            lines.append("- Model: not recorded")
        else:
            lines.append(f"- Model: {self.model.name} ({self.model.path or 'built in'})")
        if self.settings is None:
            lines.append("- Settings: not recorded (the app's own applied)")
        else:
            s = self.settings
            if s.system_prompt:
                lines += ["- System prompt:", ""] + [f"  > {line}" for line in s.system_prompt.splitlines()] + [""]
            else:
                lines.append("- System prompt: none")
            lines.append(f"- Sampling: temperature {s.temperature}, top-p {s.top_p}, top-k {s.top_k}, "
                         f"max new tokens {s.max_new_tokens}, repetition penalty {s.repetition_penalty}")
        lines += ["", "---", ""]
        for t in self.turns:
            head = f"**{t.role}**"
            if t.role == "assistant":
                head += f" ({t.model or 'model not recorded'})"
            if t.version_count == 1:
                lines += [head, "", t.content, ""]
                continue
            lines += [f"{head}, version {t.shown + 1} of {t.version_count} shown", "", t.content, ""]
            for k, v in enumerate(t.all_versions()):
                if k != t.shown:
                    lines += [f"*Version {k + 1} of {t.version_count}, not shown ({v.model or 'model not recorded'}):*",
                              "", v.content, ""]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        settings = None if self.settings is None else {k: getattr(self.settings, k) for k in SETTINGS_FIELDS}
        model = None if self.model is None else {"path": self.model.path, "name": self.model.name}
        return {"id": self.id, "title": self.title, "created": self.created, "updated": self.updated,
                "schema": SCHEMA, "settings": settings, "model": model, "turns": [t.to_dict() for t in self.turns]}

    def changed_answers(self) -> frozenset[str]:
        """The ids of the turns whose versions (or shown answer) this copy changed since it last synced."""
        return frozenset(t.id for t in self.turns
                         if t.id in self.synced_answers and t.answer_state() != self.synced_answers[t.id])

    def mark_synced(self) -> None:
        self.synced_turns = frozenset(t.id for t in self.turns)
        self.synced_title = self.title
        self.synced_settings = copy.deepcopy(self.settings)  # a copy: the app may change its fields in place
        self.synced_model = self.model
        self.synced_answers = {t.id: t.answer_state() for t in self.turns}


def iso_time(seconds: float) -> str:
    """A time as ISO 8601 in local time, with its offset (so it reads the same anywhere)."""
    return datetime.fromtimestamp(seconds).astimezone().isoformat(timespec="seconds")


def _get(data: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    if name not in data:
        raise ValueError(f"'{name}' is missing")
    value = data[name]
    if not isinstance(value, kind) or isinstance(value, bool):  # (bool is an int in Python, never one here)
        raise ValueError(f"'{name}' is {value!r}, not {what}")
    return value


def _time(data: dict[str, Any], name: str) -> float:
    value = _get(data, name, (int, float), "a time in seconds")
    if not math.isfinite(value):
        raise ValueError(f"'{name}' is {value!r}, not a finite number")
    return float(value)


FIELDS = {1: {"id", "title", "created", "turns", "schema"}, 2: {"id", "title", "created", "turns", "schema"},
          3: {"id", "title", "created", "updated", "turns", "schema", "settings", "model"}}


def conversation_from_dict(data: Any, file_id: str) -> Conversation:
    """A conversation read from the file named `<file_id>.json`; raises ValueError naming the first bad field."""
    if not isinstance(data, dict):
        raise ValueError("it is not a JSON object")
    schema = data.get("schema")
    if isinstance(schema, bool) or schema not in READS:
        raise ValueError(f"schema {schema!r}, this Tandem reads {', '.join(map(str, READS))}")
    unknown = set(data) - FIELDS[schema]
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    conv_id = _get(data, "id", str, "a text")
    if not valid_id(conv_id):
        raise ValueError(f"'id' is {conv_id!r}, not 12 hex digits")
    if conv_id != file_id:
        raise ValueError(f"'id' is {conv_id!r} but the file is named {file_id}.json")
    title = _get(data, "title", str, "a text")
    created = _time(data, "created")
    updated, settings, model = created, None, None
    if schema >= 3:  # every field written, null where nothing is recorded: a missing one is a damaged file
        updated = _time(data, "updated")
        for name in ("settings", "model"):
            if name not in data:
                raise ValueError(f"'{name}' is missing")
        settings = _settings(data["settings"])
        model = _model(data["model"])
    raw_turns = _get(data, "turns", list, "a list")
    turns: list[Turn] = []
    for i, raw in enumerate(raw_turns):
        turns.append(_turn(raw, i, conv_id, schema))
    if len({t.id for t in turns}) != len(turns):
        raise ValueError("two turns have the same id")
    conv = Conversation(conv_id, title, created, turns, updated=updated, settings=settings, model=model)
    conv.mark_synced()
    return conv


def _settings(raw: Any) -> Settings | None:
    """The conversation's settings: null, or an object with Settings' fields (never `schema`: the file's own
    schema covers it). A field left out keeps its default, as in the settings file: a conversation saved before
    Tandem had a field reads with the value the app used then. An unknown field is an error (a typo would
    otherwise be dropped silently). Every value is checked as the settings form checks it."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"'settings' is {raw!r}, not an object or null")
    unknown = set(raw) - set(SETTINGS_FIELDS)
    if unknown:
        raise ValueError(f"'settings' has the unknown fields {sorted(unknown)}, expected some of "
                         f"{sorted(SETTINGS_FIELDS)}")
    settings = Settings(**raw)
    try:
        settings.params()
    except SettingsError as e:
        raise ValueError(f"'settings' has a wrong value: {e}") from None
    return settings


def _model(raw: Any) -> ChatModel | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"'model' is {raw!r}, not an object or null")
    if set(raw) != {"path", "name"}:
        raise ValueError(f"'model' has the fields {sorted(raw)}, expected ['name', 'path']")
    return ChatModel(raw["path"], raw["name"])  # (it checks both)


def _turn(raw: Any, i: int, conv_id: str, schema: int) -> Turn:
    where = f"turn {i + 1}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} is not a JSON object")
    allowed = {"role", "content"} | ({"id"} if schema >= 2 else set())
    optional = {"model", "versions", "shown"} if schema >= 3 else set()  # left out when there is nothing to say
    unknown = set(raw) - allowed - optional
    if unknown or not {"role", "content"} <= set(raw):  # (a missing id is named below)
        raise ValueError(f"{where} has the fields {sorted(raw)}, expected {sorted(allowed)}"
                         + (f" and optionally {sorted(optional)}" if optional else ""))
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
    model = raw.get("model", "")
    if not isinstance(model, str):
        raise ValueError(f"{where} has the model {model!r}, not a name (a text)")
    if role != "assistant" and (model or "versions" in raw or "shown" in raw):  # only an answer has them
        raise ValueError(f"{where} is a {role} turn with a model or versions; only an answer has them")
    turn = Turn(role, content, turn_id, model)
    if "versions" in raw or "shown" in raw:
        turn.versions, turn.shown = _versions(raw, where, content, model)
    return turn


def _versions(raw: dict[str, Any], where: str, content: str, model: str) -> tuple[list[Version], int]:
    """The versions of an answer; the shown one must be the turn's own content and model (the file holds both, so
    a mismatch means it was damaged or hand-edited, and which one is right is unknown)."""
    versions, shown = raw.get("versions"), raw.get("shown")
    if not isinstance(versions, list) or len(versions) < 2:  # one version is written as none: files stay small
        raise ValueError(f"{where} has the versions {versions!r}, not a list of two or more")
    out: list[Version] = []
    for k, v in enumerate(versions):
        if (not isinstance(v, dict) or set(v) != {"content", "model"} or not isinstance(v["content"], str)
                or not isinstance(v["model"], str)):
            raise ValueError(f"{where} has the version {k + 1} {v!r}, not an object with a content and a model "
                             "(texts)")
        out.append(Version(v["content"], v["model"]))
    if not isinstance(shown, int) or isinstance(shown, bool) or not 0 <= shown < len(out):
        raise ValueError(f"{where} has 'shown' {shown!r}, not an index of its {len(out)} versions (from 0)")
    if out[shown] != Version(content, model):
        raise ValueError(f"{where} shows version {shown + 1}, but its content and model are not that version's")
    return out, shown


def merge_turns(disk: list[Turn], mine: list[Turn], synced: frozenset[str],
                changed_here: frozenset[str] = frozenset()) -> list[Turn]:
    """The turns to save when another writer may have changed the file since this copy last read or wrote it.

    `synced` holds the ids this copy last saw on disk. A turn it has since removed (retry, edit) stays removed;
    a turn the other writer removed stays removed; everyone's new turns are kept: the file's first, in its
    order, then this copy's. So no writer ever loses a turn to another.
    A turn both hold is the file's (another writer may have regenerated it), except those in `changed_here`
    (this copy regenerated it or switched versions since it synced: its change is the newer one) and those
    equal in both (this copy's object is kept, so a caller holding it still holds the saved turn)."""
    mine_by_id = {t.id: t for t in mine}
    disk_ids = {t.id for t in disk}
    removed_here = synced - mine_by_id.keys()
    kept = []
    for t in disk:
        if t.id in removed_here:
            continue
        here = mine_by_id.get(t.id)
        if here is not None and (t.id in changed_here or here.answer_state() == t.answer_state()):
            kept.append(here)
        else:
            kept.append(t)
    added_here = [t for t in mine if t.id not in disk_ids and t.id not in synced]
    return kept + added_here
