"""Saved conversations: concurrent writers, files with wrong contents, ids that are not ours, interrupted saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.app.conversation import merge_turns
from tandem.app.store import SCHEMA, Conversation, ConversationStore, Turn
from tandem.kernels.errors import StoreError, TandemError
from tandem.runtime import paths

ROOT = Path(__file__).resolve().parent.parent

WRITER = """
import sys, time
from pathlib import Path
from tandem.app.store import ConversationStore, Turn
store = ConversationStore(Path(sys.argv[1]))
conv = next(c for c in store.load_all()[0] if c.id == sys.argv[2])
name, go = sys.argv[3], Path(sys.argv[4])
while not go.exists():
    time.sleep(0.001)
for i in range(int(sys.argv[5])):
    conv.turns.append(Turn("user", f"{name} question {i}"))
    conv.turns.append(Turn("assistant", f"{name} answer {i}"))
    store.save(conv)
"""


def test_writers_in_several_processes_never_lose_a_turn(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "conversations")
    shared = Conversation(title="shared", turns=[Turn("user", "hello"), Turn("assistant", "hi")])
    store.save(shared)
    go, rounds = tmp_path / "go", 25
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(store.folder), shared.id, name, str(go),
                                 str(rounds)], env=env, cwd=ROOT) for name in ("left", "right")]
    time.sleep(1.0)  # both have read the conversation before either writes
    go.touch()
    assert [w.wait(120) for w in writers] == [0, 0]
    convs, notices = store.load_all()
    assert notices == [] and len(convs) == 1
    contents = [t.content for t in convs[0].turns]
    assert contents[:2] == ["hello", "hi"] and len(contents) == 2 + 2 * 2 * rounds
    for name in ("left", "right"):  # every turn of each, in its own order, each answer after its question
        mine = [c for c in contents if c.startswith(name)]
        assert mine == [f"{name} {kind} {i}" for i in range(rounds) for kind in ("question", "answer")]


def test_two_stale_copies_merge_on_save(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    conv = Conversation(turns=[Turn("user", "q0"), Turn("assistant", "a0")])
    store.save(conv)
    left, right = (next(iter(store.load_all()[0])) for _ in range(2))
    left.turns += [Turn("user", "left q"), Turn("assistant", "left a")]
    assert store.save(left) is False
    right.turns += [Turn("user", "right q"), Turn("assistant", "right a")]
    assert store.save(right) is True  # the other window's turns came in
    expected = ["q0", "a0", "left q", "left a", "right q", "right a"]
    assert [t.content for t in right.turns] == expected
    # a retry on the left replaces its own answer; the right's turns stay
    left.turns[-1] = Turn("assistant", "left a, again")
    store.save(left)
    assert [t.content for t in store.load_all()[0][0].turns] == expected[:3] + ["right q", "right a",
                                                                               "left a, again"]
    # a rename here wins over the other copy's old title
    right.title = "renamed"
    store.save(right)
    store.save(left)
    assert store.load_all()[0][0].title == "renamed"


def test_merge_rules() -> None:
    a, b, c, d, e = (Turn("user", x) for x in "abcde")
    synced = frozenset({a.id, b.id})
    assert merge_turns([a, b, c], [a, b, d], synced) == [a, b, c, d]  # both appended
    assert merge_turns([a, b, c], [a, e], synced) == [a, c, e]  # removed here (b), appended elsewhere (c)
    assert merge_turns([a], [a, b, d], synced) == [a, d]  # removed elsewhere (b) stays removed
    assert merge_turns([], [a, b], frozenset()) == [a, b]


GOOD = {"id": "0123456789ab", "title": "t", "created": 1.0, "schema": SCHEMA,
        "turns": [{"role": "user", "content": "hi", "id": "aaaaaaaaaaaa"}]}

BAD_CONTENTS = {
    "created a string": {"created": "yesterday"},
    "created NaN": {"created": float("nan")},
    "created infinite": {"created": float("inf")},
    "created a boolean": {"created": True},
    "title a number": {"title": 5},
    "title null": {"title": None},
    "turns not a list": {"turns": {"role": "user"}},
    "turns null": {"turns": None},
    "turn not an object": {"turns": ["hi"]},
    "content an integer": {"turns": [{"role": "user", "content": 3, "id": "aaaaaaaaaaaa"}]},
    "content missing": {"turns": [{"role": "user", "id": "aaaaaaaaaaaa"}]},
    "role unknown": {"turns": [{"role": "wizard", "content": "hi", "id": "aaaaaaaaaaaa"}]},
    "role a number": {"turns": [{"role": 1, "content": "hi", "id": "aaaaaaaaaaaa"}]},
    "turn with extra field": {"turns": [{"role": "user", "content": "hi", "id": "aaaaaaaaaaaa", "x": 1}]},
    "turn id a path": {"turns": [{"role": "user", "content": "hi", "id": "../x"}]},
    "turn ids repeated": {"turns": [{"role": "user", "content": "hi", "id": "aaaaaaaaaaaa"}] * 2},
    "unknown field": {"extra": 1},
    "schema a boolean": {"schema": True},
    "schema from the future": {"schema": SCHEMA + 1},
    "id missing": {"id": None},
}


def write(folder: Path, name: str, data: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


@pytest.mark.parametrize("change", BAD_CONTENTS.values(), ids=BAD_CONTENTS.keys())
def test_a_file_with_wrong_contents_is_set_aside_with_a_notice(tmp_path: Path, change: dict) -> None:
    store = ConversationStore(tmp_path)
    good = Conversation(title="good", turns=[Turn("user", "hi")])
    store.save(good)
    data = {k: v for k, v in (GOOD | change).items() if v is not None or k != "id"}
    bad = write(tmp_path, f"{GOOD['id']}.json", data)
    convs, notices = store.load_all()
    assert [c.title for c in convs] == ["good"]
    assert len(notices) == 1 and "set aside" in notices[0] and not bad.exists()
    assert len(list(tmp_path.glob(f"{GOOD['id']}.bad-*.json.txt"))) == 1


def test_the_good_form_reads_and_schema_1_gets_stable_turn_ids(tmp_path: Path) -> None:
    write(tmp_path, f"{GOOD['id']}.json", GOOD)
    old = GOOD | {"id": "ba9876543210", "schema": 1, "turns": [{"role": "user", "content": "hi"}]}
    write(tmp_path, "ba9876543210.json", old)
    first, notices = ConversationStore(tmp_path).load_all()
    again, _ = ConversationStore(tmp_path).load_all()
    assert notices == [] and len(first) == 2
    assert [t.id for c in first for t in c.turns] == [t.id for c in again for t in c.turns]


BAD_IDS = ["../../x", "../outside", "/tmp/abs", "ABCDEF012345", "0123456789a", "0123456789abc", "", "..",
           "0123456789a/", "0123456789ab\n"]


@pytest.mark.parametrize("bad_id", BAD_IDS)
def test_an_id_not_of_the_generated_form_never_names_a_file(tmp_path: Path, bad_id: str) -> None:
    folder = tmp_path / "a" / "b" / "conversations"
    store = ConversationStore(folder)
    conv = Conversation(id=bad_id, turns=[Turn("user", "hi")])
    victim = write(tmp_path, "x.json", {"keep": True})
    for act in (store.save, store.delete, store.export):
        with pytest.raises(StoreError, match="not 12 hex digits") as raised:
            act(conv)
        assert isinstance(raised.value, TandemError)
    assert victim.exists() and [p.name for p in tmp_path.rglob("*")] == ["x.json"]


@pytest.mark.parametrize("file_id, data_id", [("0123456789ab", "../../x"), ("0123456789ab", "ba9876543210"),
                                              ("not-an-id", "not-an-id")])
def test_a_file_whose_id_is_not_ours_is_set_aside(tmp_path: Path, file_id: str, data_id: str) -> None:
    write(tmp_path, f"{file_id}.json", GOOD | {"id": data_id})
    convs, notices = ConversationStore(tmp_path).load_all()
    assert convs == [] and len(notices) == 1 and "'id'" in notices[0]
    assert list(tmp_path.glob(f"{file_id}.bad-*"))


def test_a_killed_saves_temporary_file_is_removed_and_never_read(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    conv = Conversation(turns=[Turn("user", "hi")])
    store.save(conv)
    stale = [write(tmp_path, f".{conv.id}-k3j4h5.json", "{\"id\": \"half"),
             write(tmp_path, f".{conv.id}-q9w8e7.json", conv.to_dict())]
    convs, notices = store.load_all()
    assert [c.id for c in convs] == [conv.id]
    assert len(notices) == 1 and "temporary file" in notices[0] and "removed" in notices[0]
    assert not any(p.exists() for p in stale) and not list(tmp_path.glob("*.bad-*"))


def test_atomic_write_flushes_the_data_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(paths.os, "fsync", lambda fd: events.append("fsync") or fsync(fd))
    monkeypatch.setattr(paths.os, "replace", lambda a, b: events.append("replace") or replace(a, b))
    paths.atomic_write_json(tmp_path / "f.json", {"a": 1})
    assert events == ["fsync", "replace", "fsync"]  # the file, then the folder after the rename
    assert json.loads((tmp_path / "f.json").read_text()) == {"a": 1} and not list(tmp_path.glob(".*"))


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    target = tmp_path / "f.json"
    paths.atomic_write_json(target, {"v": 1})

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(paths.os, "fsync", full)
    with pytest.raises(OSError):
        paths.atomic_write_json(target, {"v": 2})
    assert json.loads(target.read_text()) == {"v": 1} and [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_set_aside_names_never_collide(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths.time, "time_ns", lambda: 1_700_000_000_000_000_000)  # all in the same instant
    asides = []
    for i in range(3):
        asides.append(paths.set_aside(write(tmp_path, "settings.json", f"broken {i}")))
    assert len({a.name for a in asides}) == 3
    assert sorted(a.read_text() for a in asides) == ["broken 0", "broken 1", "broken 2"]
    assert not (tmp_path / "settings.json").exists()


def test_two_bad_conversations_set_aside_in_one_instant_keep_both(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths.time, "time_ns", lambda: 1_700_000_000_000_000_000)
    store = ConversationStore(tmp_path)
    for text in ("{ one", "{ two"):
        write(tmp_path, "0123456789ab.json", text)
        assert len(store.load_all()[1]) == 1
    assert sorted(p.read_text() for p in tmp_path.glob("0123456789ab.bad-*")) == ["{ one", "{ two"]


def test_without_a_lock_between_processes_saves_still_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths, "fcntl", None)  # a platform without fcntl: saved unlocked, still atomically
    store = ConversationStore(tmp_path)
    conv = Conversation(turns=[Turn("user", "hi")])
    store.save(conv)
    assert [c.id for c in store.load_all()[0]] == [conv.id]
