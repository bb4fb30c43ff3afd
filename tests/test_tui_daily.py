"""The chat app in daily use, headless through Pilot: nothing the user typed is lost, keys respect dialogs and text
fields, user text is shown as typed, the view follows only when at the bottom, the sidebar and status bar say what
is true."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from textual.widgets import Footer, Input, ListView, TextArea

from tandem.app.chat.screens.chat import ChatScreen
from tandem.app.chat.store import Conversation, ConversationStore, Turn
from tandem.app.chat.tui import TandemApp
from tandem.app.chat.widgets import ChatMessage, Composer, StatusBar
from tests.fakes import FakeBackend
from tests.test_tui import ask, ask_and_wait, press, wait_until


def status(app: TandemApp) -> str:
    return str(app.query_one(StatusBar).render())


def slow_load(gate: threading.Event, backend: FakeBackend):  # type: ignore[no-untyped-def]
    """A model that loads once `gate` is set."""

    def load(_: str | None) -> FakeBackend:
        gate.wait(10)
        return backend

    return load


def held(words: int = 3, delay: float = 0.0) -> FakeBackend:
    """A backend whose answers pause after their first word until its `hold` is set."""
    backend = FakeBackend(words=words, delay=delay)
    backend.hold = threading.Event()
    return backend


async def send_while_answering(pilot, app: TandemApp, backend: FakeBackend, first: str, second: str) -> None:
    """Ask `first`; once its answer has begun, send `second`."""
    await ask(pilot, app, first)
    await wait_until(pilot, lambda: backend.produced == 1)
    app.query_one(Composer).insert(second)
    await press(pilot, "enter")


def user_texts(conv: Conversation) -> list[str]:
    return [t.content for t in conv.turns if t.role == "user"]


# -- 1. typed text is never thrown away -----------------------------------------------------------------------
async def test_a_message_sent_while_an_answer_streams_is_queued_and_sent_after_it(tandem_home: Path) -> None:
    backend = held()
    app = TandemApp(lambda _: backend)
    async with app.run_test() as pilot:
        await send_while_answering(pilot, app, backend, "first", "second")
        assert app.query_one(Composer).text == "" and len(backend.prompts) == 1
        assert any(m.has_class("queued") and m.text == "second" for m in app.query(ChatMessage))
        backend.hold.set()
        # (the queued message's widget is removed by the app's loop: on a busy machine after the answer may be done)
        await wait_until(pilot, lambda: len(app.chat.current.turns) == 4 and not app.lifecycle.generating
                         and not any(m.has_class("queued") for m in app.query(ChatMessage)))
        assert user_texts(app.chat.current) == ["first", "second"]
        assert backend.prompts[-1][-1] == {"role": "user", "content": "second"}


async def test_a_message_sent_while_the_model_loads_is_sent_once_it_is_ready(tandem_home: Path) -> None:
    gate, backend = threading.Event(), FakeBackend(words=2)
    app = TandemApp(slow_load(gate, backend))
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.lifecycle.loading)
        composer = app.query_one(Composer)
        composer.focus()
        composer.insert("hello early")
        await press(pilot, "enter")
        assert len(backend.prompts) == 0
        gate.set()
        await wait_until(pilot, lambda: len(app.chat.current.turns) == 2 and not app.lifecycle.generating)
        assert user_texts(app.chat.current) == ["hello early"]


async def test_escape_stops_the_answer_and_gives_queued_text_back_to_the_composer(tandem_home: Path) -> None:
    backend = held()
    app = TandemApp(lambda _: backend)
    async with app.run_test() as pilot:
        await send_while_answering(pilot, app, backend, "first", "second thoughts")
        await press(pilot, "escape")
        backend.hold.set()
        await wait_until(pilot, lambda: not app.lifecycle.generating)
        await pilot.pause(0.1)
        assert app.query_one(Composer).text == "second thoughts" and len(backend.prompts) == 1


async def test_without_a_model_the_text_stays_in_the_composer() -> None:
    from tandem.kernels.errors import CheckpointError

    def broken(_: str | None) -> FakeBackend:
        raise CheckpointError("no such model")

    app = TandemApp(broken)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: "failed" in status(app))
        composer = app.query_one(Composer)
        composer.focus()
        composer.insert("are you there?")
        await press(pilot, "enter")
        assert composer.text == "are you there?"


# -- 2. keys respect dialogs and text fields -------------------------------------------------------------------
async def test_settings_does_not_stack_and_rename_owns_ctrl_d(tandem_home: Path) -> None:
    from tandem.app.chat.screens.rename import RenameScreen
    from tandem.app.chat.screens.settings import SettingsScreen

    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test(size=(100, 40)) as pilot:
        await ask_and_wait(pilot, app, "keep me")
        await press(pilot, "f2", "f2")
        assert sum(isinstance(s, SettingsScreen) for s in app.screen_stack) == 1
        await press(pilot, "escape", "f3")
        assert isinstance(app.screen, RenameScreen)
        await press(pilot, "ctrl+d", "ctrl+d", "ctrl+n", "ctrl+o")
        assert isinstance(app.screen, RenameScreen)
        await press(pilot, "enter")
        assert len(app.chat.conversations) == 1 and ConversationStore().load_all()[0]


async def test_ctrl_d_and_ctrl_e_keep_their_editing_meaning_in_the_composer(tandem_home: Path) -> None:
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "keep me")
        composer = app.query_one(Composer)
        composer.text = "abc"
        composer.move_cursor((0, 0))
        await press(pilot, "ctrl+d")  # delete the character to the right
        assert composer.text == "bc"
        await press(pilot, "ctrl+e")  # to the end of the line
        assert composer.cursor_location == (0, 2)
        assert len(app.chat.conversations) == 1 and not app.screen.query("ExpertHeatmap.visible")


# -- 3. the draft's token count, live ----------------------------------------------------------------------
async def test_the_status_bar_counts_the_drafts_tokens_as_it_is_typed() -> None:
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test(size=(160, 30)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        assert "ctx 0/4096" in status(app)
        app.query_one(Composer).insert("one two three")
        await wait_until(pilot, lambda: "ctx 5/4096" in status(app))  # the fake: a token a word, two a message


# -- 4. the user's text is shown as typed ---------------------------------------------------------------------
async def test_user_text_is_shown_as_typed_and_the_title_has_no_markdown(tandem_home: Path) -> None:
    text = "# My heading\nsnake_case_name stays\n\n* not a bullet"
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test(size=(100, 30)) as pilot:
        await ask_and_wait(pilot, app, text)
        mine = next(m for m in app.query(ChatMessage) if m.role == "user")
        shown = mine.shown_text()
        assert shown.splitlines() == text.splitlines()
        assert app.chat.current.title == "My heading"


# -- 5. the settings dialog ------------------------------------------------------------------------------------
async def test_settings_focus_a_field_save_on_enter_and_take_a_multi_line_system_prompt(tandem_home: Path) -> None:
    from tandem.app.chat.screens.settings import SettingsScreen

    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test(size=(100, 40)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        await press(pilot, "f2")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        prompt = screen.query_one("#system_prompt", TextArea)
        assert app.focused is prompt
        prompt.insert("Be brief.")
        await press(pilot, "enter")  # a new line in the system prompt
        prompt.insert("Answer in French.")
        await press(pilot, "tab")
        assert isinstance(app.focused, Input)
        app.focused.value = "0.5"
        await press(pilot, "enter")  # Enter in a field saves
        assert not isinstance(app.screen, SettingsScreen)
        mine = app.chat.chat_settings(app.chat.current)
        assert mine.system_prompt == "Be brief.\nAnswer in French." and mine.temperature == 0.5


async def test_ctrl_s_saves_the_settings_from_any_field(tandem_home: Path) -> None:
    from tandem.app.chat.screens.settings import SettingsScreen

    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test(size=(100, 40)) as pilot:
        await press(pilot, "f2")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#system_prompt", TextArea).insert("Hi.")
        await press(pilot, "ctrl+s")
        assert not isinstance(app.screen, SettingsScreen)
        assert app.chat.chat_settings(app.chat.current).system_prompt == "Hi."


# -- 6. scrolling back while an answer streams ------------------------------------------------------------------
async def test_scrolling_back_while_an_answer_streams_is_not_undone() -> None:
    backend = FakeBackend(words=400, delay=0.004)
    app = TandemApp(lambda _: backend)
    async with app.run_test(size=(80, 24)) as pilot:
        await ask(pilot, app, "a long answer please")
        box = app.query_one("#messages")
        await wait_until(pilot, lambda: box.max_scroll_y > 5)
        box.scroll_page_up(animate=False)  # what Page Up and the mouse wheel do
        # (applied after the next refresh, which a busy machine may not have drawn after one pause)
        await wait_until(pilot, lambda: box.scroll_y < box.max_scroll_y)
        held = box.scroll_y
        await wait_until(pilot, lambda: backend.produced > 300 or not app.lifecycle.generating)
        await pilot.pause(0.1)
        assert box.scroll_y == held  # it stayed where the user put it
        await wait_until(pilot, lambda: not app.lifecycle.generating)


async def test_the_view_follows_the_answer_while_at_the_bottom() -> None:
    backend = FakeBackend(words=400, delay=0.002)
    app = TandemApp(lambda _: backend)
    async with app.run_test(size=(80, 24)) as pilot:
        await ask_and_wait(pilot, app, "a long answer please")
        box = app.query_one("#messages")  # (laid out once the last batch is painted: waited for, not slept)
        await wait_until(pilot, lambda: box.max_scroll_y > 5 and box.scroll_y == box.max_scroll_y)


# -- 7. quitting mid-answer keeps the turn -------------------------------------------------------------------
async def test_quitting_mid_answer_saves_the_question_and_the_partial_answer(tandem_home: Path) -> None:
    backend = held(words=5, delay=0.06)  # a word later than a repaint: the first is shown on its own
    app = TandemApp(lambda _: backend)
    async with app.run_test() as pilot:
        await ask(pilot, app, "will I be kept?")
        await wait_until(pilot, lambda: backend.produced == 1 and "word0" in (app.chat.answer_text() or ""))
        await pilot.press("ctrl+q")
        backend.hold.set()
    saved = ConversationStore().load_all()[0]
    assert len(saved) == 1
    assert [(t.role, t.content.strip()) for t in saved[0].turns] == [("user", "will I be kept?"),
                                                                    ("assistant", "word0")]


async def test_the_question_is_saved_as_soon_as_it_is_sent(tandem_home: Path) -> None:
    backend = held()
    app = TandemApp(lambda _: backend)
    async with app.run_test() as pilot:
        await ask(pilot, app, "saved at once")
        await wait_until(pilot, lambda: backend.produced == 1)
        assert user_texts(ConversationStore().load_all()[0][0]) == ["saved at once"]
        backend.hold.set()
        await wait_until(pilot, lambda: not app.lifecycle.generating)


# -- 8. the sidebar ---------------------------------------------------------------------------------------
async def test_the_sidebar_marks_the_active_chat_and_cuts_titles_with_an_ellipsis(tandem_home: Path) -> None:
    store = ConversationStore()
    for title in ("older chat", "a title far too long to fit into the sidebar"):
        store.save(Conversation(title=title, turns=[Turn("user", "hi"), Turn("assistant", "hello")]))
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        sidebar = app.query_one("#sidebar", ListView)
        items = list(sidebar.children)
        labels = [str(item.query_one("Label").render()) for item in items]
        assert any(label.endswith("…") and label.startswith("a title far") for label in labels)
        active = [item for item in items if item.has_class("active")]
        assert len(active) == 1 and active[0].name == app.chat.current.id


async def test_new_chat_three_times_makes_one_empty_chat(tandem_home: Path) -> None:
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "something")
        await press(pilot, "ctrl+n", "ctrl+n", "ctrl+n")
        assert len(app.chat.conversations) == 2 and not app.chat.current.turns


async def test_chats_are_listed_by_last_use(tandem_home: Path) -> None:
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "first chat")
        await press(pilot, "ctrl+n")
        await ask_and_wait(pilot, app, "second chat")
        first = next(c for c in app.chat.conversations if c.title == "first chat")
        app.chat.open_conversation(first)
        await pilot.pause()
        await ask(pilot, app, "back to the first")
        await wait_until(pilot, lambda: len(first.turns) == 4 and not app.lifecycle.generating)
        assert [c.title for c in app.chat.conversations] == ["first chat", "second chat"]
    again = TandemApp(lambda _: FakeBackend())
    async with again.run_test() as pilot:
        await pilot.pause()
        assert [c.title for c in again.chat.conversations] == ["first chat", "second chat"]


# -- 9. the status bar and the footer ---------------------------------------------------------------------------
async def test_the_status_bar_shows_no_speed_before_an_answer_nor_another_chats_numbers() -> None:
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test(size=(160, 30)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        assert "tok/s" not in status(app) and "TTFT" not in status(app)
        await ask_and_wait(pilot, app, "hi")
        assert "42.5 tok/s" in status(app)
        await press(pilot, "ctrl+n")
        assert "tok/s" not in status(app) and "ctx 0/4096" in status(app)


@pytest.mark.parametrize("width", [80, 120])
async def test_the_footer_shows_the_main_keys_whole(width: int) -> None:
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test(size=(width, 24)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        await pilot.pause()
        keys = list(app.screen.query_one(Footer).query("FooterKey"))
        palette = next(k for k in keys if k.description == "palette")
        whole = {k.description for k in keys if k is not palette and k.region.right <= palette.region.x}
        assert {"Settings", "Models", "Help", "New line", "Stop", "New chat"} <= whole
        assert "answering" not in status(app)


async def test_the_status_bar_keeps_the_state_first_so_narrow_windows_still_show_it() -> None:
    backend = held()
    app = TandemApp(lambda _: backend)
    async with app.run_test(size=(80, 24)) as pilot:
        await ask(pilot, app, "hi")
        await wait_until(pilot, lambda: backend.produced == 1)
        await pilot.pause()
        assert "Esc stops" in status(app)[:70]
        backend.hold.set()
        await wait_until(pilot, lambda: not app.lifecycle.generating)


# -- 13. Shift+Enter, Ctrl+J --------------------------------------------------------------------------------------
async def test_help_says_shift_enter_needs_extended_keys_and_ctrl_j_always_works() -> None:
    app = TandemApp(lambda _: FakeBackend())
    async with app.run_test(size=(100, 40)) as pilot:
        await press(pilot, "f1")
        text = " ".join(str(w.render()) for w in app.screen.query("Static"))
        assert "Ctrl+J" in text and "extended key" in text


# -- the chat screen's key map ----------------------------------------------------------------------------------
def test_no_chat_key_takes_an_editing_key_from_the_composer() -> None:
    """A priority binding on the chat screen beats the composer: none may be a key the text area edits with."""
    editing = {k for b in TextArea.BINDINGS for k in b.key.split(",")} | {"ctrl+d", "ctrl+e"}  # type: ignore[union-attr]
    for b in ChatScreen.BINDINGS:
        if b.priority:
            assert not set(b.key.split(",")) & editing, b.key


# -- what users expect --------------------------------------------------------------------------------------
async def test_palette_commands_still_open_dialogs() -> None:
    from tandem.app.chat.screens.settings import SettingsScreen

    app = TandemApp(lambda _: FakeBackend())
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        await press(pilot, "ctrl+p")
        await pilot.press(*"Settings")
        await wait_until(pilot, lambda: any(c.option_count for c in app.screen.query("CommandList")))
        await press(pilot, "enter")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen))


async def test_the_palette_finds_a_chat_by_a_word_in_it_and_the_filter_narrows_the_sidebar(tandem_home: Path) -> None:
    store = ConversationStore()
    for title, words in (("about cats", "whiskers and purring"), ("about rockets", "thrust and nozzles")):
        store.save(Conversation(title=title, turns=[Turn("user", words), Turn("assistant", "ok")]))
    app = TandemApp(lambda _: FakeBackend())
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        start = app.chat.current.title
        wanted = "about cats" if start != "about cats" else "about rockets"
        word = "purring" if wanted == "about cats" else "nozzles"
        await press(pilot, "ctrl+p")
        await pilot.press(*word)
        await wait_until(pilot, lambda: any("chat: " + wanted in str(o.prompt)
                                            for o in app.screen.query("CommandList").first().options))
        await press(pilot, "enter")
        await wait_until(pilot, lambda: app.chat.current.title == wanted)
        await press(pilot, "ctrl+f")
        assert isinstance(app.focused, Input)
        await pilot.press(*"rocket")
        await pilot.pause()
        names = [item.name for item in app.query_one("#sidebar", ListView).children]
        assert names == [c.id for c in app.chat.conversations if c.title == "about rockets"]
        await press(pilot, "escape")
        assert len(app.query_one("#sidebar", ListView).children) == 2 and isinstance(app.focused, Composer)


async def test_copy_the_last_answer_and_its_code_block() -> None:
    class Coder(FakeBackend):
        def stream(self, messages, params):  # type: ignore[no-untyped-def]
            self.prompts.append(messages)
            yield "Here:\n\n```python\nprint('hi')\n```\n\nDone."

    app = TandemApp(lambda _: Coder())
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "code please")
        await press(pilot, "f9")
        assert app.clipboard.startswith("Here:") and app.clipboard.endswith("Done.")
        await press(pilot, "ctrl+g")
        assert app.clipboard == "print('hi')"


async def test_the_sidebar_folds_in_a_narrow_window_and_ctrl_b_toggles_it() -> None:
    app = TandemApp(lambda _: FakeBackend())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        side = app.query_one("#side")
        assert not side.display
        await press(pilot, "ctrl+b")
        assert side.display
    wide = TandemApp(lambda _: FakeBackend())
    async with wide.run_test(size=(120, 30)) as pilot:
        await pilot.pause()
        assert wide.query_one("#side").display
        await press(pilot, "ctrl+b")
        assert not wide.query_one("#side").display


async def test_the_theme_is_remembered(tandem_home: Path) -> None:
    app = TandemApp(lambda _: FakeBackend())
    async with app.run_test() as pilot:
        await pilot.pause()
        app.theme = "textual-light"
        await pilot.pause()
    again = TandemApp(lambda _: FakeBackend())
    async with again.run_test() as pilot:
        await pilot.pause()
        assert again.theme == "textual-light"


async def test_an_empty_chat_welcomes_with_the_model_and_the_keys_that_matter() -> None:
    app = TandemApp(lambda _: FakeBackend())
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, lambda: "fake-moe" in str(app.query_one("#welcome").render()))
        text = str(app.query_one("#welcome").render())
        assert "CPU only" in text and "Enter" in text and "Ctrl+O" in text and "F1" in text
        await ask_and_wait(pilot, app, "hi")
        assert not app.query("#welcome")


async def test_the_status_bar_shows_the_memory_in_use() -> None:
    class OnGpu(FakeBackend):
        def vram(self) -> tuple[int, int] | None:
            return 3 * 2**30, 8 * 2**30

    app = TandemApp(lambda _: OnGpu())
    async with app.run_test(size=(200, 30)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        await pilot.pause()
        assert "RAM " in status(app) and "VRAM 3.0 GiB/8.0 GiB" in status(app)


async def test_regenerate_keeps_versions_and_alt_arrows_go_through_them(tandem_home: Path) -> None:
    backend = FakeBackend(words=2)
    app = TandemApp(lambda _: backend)
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "tell me")
        backend.words = 3
        await press(pilot, "ctrl+r")
        await wait_until(pilot, lambda: not app.lifecycle.generating and app.chat.current.turns[-1].version_count == 2)
        last = app.chat.current.turns[-1]
        assert last.content.split() == ["word0", "word1", "word2"] and len(app.chat.current.turns) == 2
        assert backend.prompts[-1] == [{"role": "user", "content": "tell me"}]  # the earlier answer is not sent
        shown = [m for m in app.query(ChatMessage) if m.role == "assistant"]
        assert len(shown) == 1 and "‹2/2›" in str(shown[0].border_title) and "fake-moe" in str(shown[0].border_title)
        await press(pilot, "alt+left")
        assert app.chat.current.turns[-1].content.split() == ["word0", "word1"]
        assert "‹1/2›" in str(app.query(ChatMessage).last().border_title)
    saved = ConversationStore().load_all()[0][0].turns[-1]
    assert saved.version_count == 2 and saved.shown == 0 and saved.model == "fake-moe"


async def test_editing_an_earlier_message_forks_the_chat(tandem_home: Path) -> None:
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "first question")
        await ask(pilot, app, "second question")
        await wait_until(pilot, lambda: len(app.chat.current.turns) == 4 and not app.lifecycle.generating)
        original = app.chat.current
        await press(pilot, "ctrl+up")
        await press(pilot, "down", "enter")  # newest first: the second entry is the first question
        assert app.chat.current is not original and app.chat.current.turns == []
        assert app.query_one(Composer).text == "first question"
        app.query_one(Composer).text = "first question, edited"
        await press(pilot, "enter")
        await wait_until(pilot, lambda: len(app.chat.current.turns) == 2 and not app.lifecycle.generating)
        assert len(original.turns) == 4 and user_texts(app.chat.current) == ["first question, edited"]
    assert len(ConversationStore().load_all()[0]) == 2


async def test_each_chat_keeps_its_own_settings(tandem_home: Path) -> None:
    backend = FakeBackend(words=2)
    app = TandemApp(lambda _: backend)
    async with app.run_test(size=(100, 40)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        await press(pilot, "f2")
        app.screen.query_one("#system_prompt", TextArea).text = "Talk like a pirate."
        await press(pilot, "ctrl+s")
        await ask_and_wait(pilot, app, "hello")
        await press(pilot, "ctrl+n")
        await ask_and_wait(pilot, app, "hello again")
        assert backend.prompts[0][0] == {"role": "system", "content": "Talk like a pirate."}
        assert backend.prompts[1][0]["role"] == "user"  # the new chat has the defaults: no system prompt
    saved = {c.title: c for c in ConversationStore().load_all()[0]}
    assert saved["hello"].settings.system_prompt == "Talk like a pirate."
    assert saved["hello again"].settings.system_prompt == ""


async def test_each_answer_records_its_model_and_a_chat_brings_its_model_back(tandem_home: Path) -> None:
    loads: list[str | None] = []

    def load(path: str | None) -> FakeBackend:
        loads.append(path)
        backend = FakeBackend(words=2, path=path)
        backend.name = path or "built-in"
        return backend

    app = TandemApp(load, model="/models/one")
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "asked of one")
        assert app.chat.current.turns[-1].model == "/models/one"
        app.load_model("/models/two")
        await wait_until(pilot, lambda: app.lifecycle.path == "/models/two" and not app.lifecycle.loading)
        await press(pilot, "ctrl+n")
        await ask_and_wait(pilot, app, "asked of two")
        first = next(c for c in app.chat.conversations if c.title == "asked of one")
        app.chat.open_conversation(first)
        await wait_until(pilot, lambda: app.lifecycle.path == "/models/one" and not app.lifecycle.loading)
        assert loads == ["/models/one", "/models/two", "/models/one"]
    saved = {c.title: c for c in ConversationStore().load_all()[0]}
    assert saved["asked of two"].model.path == "/models/two"


async def test_export_to_a_path_the_user_picks_as_json(tandem_home: Path, tmp_path: Path) -> None:
    import json

    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test(size=(100, 30)) as pilot:
        await ask_and_wait(pilot, app, "export me")
        await press(pilot, "ctrl+s")
        app.screen.query_one("RadioSet").query("RadioButton").last().value = True
        await pilot.pause()
        target = app.screen.query_one("#path", Input)
        assert target.value.endswith(".json")
        target.value = str(tmp_path / "out" / "chat.json")
        await press(pilot, "enter")
    data = json.loads((tmp_path / "out" / "chat.json").read_text())
    assert data["format"] == "tandem-conversation" and data["turns"][0]["content"] == "export me"
    assert data["model"]["name"] == "fake-moe" and data["settings"]["temperature"] == 0.2


async def test_a_queued_message_survives_switching_chats_while_the_model_loads(tandem_home: Path) -> None:
    store = ConversationStore()
    store.save(Conversation(title="older", turns=[Turn("user", "hi"), Turn("assistant", "hello")]))
    gate, backend = threading.Event(), FakeBackend(words=2)
    app = TandemApp(slow_load(gate, backend))
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.lifecycle.loading)
        await press(pilot, "ctrl+n")
        fresh = app.chat.current
        app.query_one(Composer).insert("sent early")
        await press(pilot, "enter")
        older = next(c for c in app.chat.conversations if c.title == "older")
        app.chat.open_conversation(older)
        await pilot.pause()
        app.chat.open_conversation(fresh)
        await pilot.pause()
        assert [m.text for m in app.query(ChatMessage) if m.has_class("queued")] == ["sent early"]
        app.chat.open_conversation(older)
        await pilot.pause()
        gate.set()
        await wait_until(pilot, lambda: len(fresh.turns) == 2 and not app.lifecycle.generating)
        assert app.chat.current is fresh and user_texts(fresh) == ["sent early"] and len(older.turns) == 2


async def test_a_message_over_the_context_is_not_sent_and_the_chat_goes_on() -> None:
    """A message that cannot fit the context even alone stays in the composer, saying its size; it never joins the
    chat (resent with every later message, each of those would fail too), and the next message is answered."""
    backend = FakeBackend(words=4)
    app = TandemApp(lambda _: backend)
    async with app.run_test(size=(100, 30)) as pilot:
        await ask_and_wait(pilot, app, "Hello there")
        pasted = " ".join(["word"] * 4000)  # (the fake: a token a word; its context 4096 keeps 512 for the answer)
        await ask(pilot, app, pasted)
        await pilot.pause()
        assert [t.content for t in app.chat.current.turns if t.role == "user"] == ["Hello there"]
        assert app.query_one(Composer).text == pasted and len(backend.prompts) == 1
        assert any(n.title == "Not sent" and "4002 tokens" in n.message and "4096" in n.message
                   for n in app._notifications)
        app.query_one(Composer).text = ""
        await ask(pilot, app, "And now?")
        await wait_until(pilot, lambda: not app.lifecycle.generating and len(app.chat.current.turns) == 4)
        assert backend.prompts[-1][-1]["content"] == "And now?" and all(
            m["content"] != pasted for m in backend.prompts[-1])


async def test_a_queued_message_over_the_context_goes_back_and_the_queue_goes_on() -> None:
    """Messages queued behind an answer: one too long for the context goes back to the composer after what is being
    typed there (nothing lost), and the one behind it is still sent."""
    backend = FakeBackend(words=4)
    backend.hold = threading.Event()
    app = TandemApp(lambda _: backend)
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(pilot, app, "First")
        await wait_until(pilot, lambda: backend.started.is_set())
        pasted = " ".join(["word"] * 4000)
        await ask(pilot, app, pasted)
        await ask(pilot, app, "Third")
        app.query_one(Composer).text = "still typing"
        backend.hold.set()
        await wait_until(pilot, lambda: len(backend.prompts) == 2 and not app.lifecycle.generating
                         and len(app.chat.current.turns) == 4)
        assert [t.content for t in app.chat.current.turns if t.role == "user"] == ["First", "Third"]
        assert app.query_one(Composer).text == "still typing\n\n" + pasted
        assert any(n.title == "Not sent" for n in app._notifications)
