"""Conversations on disk: one versioned JSON file each under the data folder, written atomically, and exports.

Several processes may use one folder (two chat windows, say): every save holds the folder's lock, reads the
file again and merges the other writers' changes before writing, so no turn is ever lost. A file that cannot be
read is set aside (never fatal) and reported as a notice, as are the temporary files a killed save left.
Exports (Markdown or JSON, with the conversation's metadata) go to `exports/` beside the conversations folder
unless the caller names a path.
"""

from __future__ import annotations

import re
import time
import unicodedata
from pathlib import Path

from tandem.app.chat.conversation import (
    SCHEMA,
    ChatModel,
    Conversation,
    Turn,
    Version,
    conversation_from_dict,
    iso_time,
    merge_turns,
    valid_id,
)
from tandem.kernels.errors import OutputError, StoreError
from tandem.runtime.paths import (
    atomic_write_json,
    atomic_write_text,
    check_output,
    data_dir,
    ensure_folder,
    folder_lock,
    read_json,
    remove_stale_temporaries,
    set_aside,
)

__all__ = ["EXPORT_FORMATS", "SCHEMA", "ChatModel", "Conversation", "ConversationStore", "Turn", "Version"]

EXPORT_FORMATS = ("md", "json")
EXPORT_KIND = "tandem-conversation"  # the JSON export's "format": what a reader checks before taking one in


# a long chat with many regenerated answers holds a few megabytes; far more is not a conversation of ours
CONVERSATION_MAX_BYTES = 64 * 2**20


def read_conversation(path: Path) -> Conversation:
    """Raises ValueError (or OSError) saying what is wrong with the file. Only a regular file is read, and only up
    to a bound (`read_json`): a FIFO put in the folder would block the app, a link to /dev/zero fill the RAM."""
    return conversation_from_dict(read_json(path, CONVERSATION_MAX_BYTES), path.stem)


