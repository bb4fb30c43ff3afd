"""Saved conversations: concurrent writers, files with wrong contents, ids that are not ours, interrupted saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tandem.app.chat.conversation import conversation_from_dict, iso_time, merge_turns
from tandem.app.chat.settings import Settings
from tandem.app.chat.store import SCHEMA, ChatModel, Conversation, ConversationStore, Turn, Version
from tandem.kernels.errors import StoreError, TandemError
from tandem.runtime import paths

ROOT = Path(__file__).resolve().parent.parent

WRITER = """
import sys, time
from pathlib import Path
from tandem.app.chat.store import ConversationStore, Turn
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


SETTINGS = {"system_prompt": "Be brief.", "temperature": 0.7, "top_p": 0.95, "top_k": 40, "max_new_tokens": 256,
            "repetition_penalty": 1.1}
USER = {"role": "user", "content": "hi", "id": "aaaaaaaaaaaa"}
ANSWER = {"role": "assistant", "content": "second", "id": "bbbbbbbbbbbb", "model": "Big",
          "versions": [{"content": "first", "model": "Small"}, {"content": "second", "model": "Big"}], "shown": 1}
GOOD = {"id": "0123456789ab", "title": "t", "created": 1.0, "updated": 2.0, "schema": SCHEMA, "settings": SETTINGS,
        "model": {"path": "/models/big", "name": "Big"}, "turns": [USER, ANSWER]}
MISSING = object()  # a field left out of the file


def answer(**change: object) -> dict[str, list[object]]:
    """GOOD's turns with the answer changed (a MISSING value leaves its field out)."""
    return {"turns": [USER, {k: v for k, v in (ANSWER | change).items() if v is not MISSING}]}


def settings(**change: object) -> dict[str, object]:
    return {"settings": {k: v for k, v in (SETTINGS | change).items() if v is not MISSING}}


