"""Saved conversations and settings against hostile files: a link to a device, a FIFO, a huge or deeply nested file,
invalid JSON or UTF-8, a folder in a file's place, a FIFO as the lock file. Each bad file is set aside with a notice,
the others load, and nothing blocks or fills the memory (the dangerous cases run in a bounded child process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.app.chat.settings import Settings, load_settings
from tandem.app.chat.store import Conversation, ConversationStore, Turn
from tandem.kernels.errors import StoreError
from tandem.runtime import paths

ROOT = Path(__file__).resolve().parent.parent
CHILD_MEMORY = 4 * 2**30  # a regression that reads /dev/zero fails in the child instead of filling the machine

CHILD = """
import json, resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
from tandem.app.chat.settings import load_settings
from tandem.app.chat.store import Conversation, ConversationStore, Turn
what, folder = sys.argv[1], Path(sys.argv[2])
store = ConversationStore(folder)
if what == "load":
    convs, notices = store.load_all()
    print(json.dumps({{"ids": [c.id for c in convs], "notices": notices}}))
elif what == "save":
    conv = Conversation(id=sys.argv[3], title="mine", turns=[Turn("user", "still saved")])
    store.save(conv)
    print(json.dumps({{"ids": [conv.id], "notices": []}}))
else:
    settings, notice = load_settings()
    print(json.dumps({{"ids": [], "notices": [notice], "default": settings == type(settings)()}}))
"""


def in_child(what: str, folder: Path, *more: str) -> dict[str, Any]:
    """Run the store (or the settings) in a child bounded in memory and time: a regression fails, never hangs."""
    code = CHILD.format(memory=CHILD_MEMORY)
    try:
        done = subprocess.run([sys.executable, "-c", code, what, str(folder), *more], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} blocked on a file")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def saved(store: ConversationStore, title: str) -> Conversation:
    conv = Conversation(title=title, turns=[Turn("user", f"{title} question"), Turn("assistant", "an answer")])
    store.save(conv)
    return conv


def make_bad(path: Path, kind: str) -> None:
    if kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to a fifo":
        os.mkfifo(path.with_name("pipe"))
        path.symlink_to(path.with_name("pipe"))
    elif kind == "huge":
        with path.open("wb") as f:
            f.truncate(200 * 2**20)  # sparse: no disk taken
    elif kind == "nested too deeply":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "nested 65 deep":
        path.write_text("[" * 65 + "]" * 65)
    elif kind == "not JSON":
        path.write_text("{not json")
    elif kind == "not UTF-8":
        path.write_bytes(b'{"title": "\xff"}')
    elif kind == "folder":
        path.mkdir()
    elif kind == "dangling link":
        path.symlink_to(path.with_name("nowhere"))
    else:
        raise AssertionError(kind)


DANGEROUS = ("link to /dev/zero", "fifo", "link to a fifo")  # run in the child
KINDS = {"link to /dev/zero": "not a regular file but a device", "fifo": "not a regular file but a FIFO",
         "link to a fifo": "not a regular file but a FIFO", "huge": "more than the 64 MiB",
         "nested too deeply": "nested too deeply", "nested 65 deep": "nested too deeply (more than 64",
         "not JSON": "Expecting property name", "not UTF-8": "utf-8", "folder": "not a regular file but a folder",
         "dangling link": "No such file"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bad_conversation_file_is_set_aside_and_the_others_load(tmp_path: Path, kind: str) -> None:
    store = ConversationStore(tmp_path / "conversations")
    good = [saved(store, "first"), saved(store, "second")]
    bad = store.folder / "0123456789ab.json"
    make_bad(bad, kind)
    if kind in DANGEROUS:
        got = in_child("load", store.folder)
        ids, notices = got["ids"], got["notices"]
    else:
        convs, notices = store.load_all()
        ids = [c.id for c in convs]
    assert sorted(ids) == sorted(c.id for c in good)
    assert len(notices) == 1 and "set aside as 0123456789ab.bad-" in notices[0] and KINDS[kind] in notices[0]
    assert not os.path.lexists(bad)
    aside = [p for p in store.folder.iterdir() if p.name.startswith("0123456789ab.bad-")]
    assert len(aside) == 1
    if "link" in kind:  # the link itself was moved, never what it points to
        assert aside[0].is_symlink()
    assert Path("/dev/zero").is_char_device()
    again, notices = ConversationStore(store.folder).load_all()
    assert notices == [] and len(again) == 2  # set aside once: the next start is clean


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
def test_a_save_over_a_hostile_file_sets_it_aside_and_saves(tmp_path: Path, kind: str) -> None:
    """Another process put a FIFO or a device link in the conversation's place: the save reads it for the merge."""
    store = ConversationStore(tmp_path / "conversations")
    conv = saved(store, "mine")
    path = store.path(conv)
    path.unlink()
    make_bad(path, kind)
    got = in_child("save", store.folder, conv.id)
    assert got["ids"] == [conv.id]
    convs, notices = store.load_all()
    assert notices == [] and [c.id for c in convs] == [conv.id]
    assert [t.content for t in convs[0].turns] == ["still saved"]  # (what the FIFO or device held is no turn)
    assert any(p.name.startswith(f"{conv.id}.bad-") for p in store.folder.iterdir())


