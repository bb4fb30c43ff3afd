"""The chat app under faults: saves that fail, bad settings, a conversation longer than the context, answers
that produce nothing, and another window saving the same conversation."""

from __future__ import annotations

import errno
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.app.chat import settings as settings_module
from tandem.app.chat import store as store_module
from tandem.app.chat.store import ConversationStore, Turn
from tandem.app.chat.tui import TandemApp
from tandem.app.chat.widgets import ChatMessage, StatusBar
from tandem.kernels.errors import GenerationError
from tandem.runtime.sampling import SamplingParams
from tests.fakes import FakeBackend
from tests.test_tui import ask, ask_and_wait, press, wait_for_screen, wait_until


def disk_full(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def notices(app: TandemApp) -> list[str]:
    return [f"{n.title} {n.message}" for n in app._notifications]


def saved_turns(conv_id: str) -> list[str]:
    return [t.content for c in ConversationStore().load_all()[0] if c.id == conv_id for t in c.turns]


async def test_a_failed_save_is_a_notice_and_the_conversation_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "saved question")
        with monkeypatch.context() as full:
            full.setattr(store_module, "atomic_write_json", disk_full)
            await ask(pilot, app, "unsaved question")
            await wait_until(pilot, lambda: not app.lifecycle.generating and len(app.chat.current.turns) == 4)
            await pilot.pause()
        assert app.is_running and any("could not be saved" in n and "No space left" in n for n in notices(app))
        assert [t.content for t in app.chat.current.turns][2:] == ["unsaved question", "word0 word1 "]
        assert saved_turns(app.chat.current.id) == ["saved question", "word0 word1 "]  # the last good save is intact
        await ask_and_wait_for(pilot, app, "third question", 6)  # room again: the next save writes everything
    assert saved_turns(app.chat.current.id)[2::2] == ["unsaved question", "third question"]


async def ask_and_wait_for(pilot, app: TandemApp, text: str, turns: int) -> None:
    await ask(pilot, app, text)
    await wait_until(pilot, lambda: not app.lifecycle.generating and len(app.chat.current.turns) == turns)


async def test_rename_edit_delete_and_export_that_fail_are_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.app.chat.screens.rename import RenameScreen

    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "keep me")
        monkeypatch.setattr(store_module, "atomic_write_json", disk_full)
        await press(pilot, "f3")
        assert isinstance(app.screen, RenameScreen)
        app.screen.query_one("#title").value = "new title"
        await press(pilot, "enter")
        assert app.chat.current.title == "new title" and sum("could not be saved" in n for n in notices(app)) == 1
        monkeypatch.setattr(store_module, "atomic_write_text", disk_full)
        await press(pilot, "ctrl+s", "enter")
        assert any("could not be exported" in n for n in notices(app))
        monkeypatch.setattr(Path, "unlink", disk_full)
        await press(pilot, "f8")
        await press(pilot, "f8")
        assert any("could not be deleted" in n for n in notices(app)) and app.chat.current.turns
        await press(pilot, "f4")  # edit the last question: its save fails too, the app stays
        assert app.is_running and sum("could not be saved" in n for n in notices(app)) == 2


async def test_a_settings_save_that_fails_is_a_notice_and_they_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    from textual.widgets import Button, Checkbox, Input

    from tandem.app.chat.screens.settings import SettingsScreen

    monkeypatch.setattr(settings_module, "atomic_write_json", disk_full)
    app = TandemApp(lambda _: FakeBackend())
    async with app.run_test(size=(100, 40)) as pilot:
        await press(pilot, "f2")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        screen.query_one("#temperature", Input).value = "0.7"
        screen.query_one("#for_new", Checkbox).value = True  # the defaults for new chats: written to the file
        screen.query_one("#save", Button).press()
        await pilot.pause()
        assert app.is_running and app.params.temperature == 0.7
        assert any("settings apply now but could not be saved" in n for n in notices(app))


async def test_conversations_that_cannot_be_read_at_start_are_a_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable(self: ConversationStore) -> None:
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(ConversationStore, "load_all", unreadable)
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "still works")
        assert any("could not be read" in n and "Permission denied" in n for n in notices(app))


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
async def test_a_non_finite_setting_in_the_file_is_set_aside(tandem_home: Path, value: str) -> None:
    (tandem_home / "settings.json").write_text(f'{{"schema": 1, "temperature": {value}}}')
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "hello")
        assert app.params.temperature == 0.2 and any("not a finite number" in n and "set aside" in n
                                                     for n in notices(app))
    assert list(tandem_home.glob("settings.bad-*"))


@pytest.mark.parametrize("field, value", [("temperature", "nan"), ("top_p", "inf"), ("repetition_penalty", "-inf")])
async def test_the_settings_form_refuses_non_finite_numbers(field: str, value: str) -> None:
    from textual.widgets import Button, Input

    from tandem.app.chat.screens.settings import SettingsScreen

    app = TandemApp(lambda _: FakeBackend())
    async with app.run_test(size=(100, 40)) as pilot:
        await press(pilot, "f2")
        screen = app.screen
        screen.query_one(f"#{field}", Input).value = value
        screen.query_one("#save", Button).press()
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen)
        assert "is not a finite number" in str(screen.query_one("#error").render())