class ConversationStore:
    def __init__(self, folder: Path | None = None, exports: Path | None = None) -> None:
        self.folder = folder or data_dir() / "conversations"
        # beside the conversations, not in their folder: a JSON export there would be read as a damaged conversation
        self.exports = exports or self.folder.parent / "exports"

    def path(self, conv: Conversation, suffix: str = ".json") -> Path:
        """The conversation's file; an id that is not the generated form is refused (it could name any path)."""
        if not valid_id(conv.id):
            raise StoreError(f"the conversation id {conv.id!r} is not 12 hex digits; it was not saved, exported "
                             "or deleted (start a new conversation)")
        return self.folder / f"{conv.id}{suffix}"

    def save(self, conv: Conversation) -> bool:
        """Write `conv`, merged with what other writers saved meanwhile; `conv` then holds the merged result.
        Returns whether other writers' changes came in. Raises OSError when the file cannot be written, StoreError
        when `conv` holds a value no reader would take (a setting out of range, say): the file is left as it was.

        The merge: turns by id (`merge_turns`). The title, settings, model and each answer's versions are this
        copy's when it changed them since it last synced, else the file's (another writer may have changed them);
        `updated` is the later of the two."""
        path = self.path(conv)
        with folder_lock(self.folder):
            before = _shown(conv)
            disk = self._read_for_merge(path)
            if disk is not None:
                conv.turns = merge_turns(disk.turns, conv.turns, conv.synced_turns, conv.changed_answers())
                if conv.title == conv.synced_title:  # not renamed here: a rename elsewhere wins
                    conv.title = disk.title
                if conv.settings == conv.synced_settings:
                    conv.settings = disk.settings
                if conv.model == conv.synced_model:
                    conv.model = disk.model
                conv.updated = max(conv.updated, disk.updated)
            changed = _shown(conv) != before
            data = conv.to_dict()
            try:  # never write what no reader takes back: the next start would set the file aside
                conversation_from_dict(data, conv.id)
            except ValueError as e:
                raise StoreError(f"the conversation was not saved: its {e}") from None
            atomic_write_json(path, data)
            conv.mark_synced()
        return changed

    @staticmethod
    def _read_for_merge(path: Path) -> Conversation | None:
        try:
            return read_conversation(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # kept aside rather than overwritten: what it holds may still be wanted
            try:
                set_aside(path)
            except OSError:
                pass
            return None

    def delete(self, conv: Conversation) -> None:
        path = self.path(conv)
        with folder_lock(self.folder):
            path.unlink(missing_ok=True)

    def default_export(self, conv: Conversation, fmt: str = "md") -> Path:
        """Where an export goes unless told otherwise: `exports/<title slug>-<id>.<fmt>`."""
        self.path(conv)  # refuses an id not of the generated form: the file name holds it
        return self.exports / f"{slug(conv.title)}-{conv.id}.{fmt}"

    def export(self, conv: Conversation, path: Path | None = None, fmt: str = "md") -> Path:
        """Write the conversation with its metadata as Markdown ("md") or JSON ("json"), atomically, and return
        the file written. With no `path`, or a `path` that is a folder, the file is `<title slug>-<id>.<fmt>` in
        `exports/` (or that folder); a missing parent folder is created. Raises StoreError (an unknown format, an
        id not of the generated form, a JSON file in the conversations folder) or OSError when the write fails."""
        if fmt not in EXPORT_FORMATS:
            raise StoreError(f"cannot export as {fmt!r}: the formats are {', '.join(EXPORT_FORMATS)}")
        name = self.default_export(conv, fmt).name
        target = self.exports / name if path is None else path / name if path.is_dir() else path
        if target.suffix == ".json" and target.parent.resolve() == self.folder.resolve():
            raise StoreError(f"{target} is in the conversations folder, where it would be read as a conversation; "
                             "export it to another folder")
        try:  # a device, FIFO or folder in its place would swallow the export, block or fail at the end
            check_output(target, "the export")
        except OutputError as e:
            raise StoreError(str(e)) from None
        ensure_folder(target.parent)
        now = time.time()
        if fmt == "json":
            data = conv.to_dict() | {"exported": iso_time(now), "format": EXPORT_KIND}
            return atomic_write_json(target, data)
        return atomic_write_text(target, conv.to_markdown(exported=now))

    def load_all(self) -> tuple[list[Conversation], list[str]]:
        """Every readable conversation, newest first, and notices about files that were set aside."""
        convs: list[Conversation] = []
        notices: list[str] = []
        if not self.folder.is_dir():
            return convs, notices
        with folder_lock(self.folder):  # held: no save is under way, so every temporary file here is stale
            if remove_stale_temporaries(self.folder):
                notices.append("an interrupted save left a temporary file; it was removed (the conversation "
                               "keeps its last complete save)")
            for path in sorted(self.folder.glob("*.json")):
                if path.name.startswith("."):
                    continue
                try:
                    convs.append(read_conversation(path))
                except (OSError, ValueError) as e:
                    notices.append(self._set_aside(path, e))
        convs.sort(key=lambda c: c.updated, reverse=True)  # the last used first
        return convs, notices

    @staticmethod
    def _set_aside(path: Path, why: Exception) -> str:
        try:
            aside = set_aside(path)
        except OSError as e:
            return f"a conversation file could not be read ({why}) nor set aside ({e}): {path}"
        return f"a conversation file could not be read ({why}); it was set aside as {aside.name}"


def _shown(conv: Conversation) -> tuple[object, ...]:
    """What the user sees of a conversation: a save that changes it brought in another writer's changes."""
    return conv.title, conv.settings, conv.model, [(t.id, t.role, t.answer_state()) for t in conv.turns]


def slug(title: str, most: int = 40) -> str:
    """A file-name-safe form of a title: ASCII lower case, words joined by `-`; "chat" when nothing is left."""
    ascii_title = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    words = re.sub(r"[^a-z0-9]+", "-", ascii_title.lower()).strip("-")
    return words[:most].rstrip("-") or "chat"