def test_a_fifo_as_the_lock_file_never_blocks(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "conversations")
    conv = saved(store, "locked")
    (store.folder / ".lock").unlink()
    os.mkfifo(store.folder / ".lock")
    got = in_child("load", store.folder)
    assert got["ids"] == [conv.id] and got["notices"] == []
    assert (store.folder / ".lock").is_file()  # a new lock file; the FIFO was set aside
    assert any(p.name.startswith(".lock.bad-") for p in store.folder.iterdir())


def test_a_link_as_the_lock_file_is_not_followed_out_of_the_folder(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "conversations")
    conv = saved(store, "linked")
    outside = tmp_path / "outside" / "made-here"
    outside.parent.mkdir()
    (store.folder / ".lock").unlink()
    (store.folder / ".lock").symlink_to(outside)  # dangling: opening it with O_CREAT would make the file outside
    convs, _ = store.load_all()
    store.save(conv)
    assert [c.id for c in convs] == [conv.id] and not outside.exists()
    assert (store.folder / ".lock").is_file() and not (store.folder / ".lock").is_symlink()


@pytest.mark.parametrize("kind", ["link to /dev/zero", "fifo", "huge", "nested too deeply", "folder"])
def test_a_hostile_settings_file_is_set_aside_and_the_defaults_apply(tandem_home: Path, kind: str) -> None:
    path = paths.data_dir() / "settings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    make_bad(path, kind)
    if kind in DANGEROUS:
        got = in_child("settings", tandem_home)
        notice, default = got["notices"][0], got["default"]
    else:
        settings, notice = load_settings()
        default = settings == Settings()
    assert default and notice is not None and "set aside as settings.bad-" in notice
    assert not os.path.lexists(path)


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/full", "link to a folder"])
def test_an_export_to_what_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    store = ConversationStore(tmp_path / "conversations")
    conv = saved(store, "exported")
    target = tmp_path / "out.md"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "link to /dev/full":
        target.symlink_to("/dev/full")
    else:
        (tmp_path / "there").mkdir()
        target.symlink_to(tmp_path / "there")
    if kind == "link to a folder":  # a folder named: the export goes inside it, as for a folder
        assert store.export(conv, target).parent == target
        return
    with pytest.raises(StoreError, match="not a regular file"):
        store.export(conv, target)
    assert target.is_symlink() if "link" in kind else target.is_fifo()


def test_read_json_bounds_size_and_depth(tmp_path: Path) -> None:
    f = tmp_path / "x.json"
    f.write_text(json.dumps({"a": [[["deep enough"]]]}))
    assert paths.read_json(f, 100) == {"a": [[["deep enough"]]]}
    with pytest.raises(OSError, match="more than the 10 bytes"):
        paths.read_json(f, 10)
    with pytest.raises(ValueError, match="nested too deeply"):
        paths.read_json(f, 100, depth=3)
    f.write_text('["[[[[[[[[[[", "{{{{{{{{{{{"]')  # brackets inside strings are no nesting
    assert paths.read_json(f, 100, depth=1) == ["[[[[[[[[[[", "{{{{{{{{{{{"]