# each bad value, and what the notice must name
BAD_CONTENTS = {
    "created a string": ({"created": "yesterday"}, "'created'"),
    "created NaN": ({"created": float("nan")}, "'created'"),
    "created infinite": ({"created": float("inf")}, "'created'"),
    "created a boolean": ({"created": True}, "'created'"),
    "updated missing": ({"updated": MISSING}, "'updated' is missing"),
    "updated a string": ({"updated": "now"}, "'updated'"),
    "updated NaN": ({"updated": float("nan")}, "'updated'"),
    "updated a boolean": ({"updated": False}, "'updated'"),
    "title a number": ({"title": 5}, "'title'"),
    "title null": ({"title": None}, "'title'"),
    "turns not a list": ({"turns": {"role": "user"}}, "'turns'"),
    "turns null": ({"turns": None}, "'turns'"),
    "turn not an object": ({"turns": ["hi"]}, "turn 1"),
    "content an integer": ({"turns": [USER | {"content": 3}]}, "turn 1 has the content"),
    "content missing": ({"turns": [{"role": "user", "id": "aaaaaaaaaaaa"}]}, "turn 1 has the fields"),
    "role unknown": ({"turns": [USER | {"role": "wizard"}]}, "turn 1 has the role"),
    "role a number": ({"turns": [USER | {"role": 1}]}, "turn 1 has the role"),
    "turn with extra field": ({"turns": [USER | {"x": 1}]}, "turn 1 has the fields"),
    "turn id a path": ({"turns": [USER | {"id": "../x"}]}, "turn 1 has the id"),
    "turn id missing": ({"turns": [{"role": "user", "content": "hi"}]}, "turn 1 has the id"),
    "turn ids repeated": ({"turns": [USER] * 2}, "same id"),
    "unknown field": ({"extra": 1}, "unknown fields ['extra']"),
    "schema a boolean": ({"schema": True}, "schema True"),
    "schema from the future": ({"schema": SCHEMA + 1}, f"schema {SCHEMA + 1}"),
    "id missing": ({"id": MISSING}, "'id' is missing"),
    "settings missing": ({"settings": MISSING}, "'settings' is missing"),
    "settings a list": ({"settings": [0.2]}, "'settings'"),
    "settings with an unknown field": (settings(temp=0.5), "'settings' has the unknown fields ['temp']"),
    "settings with a schema": (settings(schema=1), "'settings' has the unknown fields ['schema']"),
    "system prompt a number": (settings(system_prompt=5), "system prompt: 5"),
    "temperature a text": (settings(temperature="hot"), "temperature: 'hot'"),
    "temperature a boolean": (settings(temperature=True), "temperature: True"),
    "temperature negative": (settings(temperature=-1), "temperature must be"),
    "temperature infinite": (settings(temperature=float("inf")), "temperature: inf"),
    "top-p zero": (settings(top_p=0), "top-p must be"),
    "top-p above 1": (settings(top_p=1.5), "top-p must be"),
    "top-k a fraction": (settings(top_k=1.5), "top k: 1.5"),
    "top-k negative": (settings(top_k=-1), "top-k must be"),
    "max new tokens zero": (settings(max_new_tokens=0), "max new tokens: 0"),
    "max new tokens null": (settings(max_new_tokens=None), "max new tokens: None"),
    "repetition penalty zero": (settings(repetition_penalty=0), "repetition penalty must be"),
    "model missing": ({"model": MISSING}, "'model' is missing"),
    "model a text": ({"model": "Big"}, "'model' is 'Big'"),
    "model without a path": ({"model": {"name": "Big"}}, "'model' has the fields ['name']"),
    "model with an extra field": ({"model": {"path": None, "name": "Big", "size": 1}}, "'model' has the fields"),
    "model path empty": ({"model": {"path": "", "name": "Big"}}, "'model.path'"),
    "model path a number": ({"model": {"path": 5, "name": "Big"}}, "'model.path'"),
    "model name empty": ({"model": {"path": None, "name": ""}}, "'model.name'"),
    "model name null": ({"model": {"path": None, "name": None}}, "'model.name'"),
    "turn model a number": (answer(model=5, versions=MISSING, shown=MISSING), "turn 2 has the model 5"),
    "user turn with a model": ({"turns": [USER | {"model": "Big"}]}, "turn 1 is a user turn"),
    "user turn with versions": ({"turns": [USER | {k: ANSWER[k] for k in ("versions", "shown")}]},
                                "turn 1 is a user turn"),
    "versions not a list": (answer(versions="first"), "turn 2 has the versions"),
    "versions empty": (answer(versions=[], shown=0), "turn 2 has the versions"),
    "a single version": (answer(versions=ANSWER["versions"][1:], shown=0), "turn 2 has the versions"),
    "versions without shown": (answer(shown=MISSING), "turn 2 has 'shown' None"),
    "shown without versions": (answer(versions=MISSING), "turn 2 has the versions None"),
    "version not an object": (answer(versions=["first", ANSWER["versions"][1]]), "turn 2 has the version 1"),
    "version without a model": (answer(versions=[{"content": "first"}, ANSWER["versions"][1]]),
                                "turn 2 has the version 1"),
    "version content a number": (answer(versions=[{"content": 1, "model": ""}, ANSWER["versions"][1]]),
                                 "turn 2 has the version 1"),
    "shown out of range": (answer(shown=2), "turn 2 has 'shown' 2"),
    "shown negative": (answer(shown=-1), "turn 2 has 'shown' -1"),
    "shown a boolean": (answer(shown=True), "turn 2 has 'shown' True"),
    "shown not the content": (answer(content="third"), "turn 2 shows version 2"),
    "shown not the model": (answer(model="Small"), "turn 2 shows version 2"),
    "schema 2 with updated": ({"schema": 2}, "unknown fields"),
}


