"""A conversation in memory: an answer's versions, forks, search and the prompt (no file: see test_store.py)."""

from __future__ import annotations

import copy
import time

import pytest

from tandem.app.chat.conversation import ChatModel, Conversation, Turn, Version
from tandem.app.chat.settings import Settings


def test_positional_construction_still_works() -> None:
    turn = Turn("user", "hi", "0123456789ab")
    conv = Conversation("ba9876543210", "title", 5.0, [turn])
    assert (turn.model, turn.versions, turn.shown, turn.version_count) == ("", [], 0, 1)
    assert conv.updated == 5.0 and conv.settings is None and conv.model is None
    assert Conversation(created=1.0, updated=3.0).updated == 3.0


def test_versions_add_show_and_keep_content_and_model_in_step() -> None:
    answer = Turn("assistant", "first", model="Small")
    answer.add_version("second", "Big")
    assert answer.version_count == 2 and answer.shown == 1
    assert (answer.content, answer.model) == ("second", "Big")
    assert answer.versions == [Version("first", "Small"), Version("second", "Big")]
    answer.add_version("third", "Big")
    answer.show_version(0)
    assert (answer.content, answer.model, answer.shown, answer.version_count) == ("first", "Small", 0, 3)
    assert answer.versions[answer.shown] == Version(answer.content, answer.model)
    answer.show_version(2)
    assert answer.content == "third"
    with pytest.raises(IndexError):
        answer.show_version(3)
    with pytest.raises(IndexError):
        answer.show_version(-1)


def test_a_version_written_in_place_is_kept_when_another_is_shown() -> None:
    answer = Turn("assistant", "first", model="M")
    answer.add_version("", "M")
    answer.content = "streamed in"  # the app streams the new answer into `content`
    answer.show_version(0)
    answer.show_version(1)
    assert answer.content == "streamed in" and [v.content for v in answer.all_versions()] == ["first", "streamed in"]


def test_a_single_version_has_no_list_and_only_answers_have_versions() -> None:
    answer = Turn("assistant", "only", model="M")
    answer.show_version(0)  # the one there is
    assert answer.versions == [] and answer.all_versions() == [Version("only", "M")]
    for role in ("user", "system"):
        with pytest.raises(ValueError, match="only an answer"):
            Turn(role, "q").add_version("x", "M")


def chat() -> Conversation:
    answer = Turn("assistant", "Paris is the capital", model="Small")
    answer.add_version("It is Paris", "Big")
    return Conversation(title="Geography quiz", created=1.0, updated=2.0, settings=Settings(temperature=0.5),
                        model=ChatModel(None, "SmolLM2"),
                        turns=[Turn("user", "Capital of France?"), answer, Turn("user", "And of Spain?"),
                               Turn("assistant", "Madrid")])


def test_a_fork_copies_the_turns_before_it_and_never_changes_the_original() -> None:
    conv = chat()
    before = copy.deepcopy(conv)
    start = time.time()
    fork = conv.fork(2)
    assert fork.id != conv.id and fork.title == "Geography quiz (fork)"
    assert fork.created >= start and fork.updated == fork.created
    assert [t.content for t in fork.turns] == ["Capital of France?", "It is Paris"]
    assert fork.turns[1].versions == conv.turns[1].versions and fork.turns[1].model == "Big"
    assert {t.id for t in fork.turns}.isdisjoint(t.id for t in conv.turns)
    assert fork.settings == conv.settings and fork.model == conv.model
    # every change to the fork stays in it
    fork.turns.append(Turn("user", "edited question"))
    fork.turns[1].add_version("a third", "Big")
    fork.turns[0].content = "changed"
    assert fork.settings is not None
    fork.settings.temperature = 0.0
    fork.title = "mine"
    assert conv == before and conv.turns[1].versions == before.turns[1].versions
    assert conv.fork(0, "empty").turns == [] and conv.fork(0, "empty").title == "empty"
    assert len(conv.fork(4).turns) == 4
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="0 to 4"):
            conv.fork(bad)


@pytest.mark.parametrize("query, found", [
    ("", True),
    ("geography", True),  # the title
    ("SPAIN", True),  # any case
    ("capital madrid", True),  # every word, each anywhere
    ("paris capital", True),  # the version not shown counts too
    ("capital berlin", False),  # one word missing
    ("lisbon", False),
    ("  quiz \n  paris ", True),  # any white space between words
])
def test_matches(query: str, found: bool) -> None:
    assert chat().matches(query) is found


def test_the_prompt_is_built_from_the_shown_versions() -> None:
    conv = chat()
    assert [m["content"] for m in conv.messages("sys")] == ["sys", "Capital of France?", "It is Paris",
                                                           "And of Spain?", "Madrid"]
    conv.turns[1].show_version(0)
    assert conv.messages()[1] == {"role": "assistant", "content": "Paris is the capital"}


def test_touch_records_the_last_use() -> None:
    conv = chat()
    conv.touch()
    assert conv.updated >= time.time() - 5 and conv.created == 1.0
