"""Screen snapshots at 100×30, and the chat at 80×24 and 200×50 (SVG, compared with the accepted ones in
__snapshots__; update with `pytest --snapshot-update` after checking the change by eye). The RAM figure in the
status bar is fixed here: the process's real one differs from run to run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.app.chat.tui import TandemApp
from tandem.app.chat.widgets import Composer
from tests.fakes import FakeBackend, TunableFake
from tests.test_tui import fake_tune, wait_for_screen, wait_until

SIZE = (100, 30)


@pytest.fixture(autouse=True)
def steady_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tandem.app.chat.screens.chat.process_rss", lambda: 300 * 2**20)


async def answered(pilot, question: str = "What is a mixture of experts?") -> None:
    app = pilot.app
    await wait_until(pilot, lambda: app.lifecycle.backend is not None)
    composer = app.query_one(Composer)
    composer.cursor_blink = False
    composer.focus()
    composer.insert(question)
    await pilot.press("enter")
    await wait_until(pilot, lambda: not app.lifecycle.generating and len(app.chat.current.turns) == 2)
    await pilot.pause()


def test_chat_screen(snap_compare) -> None:
    assert snap_compare(TandemApp(lambda _: FakeBackend(words=30)), terminal_size=SIZE, run_before=answered)


def test_heatmap(snap_compare) -> None:
    async def run(pilot) -> None:
        await answered(pilot)
        await pilot.press("f5")
        await pilot.pause()

    assert snap_compare(TandemApp(lambda _: FakeBackend(words=30)), terminal_size=SIZE, run_before=run)


def test_picker(snap_compare, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.runtime.synth import tiny_config, write_test_model

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    write_test_model(tmp_path / "models" / "tiny-olmoe", tiny_config("olmoe"))
    write_test_model(tmp_path / "models" / "tiny-qwen3", tiny_config("qwen3_moe"))

    async def run(pilot) -> None:
        await wait_until(pilot, lambda: pilot.app.lifecycle.backend is not None)
        pilot.app.query_one(Composer).cursor_blink = False
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: getattr(pilot.app.screen, "entries", None) is not None)  # (its search)
        await pilot.pause()

    app = TandemApp(lambda _: FakeBackend(), models_folders=[tmp_path / "models"])
    assert snap_compare(app, terminal_size=SIZE, run_before=run)


def test_wizard(snap_compare) -> None:
    from tandem.app.chat.screens.wizard import WizardScreen

    async def run(pilot) -> None:
        await wait_for_screen(pilot, pilot.app, WizardScreen)
        await pilot.pause()

    assert snap_compare(TandemApp(lambda _: TunableFake(), tune=fake_tune), terminal_size=SIZE, run_before=run)


def test_chat_mid_answer_with_heatmap(snap_compare) -> None:
    """Caught mid-answer: 20 words in, the status bar still saying so (set by hand: a worker that is
    really still running would hold the screenshot back)."""

    async def run(pilot) -> None:
        await answered(pilot, "Explain expert caching in two paragraphs.")
        await pilot.press("f5")
        pilot.app.chat.update_status("answering… (Esc stops)")
        await pilot.pause()

    assert snap_compare(TandemApp(lambda _: FakeBackend(words=20)), terminal_size=SIZE, run_before=run)


@pytest.mark.parametrize("size", [(80, 24), (200, 50)])
def test_chat_at_small_and_large_sizes(snap_compare, size: tuple[int, int]) -> None:
    """80×24: the sidebar folds away, the footer keeps the main keys. 200×50: the sidebar and the heatmap beside
    the chat."""

    async def run(pilot) -> None:
        await answered(pilot, "# A heading I typed\nsnake_case stays as typed")
        if size[0] >= 200:
            await pilot.press("f5")
        await pilot.pause()

    assert snap_compare(TandemApp(lambda _: FakeBackend(words=40)), terminal_size=size, run_before=run)


def test_chat_on_the_light_theme(snap_compare) -> None:
    """The light theme: the chat, the chat list's mark and the heatmap legible on it too."""

    async def run(pilot) -> None:
        pilot.app.theme = "textual-light"
        await answered(pilot)
        await pilot.press("f5")
        await pilot.pause()

    assert snap_compare(TandemApp(lambda _: FakeBackend(words=30)), terminal_size=SIZE, run_before=run)
