"""The chat app's tuning wizard (when it is offered, what its plan says, saving applies the plan), the expert
heatmap (live, its legend, scrolling) and the help dialog, headless through Pilot with fake backends."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from textual.binding import Binding
from textual.widgets import Button, Static

from tandem.app.chat import tui
from tandem.app.chat.backend import TuningTarget
from tandem.app.chat.heatmap import ExpertHeatmap
from tandem.app.chat.screens.chat import ChatScreen
from tandem.app.chat.screens.help import HelpScreen
from tandem.app.chat.screens.settings import SettingsScreen
from tandem.app.chat.screens.wizard import WizardScreen
from tandem.app.chat.tui import TandemApp
from tandem.autotune.microbench import Step
from tandem.autotune.plan import Plan, PlanResult
from tandem.autotune.run import Tuned
from tests.fakes import FakeBackend, TunableFake
from tests.test_tui import fake_tune, press, wait_for_screen, wait_until


class PathTunable(FakeBackend):
    """A tunable model whose config (so its fingerprint) depends on its folder: two paths are two models."""

    def tuning_target(self) -> TuningTarget | None:
        return TuningTarget(f"/models/{self.path}", "bf16", {"model_type": "mixtral", "hidden_size": 64,
                                                             "name": str(self.path)})


def wizards(app: TandemApp) -> int:
    return sum(isinstance(s, WizardScreen) for s in app.screen_stack)


async def settle(pilot, app: TandemApp) -> None:
    """The model loaded and the app idle long enough for a wizard that would be offered to be on screen."""
    await wait_until(pilot, lambda: app.lifecycle.backend is not None and not app.lifecycle.loading)
    await pilot.pause(0.2)


# -- bug 10: the tuning wizard ----------------------------------------------------------------------------------
async def test_a_skipped_wizard_is_not_offered_again_at_launch_nor_after_a_model_switch(tandem_home: Path) -> None:
    app = TandemApp(lambda path: PathTunable(words=2, path=path), tune=fake_tune)
    async with app.run_test() as pilot:
        wizard = await wait_for_screen(pilot, app, WizardScreen)  # neither tuned nor skipped: offered
        wizard.query_one("#skip", Button).press()
        await wait_until(pilot, lambda: wizards(app) == 0)
        app.load_model("other")  # another model: offered (and skipped with Escape)
        await wait_for_screen(pilot, app, WizardScreen)
        await press(pilot, "escape")
        app.load_model(None)  # back to the first one: skipped already
        await settle(pilot, app)
        assert wizards(app) == 0 and app.lifecycle.path is None
    saved = json.loads((tandem_home / "tuning-choices.json").read_text())
    assert saved["schema"] == 1 and len(saved["skipped"]) == 2
    again = TandemApp(lambda path: PathTunable(words=2, path=path), tune=fake_tune)
    async with again.run_test() as pilot:  # the next launch: still skipped
        await settle(pilot, again)
        assert wizards(again) == 0
        await press(pilot, "ctrl+t")  # Ctrl+T still tunes it any time
        assert isinstance(again.screen, WizardScreen)


async def test_a_broken_choices_file_is_set_aside_with_a_notice(tandem_home: Path) -> None:
    (tandem_home / "tuning-choices.json").write_text("{ not json")
    app = TandemApp(lambda _: TunableFake(words=2), tune=fake_tune)
    async with app.run_test() as pilot:
        await wait_for_screen(pilot, app, WizardScreen)  # nothing counts as skipped
        assert any("tuning choices file" in n.message and "set aside" in n.message for n in app._notifications)
    assert list(tandem_home.glob("tuning-choices.bad-*"))


async def test_the_wizard_waits_until_no_dialog_is_open() -> None:
    gate = threading.Event()

    def load_backend(path: str | None) -> TunableFake:
        gate.wait(10)
        return TunableFake(words=2, path=path)

    app = TandemApp(load_backend, tune=fake_tune)
    async with app.run_test(size=(100, 40)) as pilot:
        await press(pilot, "f1")
        assert isinstance(app.screen, HelpScreen)
        gate.set()  # the model arrives while the help is open: the wizard must not stack on it
        await settle(pilot, app)
        assert isinstance(app.screen, HelpScreen) and wizards(app) == 0
        await press(pilot, "escape")  # back on the chat: now it is offered
        await wait_for_screen(pilot, app, WizardScreen)
        assert app.screen_stack[-2] is app.chat
        await press(pilot, "escape")
        await press(pilot, "f2")
        await press(pilot, "ctrl+t")  # not from a dialog either
        assert isinstance(app.screen, SettingsScreen) and wizards(app) == 0


def tune_to(plan: Plan) -> Callable[[str, str, Callable[[Step], None]], Tuned]:
    def tune(path: str, dtype: str, progress: Callable[[Step], None]) -> Tuned:
        tuned = fake_tune(path, dtype, progress)
        tuned.result = PlanResult(plan, 12.3, 0.0)
        return tuned

    return tune


PLANS = {
    "one thread, default crossover": (Plan(1, kernel_isa="avx512", crossover=None),
                                      ["1 CPU thread "], ["threads", "up to 0", "up to None"]),
    "eight threads, crossover 4": (Plan(8, kernel_isa="avx2", crossover=4),
                                   ["8 CPU threads", "up to 4 tokens", "AVX2"], ["up to 0"]),
    "no compiled kernel": (Plan(2, kernel_isa=None, crossover=None), ["2 CPU threads", "PyTorch"], ["up to"]),
}


@pytest.mark.parametrize("case", PLANS.values(), ids=PLANS.keys())
async def test_the_plan_is_said_in_words(case: tuple[Plan, list[str], list[str]]) -> None:
    plan, present, absent = case
    app = TandemApp(lambda _: TunableFake(words=2), tune=tune_to(plan))
    async with app.run_test(size=(100, 40)) as pilot:
        wizard = await wait_for_screen(pilot, app, WizardScreen)
        wizard.query_one("#start", Button).press()
        await wait_until(pilot, lambda: not wizard.query_one("#save", Button).disabled)
        text = str(wizard.query_one("#step").render())
        for words in present:
            assert words in text
        for words in absent:
            assert words not in text
        assert "Predicted decode: 12.3 tokens/s" in text


async def test_saving_a_plan_reloads_the_model_with_it(tandem_home: Path) -> None:
    loads: list[str | None] = []

    def load_backend(path: str | None) -> TunableFake:
        loads.append(path)
        return TunableFake(words=2, path=path)

    app = TandemApp(load_backend, model="/models/fake", tune=fake_tune)
    async with app.run_test(size=(100, 40)) as pilot:
        wizard = await wait_for_screen(pilot, app, WizardScreen)
        first = app.lifecycle.backend
        wizard.query_one("#start", Button).press()
        await wait_until(pilot, lambda: not wizard.query_one("#save", Button).disabled)
        wizard.query_one("#save", Button).press()
        await wait_until(pilot, lambda: len(loads) == 2 and app.lifecycle.backend is not first
                         and not app.lifecycle.loading)
        assert loads == ["/models/fake", "/models/fake"] and first.closed
        assert any("applies now" in n.message or "loading it again" in n.message for n in app._notifications)
        await pilot.pause(0.2)
        assert wizards(app) == 0  # tuned now: not offered for the reloaded model


# -- bug 11: the expert heatmap ---------------------------------------------------------------------------------
class Growing(FakeBackend):
    """Expert activity that grows with every word, over `layers` layers, and counts how often it is read."""

    def __init__(self, layers: int = 3, where: list[list[str]] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.layers, self.places, self.reads = layers, where, 0

    def activity(self) -> list[list[int]]:
        self.reads += 1
        return [[self.produced * (1 + (i + j) % 3) for j in range(8)] for i in range(self.layers)]

    def where(self) -> list[list[str]] | None:
        return self.places


def heatmap_text(app: TandemApp) -> str:
    return app.query_one(ExpertHeatmap).text


async def test_the_heatmap_updates_while_the_answer_streams() -> None:
    backend = Growing(words=5, delay=0.1)  # (slow enough for the first word to be sent on its own)
    backend.hold = threading.Event()  # after its first word the answer waits: still streaming
    app = TandemApp(lambda _: backend)
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        await press(pilot, "f5")
        assert "  0 (dense)" in heatmap_text(app)  # nothing ran yet
        app.chat.query_one("#composer").insert("hi")
        await pilot.press("enter")
        await wait_until(pilot, lambda: backend.produced == 1)
        await wait_until(pilot, lambda: re.search(r"^  0 [░▒▓█]+$", heatmap_text(app), re.M))
        assert app.lifecycle.generating
        backend.hold.set()
        await wait_until(pilot, lambda: not app.lifecycle.generating)


async def test_the_heatmap_updates_at_most_twice_a_second_while_streaming() -> None:
    backend = Growing(words=300, delay=0.005)
    app = TandemApp(lambda _: backend)
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        await press(pilot, "f5")
        backend.reads = 0
        start = time.monotonic()
        app.chat.query_one("#composer").insert("hi")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.lifecycle.generating)
        await wait_until(pilot, lambda: not app.lifecycle.generating)
        took = time.monotonic() - start
        # live reads every 0.5 s at most, plus the one when the answer ends
        assert 2 <= backend.reads <= took / 0.5 + 2


@pytest.mark.parametrize("where, shown, hidden", [
    (None, [], ["GPU", "copied", "CPU"]),  # not recorded
    ([["cpu"] * 8] * 3, [], ["GPU", "copied"]),  # a CPU-only machine: nothing ran elsewhere
    ([["gpu", "cpu"] * 4] * 3, ["GPU", "CPU"], ["copied"]),  # resident experts, none copied
    ([["gpu", "fetched", "cpu", ""] * 2] * 3, ["GPU", "copied", "CPU"], []),
])
def test_the_legend_shows_only_what_applies(where: list[list[str]] | None, shown: list[str],
                                            hidden: list[str]) -> None:
    panel = ExpertHeatmap()
    panel.show([[1, 2, 3, 4, 5, 6, 7, 8]] * 3, width=40, where=where)
    legend = "\n".join(panel.text.splitlines()[:3])
    for word in shown:
        assert word in legend
    for word in hidden:
        assert word not in legend
    assert "darker" not in panel.text and "lighter" not in panel.text  # true on one theme only


def contrast(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    """WCAG contrast ratio of two colours."""
    def luminance(c: tuple[int, int, int]) -> float:
        lin = [(v / 255) / 12.92 if v / 255 <= 0.03928 else ((v / 255 + 0.055) / 1.055) ** 2.4 for v in c]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("theme", ["textual-dark", "textual-light"])
async def test_the_heatmaps_colours_are_legible_on_dark_and_light_themes(theme: str) -> None:
    where = [["gpu", "fetched", "cpu", "gpu", "fetched", "cpu", "gpu", "fetched"]] * 3
    app = TandemApp(lambda _: Growing(words=2, where=where))
    async with app.run_test(size=(120, 30)) as pilot:
        app.theme = theme
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        app.lifecycle.backend.produced = 3
        await press(pilot, "f5")
        panel = app.query_one(ExpertHeatmap)
        region = panel.content_region
        checked = 0
        for y in range(region.y, region.bottom):
            for x in range(region.x, region.right):
                style = app.screen.get_style_at(x, y)
                if style.color is None or style.bgcolor is None:
                    continue
                fg, bg = style.color.get_truecolor(), style.bgcolor.get_truecolor()
                if (fg.red, fg.green, fg.blue) != (bg.red, bg.green, bg.blue):
                    ratio = contrast((fg.red, fg.green, fg.blue), (bg.red, bg.green, bg.blue))
                    assert ratio >= 2.0, f"{theme}: {fg} on {bg} at {x},{y} has contrast {ratio:.2f}"
                    checked += 1
        assert checked


async def test_every_row_of_a_30_layer_heatmap_can_be_scrolled_into_view_at_80x24() -> None:
    app = TandemApp(lambda _: Growing(words=2, layers=30))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        app.lifecycle.backend.produced = 3
        await press(pilot, "f5")
        panel = app.query_one(ExpertHeatmap)
        assert panel in app.screen.focus_chain  # Tab reaches it; a scrolling container takes the mouse wheel too
        panel.focus()
        await pilot.pause()
        seen: set[int] = set()
        for _ in range(60):
            seen |= visible_rows(app, panel)
            if panel.scroll_y >= panel.max_scroll_y:
                break
            await press(pilot, "down")
        seen |= visible_rows(app, panel)
        assert seen == set(range(30))


def visible_rows(app: TandemApp, panel) -> set[int]:
    """The layer numbers that start a line of the panel as it is on screen now."""
    region = panel.content_region
    rows = set()
    for y, strip in enumerate(app.screen._compositor.render_strips()):
        if region.y <= y < region.bottom:
            text = strip.text[region.x:region.right]
            match = re.match(r"\s*(\d+) ", text)
            if match:
                rows.add(int(match.group(1)))
    return rows


# -- bug 12: help -----------------------------------------------------------------------------------------------
def help_text(app: TandemApp) -> str:
    return "\n".join(str(w.render()) for w in app.screen.query(Static))


async def test_help_spells_every_key_one_way_and_says_how_to_switch_copy_and_where_chats_are() -> None:
    app = TandemApp(lambda _: FakeBackend())
    async with app.run_test(size=(100, 40)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        await press(pilot, "f1")
        assert isinstance(app.screen, HelpScreen)
        text = help_text(app)
        for spelled in ("F1, ?", "Ctrl+N", "Esc", "F2", "Ctrl+P", "Ctrl+Q", "Shift+Enter"):
            assert spelled in text
        for raw in ("question_mark", "ctrl+", "f1,", "escape"):
            assert raw not in text
        assert "Switching chats" in text and "Tab" in text and "Enter opens" in text
        assert "Copying" in text and "mouse" in text
        assert str(app.store.folder.absolute()) in text
        await press(pilot, "escape")
        shown = {c.help for c in app.get_system_commands(app.screen)}
        assert "F1, ?" in shown and not any("question_mark" in h for h in shown)


class CopyChat(ChatScreen):
    BINDINGS = [Binding("ctrl+y", "copy_answer", "Copy the last answer")]


class CopyApp(TandemApp):
    CSS_PATH = str(Path(tui.__file__).parent / TandemApp.CSS_PATH)  # (a relative one is read beside this file)
    BINDINGS = [Binding("ctrl+g", "get_going", "Go somewhere")]

    def get_default_screen(self) -> ChatScreen:
        return CopyChat(self.store)


async def test_help_lists_a_key_bound_later_and_copy_keys_under_copying() -> None:
    app = CopyApp(lambda _: FakeBackend())
    async with app.run_test(size=(100, 50)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        await press(pilot, "f1")
        text = help_text(app)
        assert "Ctrl+G" in text and "Go somewhere" in text
        copying = text[text.index("Copying"):]
        assert "Ctrl+Y" in copying and "Copy the last answer" in copying


BAD_CHOICES = {
    "not an object": "[1, 2]",
    "no schema": '{"skipped": []}',
    "another schema": '{"schema": 2, "skipped": []}',
    "unknown field": '{"schema": 1, "skipped": [], "colour": "red"}',
    "skipped not a list": '{"schema": 1, "skipped": {}}',
    "a skip without a machine": '{"schema": 1, "skipped": [{"model": {}}]}',
    "a skip's when a number": '{"schema": 1, "skipped": [{"machine": {}, "model": {}, "when": 3}]}',
    "nested too deeply": "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("content", BAD_CHOICES.values(), ids=BAD_CHOICES.keys())
def test_a_choices_file_with_wrong_contents_is_set_aside(content: str) -> None:
    from tandem.app.chat.tuning_choices import choices_path, load_tuning_choices

    path = choices_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    choices, notice = load_tuning_choices()
    assert choices.skipped == () and notice and "set aside" in notice and not path.exists()


def test_skips_are_saved_merged_with_another_windows() -> None:
    from tandem.app.chat.tuning_choices import TuningChoices, load_tuning_choices, save_skip

    machine = {"cpu": "x", "cores": 4, "gpus": []}
    save_skip(TuningChoices().with_skip(machine, {"model_type": "a"}))  # another window
    mine = TuningChoices().with_skip(machine, {"model_type": "b"})
    saved = save_skip(mine)
    again, notice = load_tuning_choices()
    assert notice is None and again == saved
    assert again.is_skipped(machine, {"model_type": "a"}) and again.is_skipped(dict(machine), {"model_type": "b"})
    assert not again.is_skipped(machine | {"cores": 8}, {"model_type": "a"})  # other hardware: asked again