async def test_a_conversation_longer_than_the_context_drops_its_oldest_turns() -> None:
    backend = FakeBackend(words=20)
    backend.context = 160  # room for about three exchanges of 20-word questions and answers
    app = TandemApp(lambda _: backend, params=SamplingParams(max_new_tokens=24))
    async with app.run_test(size=(160, 30)) as pilot:
        for i in range(8):
            await ask_and_wait_for(pilot, app, f"question {i} " + "blah " * 18, 2 * (i + 1))
            prompt = backend.prompts[-1]
            assert backend.prompt_tokens(prompt) <= backend.context - 24  # room for the answer
            assert prompt[-1]["content"].startswith(f"question {i}") and prompt[0]["role"] == "user"
        assert len(app.chat.current.turns) == 16 and all(t.content for t in app.chat.current.turns)  # nothing lost
        assert len(backend.prompts[-1]) < 16
        # once trimmed, the next prompts begin where the last one did while they fit (the KV cache holds it)
        trimmed = [p[0]["content"] for p in backend.prompts if not p[0]["content"].startswith("question 0")]
        assert len(trimmed) >= 4 and len(set(trimmed)) < len(trimmed), trimmed
        assert any("earliest messages were left out" in n for n in notices(app))
        assert "left out to fit the context" in str(app.query_one(StatusBar).render())


async def test_the_system_prompt_stays_when_turns_are_dropped(tandem_home: Path) -> None:
    (tandem_home / "settings.json").write_text(json.dumps({"schema": 1, "system_prompt": "Answer in French."}))
    backend = FakeBackend(words=30)
    backend.context = 100
    app = TandemApp(lambda _: backend, params=SamplingParams(max_new_tokens=10))
    async with app.run_test() as pilot:
        for i in range(3):
            await ask_and_wait_for(pilot, app, f"question {i} " + "blah " * 20, 2 * (i + 1))
        prompt = backend.prompts[-1]
        assert prompt[0] == {"role": "system", "content": "Answer in French."} and prompt[1]["role"] == "user"
        assert len(prompt) < 6 and prompt[-1]["content"].startswith("question 2")
        assert backend.prompt_tokens(prompt) <= 100 - 10


class Silent(FakeBackend):
    """Fails before its first word, or (words=0) ends without one."""

    def __init__(self, fail: bool) -> None:
        super().__init__(words=0)
        self.fail = fail

    def stream(self, messages: list[dict[str, str]], params: SamplingParams) -> Iterator[str]:
        if self.fail:
            raise GenerationError("the prompt has 5000 tokens but the context holds 4096")
        yield from super().stream(messages, params)


@pytest.mark.parametrize("fail", [True, False], ids=["fails", "says-nothing"])
async def test_an_answer_without_a_word_is_never_saved(fail: bool) -> None:
    backend = Silent(fail)
    app = TandemApp(lambda _: backend)
    async with app.run_test() as pilot:
        for question in ("first", "second"):
            await ask(pilot, app, question)
            await wait_until(pilot, lambda q=question: not app.lifecycle.generating
                             and app.chat.current.turns[-1].content == q)
            await pilot.pause()
        assert [t.role for t in app.chat.current.turns] == ["user", "user"]
        assert saved_turns(app.chat.current.id) == ["first", "second"]
        assert [m.role for m in app.query(ChatMessage)] == ["user", "user"]
        # the unanswered question goes with the next one, so user and assistant still alternate
        assert fail or backend.prompts[-1] == [{"role": "user", "content": "first\n\nsecond"}]
        backend.words, backend.fail = 2, False
        await press(pilot, "ctrl+r")  # retry: the question gets its answer now
        await wait_until(pilot, lambda: not app.lifecycle.generating and len(app.chat.current.turns) == 3)
        assert [t.role for t in app.chat.current.turns] == ["user", "user", "assistant"]


async def test_another_windows_turns_come_in_when_this_one_saves() -> None:
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "here 1")
        other = ConversationStore()  # the other window, with its own copy of the conversation
        copy = next(c for c in other.load_all()[0] if c.id == app.chat.current.id)
        copy.turns += [Turn("user", "there 1"), Turn("assistant", "there answer")]
        other.save(copy)
        await ask_and_wait_for(pilot, app, "here 2", 6)
        expected = ["here 1", "word0 word1 ", "there 1", "there answer", "here 2", "word0 word1 "]
        assert [t.content for t in app.chat.current.turns] == expected == saved_turns(app.chat.current.id)
        assert [m.text for m in app.query(ChatMessage)] == expected  # shown as saved


async def test_a_long_conversation_with_the_real_runtime_keeps_answering(mixtral_dir: Path) -> None:
    from tandem.app.chat.backend import RuntimeBackend
    from tandem.app.chat.screens.wizard import WizardScreen
    from tandem.runtime.loader import load_model

    app = TandemApp(lambda _: RuntimeBackend(load_model(mixtral_dir, dtype="fp32", context=128)),
                    params=SamplingParams(max_new_tokens=8))
    async with app.run_test() as pilot:
        await wait_for_screen(pilot, app, WizardScreen, timeout=60)  # not tuned yet: offered; skipped
        await press(pilot, "escape")
        for i in range(6):
            await ask_and_wait_for(pilot, app, f"question {i}: " + "tell me more about experts " * 4, 2 * (i + 1))
        assert not any("answer failed" in n.lower() for n in notices(app))
        assert any("earliest messages were left out" in n for n in notices(app))
        assert all(t.content for t in app.chat.current.turns)