def write(folder: Path, name: str, data: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


@pytest.mark.parametrize("change, named", BAD_CONTENTS.values(), ids=BAD_CONTENTS.keys())
def test_a_file_with_wrong_contents_is_set_aside_with_a_notice_naming_the_field(tmp_path: Path, change: dict,
                                                                                  named: str) -> None:
    store = ConversationStore(tmp_path)
    good = Conversation(title="good", turns=[Turn("user", "hi")])
    store.save(good)
    data = {k: v for k, v in (GOOD | change).items() if v is not MISSING}
    bad = write(tmp_path, f"{GOOD['id']}.json", data)
    convs, notices = store.load_all()
    assert [c.title for c in convs] == ["good"]
    assert len(notices) == 1 and "set aside" in notices[0] and not bad.exists()
    assert named in notices[0]
    assert len(list(tmp_path.glob(f"{GOOD['id']}.bad-*.json.txt"))) == 1


OLD = {"id": "ba9876543210", "title": "old", "created": 5.0, "turns": [{"role": "user", "content": "hi"},
                                                                     {"role": "assistant", "content": "hello"}]}


def test_the_good_form_reads_and_schema_1_gets_stable_turn_ids(tmp_path: Path) -> None:
    write(tmp_path, f"{GOOD['id']}.json", GOOD)
    write(tmp_path, "ba9876543210.json", OLD | {"schema": 1})
    first, notices = ConversationStore(tmp_path).load_all()
    again, _ = ConversationStore(tmp_path).load_all()
    assert notices == [] and len(first) == 2
    assert [t.id for c in first for t in c.turns] == [t.id for c in again for t in c.turns]


@pytest.mark.parametrize("schema", [1, 2])
def test_older_schemas_read_with_nothing_recorded_and_updated_as_created(tmp_path: Path, schema: int) -> None:
    turns = [t | {"id": f"{i:012x}"} for i, t in enumerate(OLD["turns"])] if schema == 2 else OLD["turns"]
    write(tmp_path, "ba9876543210.json", OLD | {"schema": schema, "turns": turns})
    (conv,), notices = ConversationStore(tmp_path).load_all()
    assert notices == [] and conv.title == "old" and conv.created == conv.updated == 5.0
    assert conv.settings is None and conv.model is None
    assert [(t.role, t.content, t.model, t.versions) for t in conv.turns] == [("user", "hi", "", []),
                                                                               ("assistant", "hello", "", [])]
    ConversationStore(tmp_path).save(conv)  # written again as the current schema
    assert json.loads((tmp_path / "ba9876543210.json").read_text())["schema"] == SCHEMA


def test_every_field_round_trips(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    write(tmp_path, f"{GOOD['id']}.json", GOOD)
    (conv,), notices = store.load_all()
    assert notices == [] and conv.to_dict() == GOOD
    assert conv.updated == 2.0 and conv.settings == Settings(**SETTINGS)
    assert conv.model == ChatModel("/models/big", "Big")
    answer = conv.turns[1]
    assert (answer.content, answer.model, answer.shown) == ("second", "Big", 1)
    assert answer.versions == [Version("first", "Small"), Version("second", "Big")]
    conv.model = ChatModel(None, "SmolLM2 (built in)")
    conv.settings = Settings(system_prompt="", temperature=0.0, top_k=1)
    conv.turns.append(Turn("user", "more"))
    conv.turns.append(Turn("assistant", "one", model="SmolLM2"))
    conv.touch()
    store.save(conv)
    (again,), _ = store.load_all()
    assert again == conv and again.to_dict() == conv.to_dict()
    assert again.turns[-1].model == "SmolLM2" and again.model.path is None


def test_a_single_version_is_saved_as_none(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    conv = Conversation(turns=[Turn("user", "q"), Turn("assistant", "a", model="M")])
    store.save(conv)
    saved = json.loads(store.path(conv).read_text())
    assert saved["turns"][1] == {"role": "assistant", "content": "a", "id": conv.turns[1].id, "model": "M"}
    assert saved["turns"][0] == {"role": "user", "content": "q", "id": conv.turns[0].id}
    assert saved["settings"] is None and saved["model"] is None


def test_an_answer_streamed_into_a_new_version_saves_what_it_shows(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    conv = Conversation(turns=[Turn("user", "q"), Turn("assistant", "a", model="M")])
    conv.turns[1].add_version("", "M")
    conv.turns[1].content = "streamed"  # the app writes the answer as it comes
    store.save(conv)
    (again,), notices = store.load_all()
    assert notices == [] and [v.content for v in again.turns[1].versions] == ["a", "streamed"]


def test_the_list_is_sorted_by_last_use(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    old = Conversation(title="old but used", created=100.0)
    new = Conversation(title="new", created=200.0)
    unused = Conversation(title="oldest", created=50.0)
    for conv in (old, new, unused):
        store.save(conv)
    assert [c.title for c in store.load_all()[0]] == ["new", "old but used", "oldest"]
    old.touch()
    assert old.updated > 200.0 and old.created == 100.0
    store.save(old)
    assert [c.title for c in store.load_all()[0]] == ["old but used", "new", "oldest"]


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


def exported_conversation() -> Conversation:
    answer = Turn("assistant", "first answer", model="Small")
    answer.add_version("second answer", "Big")
    return Conversation(title="My first chat!", created=1_700_000_000.0, updated=1_700_000_600.0,
                        settings=Settings(system_prompt="Be brief.\nUse English.", temperature=0.7),
                        model=ChatModel("/models/big", "Big"),
                        turns=[Turn("user", "a question"), answer, Turn("user", "unanswered")])


def test_a_markdown_export_holds_the_metadata_and_every_version(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "conversations")
    conv = exported_conversation()
    path = store.export(conv)
    assert path == tmp_path / "exports" / f"my-first-chat-{conv.id}.md"
    text = path.read_text(encoding="utf-8")
    head, body = text.split("\n---\n", 1)
    assert head.startswith("# My first chat!\n")
    assert f"- Created: {iso_time(1_700_000_000.0)}" in head and f"- Updated: {iso_time(1_700_000_600.0)}" in head
    assert "- Exported: " in head and "- Model: Big (/models/big)" in head
    assert "  > Be brief.\n  > Use English." in head
    assert ("- Sampling: temperature 0.7, top-p 0.9, top-k 0, max new tokens 512, repetition penalty 1.0"
            in head)
    assert "**assistant** (Big), version 2 of 2 shown\n\nsecond answer" in body
    assert "*Version 1 of 2, not shown (Small):*\n\nfirst answer" in body
    assert body.index("a question") < body.index("second answer") < body.index("first answer") < body.index(
        "unanswered")
    assert not list(path.parent.glob(".*"))  # written atomically: no temporary left


def test_a_markdown_export_of_an_old_conversation_says_what_is_not_recorded(tmp_path: Path) -> None:
    conv = Conversation(title="Été 2024", turns=[Turn("user", "q"), Turn("assistant", "a")])
    path = ConversationStore(tmp_path / "c").export(conv)
    assert path.name == f"ete-2024-{conv.id}.md"
    text = path.read_text(encoding="utf-8")
    assert "- Model: not recorded" in text and "- Settings: not recorded" in text
    assert "**assistant** (model not recorded)\n\na" in text and "version" not in text


def test_a_json_export_is_the_conversation_with_its_kind_and_time(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "conversations")
    conv = exported_conversation()
    path = store.export(conv, fmt="json")
    assert path == tmp_path / "exports" / f"my-first-chat-{conv.id}.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    exported = data.pop("exported")
    assert data.pop("format") == "tandem-conversation" and data == conv.to_dict()
    assert datetime.fromisoformat(exported).tzinfo is not None
    assert conversation_from_dict(data, conv.id) == conv  # nothing lost


@pytest.mark.parametrize("fmt", ["md", "json"])
def test_an_export_path_names_a_file_or_a_folder(tmp_path: Path, fmt: str) -> None:
    store = ConversationStore(tmp_path / "conversations")
    conv = Conversation(title="", turns=[Turn("user", "hi")])
    named = store.export(conv, tmp_path / "new" / "deeper" / f"mine.{fmt}", fmt)  # its folders are created
    assert named == tmp_path / "new" / "deeper" / f"mine.{fmt}" and "hi" in named.read_text()
    folder = tmp_path / "folder"
    folder.mkdir()
    assert store.export(conv, folder, fmt) == folder / f"chat-{conv.id}.{fmt}"  # an empty title: "chat"
    named.write_text("old")
    assert store.export(conv, named, fmt).read_text() != "old"  # replaced


def test_an_export_refuses_an_unknown_format_and_a_json_file_among_the_conversations(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "conversations")
    conv = Conversation(turns=[Turn("user", "hi")])
    with pytest.raises(StoreError, match="md, json"):
        store.export(conv, fmt="pdf")
    store.save(conv)
    with pytest.raises(StoreError, match="conversations folder"):
        store.export(conv, store.folder, "json")
    assert store.export(conv, store.folder, "md").parent == store.folder  # never read as a conversation
    convs, notices = store.load_all()
    assert notices == [] and [c.id for c in convs] == [conv.id]


def test_a_failed_export_raises_and_leaves_nothing(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "conversations")
    blocker = write(tmp_path, "exports", "a file where the folder belongs")
    with pytest.raises(StoreError, match="cannot create the folder"):
        store.export(Conversation(turns=[Turn("user", "hi")]))
    assert blocker.read_text() == "a file where the folder belongs"


def test_two_writers_merge_settings_model_and_versions(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    store.save(Conversation(turns=[Turn("user", "q"), Turn("assistant", "a", model="Small")], created=10.0))
    left, right = (store.load_all()[0][0] for _ in range(2))
    # the left window regenerates the answer with another model and changes the settings
    left.model = ChatModel("/models/big", "Big")
    left.settings = Settings(temperature=0.9)
    left.turns[1].add_version("a, again", "Big")
    left.touch()
    assert store.save(left) is False
    # the right one, stale, renames and asks on: the left's changes come in, its own stay
    right.title = "renamed"
    right.turns.append(Turn("user", "q2"))
    assert store.save(right) is True
    assert right.title == "renamed" and right.model == left.model and right.settings == left.settings
    assert right.turns[1].answer_state() == left.turns[1].answer_state()
    assert right.updated == left.updated and [t.content for t in right.turns] == ["q", "a, again", "q2"]
    # the right shows version 1 again; the left, unaware, changes a setting in place: both changes stay
    right.turns[1].show_version(0)
    store.save(right)
    assert left.settings is not None
    left.settings.top_k = 5
    assert store.save(left) is True
    assert left.turns[1].content == "a" and left.turns[1].shown == 0 and left.settings.top_k == 5
    assert [t.content for t in left.turns] == ["q", "a", "q2"] and left.title == "renamed"
    (saved,), _ = store.load_all()
    assert saved == left and saved.settings == Settings(temperature=0.9, top_k=5)
    # both regenerate the same answer: the later save wins (the earlier one's version is not merged in)
    left.turns[1].add_version("left's", "Big")
    right.turns[1].add_version("right's", "Big")
    store.save(left)
    store.save(right)
    assert [v.content for v in store.load_all()[0][0].turns[1].versions] == ["a", "a, again", "right's"]


def test_merge_rules_for_a_turn_both_hold() -> None:
    a, b = Turn("user", "q"), Turn("assistant", "a")
    elsewhere = Turn("assistant", "a", b.id)
    elsewhere.add_version("b", "M")
    synced = frozenset({a.id, b.id})
    assert merge_turns([a, elsewhere], [a, b], synced)[1] is elsewhere  # regenerated elsewhere, not here
    assert merge_turns([a, elsewhere], [a, b], synced, frozenset({b.id}))[1] is b  # changed here: this copy's
    same = Turn("assistant", "a", b.id)
    assert merge_turns([a, same], [a, b], synced)[1] is b  # equal: the object the caller holds is kept


BAD_IN_MEMORY = {
    "a setting out of range": lambda c: setattr(c, "settings", Settings(top_p=2.0)),
    "a time that is not finite": lambda c: setattr(c, "updated", float("inf")),
    "a user turn with a model": lambda c: setattr(c.turns[0], "model", "M"),
    "a shown version out of range": lambda c: (c.turns[1].add_version("b", "M"), setattr(c.turns[1], "shown", 5)),
}


@pytest.mark.parametrize("spoil", BAD_IN_MEMORY.values(), ids=BAD_IN_MEMORY.keys())
def test_a_conversation_no_reader_would_take_is_never_written(tmp_path: Path, spoil) -> None:
    store = ConversationStore(tmp_path)
    conv = Conversation(turns=[Turn("user", "q"), Turn("assistant", "a")])
    store.save(conv)
    before = store.path(conv).read_text()
    spoil(conv)
    with pytest.raises(StoreError, match="not saved"):
        store.save(conv)
    assert store.path(conv).read_text() == before and store.load_all()[1] == []


@pytest.mark.parametrize("path, name", [("", "M"), (None, ""), (3, "M"), (None, None)])
def test_a_chat_model_is_checked_when_made(path: object, name: object) -> None:
    with pytest.raises(ValueError, match="'model.path'" if name == "M" else "'model.name'"):
        ChatModel(path, name)  # type: ignore[arg-type]
