"""Fitting a conversation longer than the context: the oldest turns go, the system prompt and question stay."""

from __future__ import annotations

from tandem.app.chat.context import answer_room, fit_messages
from tandem.app.chat.conversation import Conversation, Turn


def words(messages: list[dict[str, str]]) -> int:
    """A token counter for tests: one token per word, plus 2 per message for the template's markers."""
    return sum(len(m["content"].split()) + 2 for m in messages)


def chat(pairs: int, system: str = "be brief") -> list[dict[str, str]]:
    turns = []
    for i in range(pairs):
        turns += [Turn("user", f"question {i} " + "w " * 8), Turn("assistant", f"answer {i} " + "w " * 8)]
    return Conversation(turns=turns + [Turn("user", "the newest question")]).messages(system)


def test_a_conversation_that_fits_is_left_whole() -> None:
    messages = chat(3)
    assert fit_messages(messages, words, 1000) == (messages, 0)


def test_the_oldest_turns_go_first_and_the_system_prompt_stays() -> None:
    messages = chat(10)
    limit = words(messages) // 2
    kept, dropped = fit_messages(messages, words, limit)
    assert words(kept) <= limit // 2 and dropped > 0 and dropped % 2 == 0
    assert kept[0] == {"role": "system", "content": "be brief"} and kept[1]["role"] == "user"
    assert kept[-1]["content"] == "the newest question" and kept[1:] == messages[1 + dropped:]
    # as many as fit in half the room (the rest is for the next turns): one more pair would be over it
    assert words([kept[0]] + messages[1 + dropped - 2:]) > limit // 2


def test_a_trimmed_conversation_keeps_its_beginning_while_it_fits_from_there() -> None:
    """The next turns start where the last prompt did (the KV cache holds it: prefix reuse) until they no longer
    fit from there; then the oldest go until half the room is left."""
    limit = words(chat(10)) // 2
    kept, since = fit_messages(chat(10), words, limit)
    starts = [since]
    for pairs in range(11, 30):
        messages = chat(pairs)
        kept, since = fit_messages(messages, words, limit, since)
        assert words(kept) <= limit and kept[-1]["content"] == "the newest question"
        assert kept[1:] == messages[1 + since :]
        if since != starts[-1]:  # moved: it did not fit from the old start, and now takes half the room at most
            assert words([kept[0], *messages[1 + starts[-1] :]]) > limit and words(kept) <= limit // 2
        starts.append(since)
    moves = sum(1 for a, b in zip(starts, starts[1:], strict=False) if a != b)
    assert 2 <= moves <= 6, starts  # (each pair takes a twelfth of the limit: a move every few turns)
    # half the room would leave the newest question alone, without the answer it replies to: as many as fit then
    long = [{"role": "user", "content": "w " * 298}, {"role": "assistant", "content": "w " * 298},
            {"role": "user", "content": "w " * 8}, {"role": "assistant", "content": "w " * 598},
            {"role": "user", "content": "w " * 8}]
    kept, since = fit_messages(long, words, 1000)
    assert since == 2 and kept == long[2:]
    # a start that is no longer one (the chat was edited shorter) is not kept
    messages = chat(3)
    assert fit_messages(messages, words, words(messages) - 1, since=99)[1] > 0


def test_the_newest_question_stays_even_when_over_the_limit() -> None:
    messages = chat(4)
    kept, dropped = fit_messages(messages, words, 3)
    assert [m["content"] for m in kept] == ["be brief", "the newest question"] and dropped == 8
    alone = [{"role": "user", "content": "w " * 100}]
    assert fit_messages(alone, words, 3) == (alone, 0)


def test_without_a_system_prompt() -> None:
    messages = chat(6, system="")
    kept, dropped = fit_messages(messages, words, 30)
    assert kept[0]["role"] == "user" and words(kept) <= 30 and kept == messages[dropped:]


def test_room_for_the_answer() -> None:
    assert answer_room(4096, 512) == 512
    assert answer_room(128, 512) == 32  # at most a quarter of a small context
    assert answer_room(2, 512) == 1 and answer_room(4096, 0) == 1


def test_an_unanswered_question_joins_the_next_one() -> None:
    conv = Conversation(turns=[Turn("user", "first"), Turn("user", "second"), Turn("assistant", "a")])
    assert conv.messages() == [{"role": "user", "content": "first\n\nsecond"}, {"role": "assistant", "content": "a"}]
