"""The chat app, headless through Pilot: streaming, Escape, persistence, broken files, the real runtime."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from textual.widgets import ProgressBar

from tandem.app.chat.backend import RuntimeBackend
from tandem.app.chat.heatmap import ExpertHeatmap
from tandem.app.chat.screens.chat import ChatScreen
from tandem.app.chat.store import Conversation, ConversationStore, Turn
from tandem.app.chat.tui import TandemApp
from tandem.app.chat.widgets import ChatMessage, StatusBar
from tandem.autotune.microbench import Step
from tandem.kernels.errors import CheckpointError, ResourceError
from tandem.runtime.loader import load_model
from tandem.runtime.sampling import SamplingParams
from tests.fakes import FakeBackend, TunableFake

# How long a test waits for something the app is sure to do (a condition waited for, never a speed measured): long
# enough for a CPU several times slower than ours, or one whose cores are all busy, and a hang still fails.
PATIENCE_S = 60.0


async def wait_until(pilot, condition, timeout: float = PATIENCE_S) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        await pilot.pause(0.02)


async def wait_for_screen(pilot, app, kind: type, timeout: float = PATIENCE_S):
    """Wait until a screen of this kind is on top *and* composed (it is on top before its widgets exist)."""
    await wait_until(pilot, lambda: isinstance(app.screen, kind) and app.screen.is_mounted, timeout)
    return app.screen


async def found_models(pilot, picker) -> list:
    """The picker's models, once its search (a worker) is done."""
    await wait_until(pilot, lambda: picker.entries is not None)
    return picker.entries


async def press(pilot, *keys: str) -> None:
    """Press keys and let the app settle (screens push and pop between key presses)."""
    await pilot.press(*keys)
    await pilot.pause()


async def ask(pilot, app: TandemApp, text: str) -> None:
    await wait_until(pilot, lambda: app.lifecycle.backend is not None)
    composer = app.query_one("#composer")
    composer.focus()
    composer.insert(text)
    await pilot.press("enter")


async def ask_and_wait(pilot, app: TandemApp, text: str) -> None:
    """Ask, then wait for the whole answer."""
    await ask(pilot, app, text)
    await wait_until(pilot, lambda: not app.lifecycle.generating and len(app.chat.current.turns) == 2)


async def test_message_streams_reply_and_status_shows_speed() -> None:
    app = TandemApp(lambda _: FakeBackend(words=12))
    async with app.run_test(size=(100, 30)) as pilot:
        await ask_and_wait(pilot, app, "Hello there")
        answers = [m for m in app.query(ChatMessage) if m.role == "assistant"]
        assert answers[-1].text == "".join(f"word{i} " for i in range(12))
        status = str(app.query_one(StatusBar).render())
        assert "42.5 tok/s" in status and "fake-moe" in status and "ctx" in status and "TTFT 123 ms" in status


async def test_loading_shows_the_loaders_progress() -> None:
    reported, release = threading.Event(), threading.Event()

    def load_backend(_: str | None) -> FakeBackend:
        reported.set()  # before the report: the screen may show it before this thread runs on
        app.loading_progress("reading the experts into RAM", 0.5)
        release.wait(10)
        return FakeBackend()

    app = TandemApp(load_backend)
    async with app.run_test() as pilot:
        bar = app.query_one("#loading", ProgressBar)
        await wait_until(pilot, lambda: "reading the experts into RAM 50%" in str(app.query_one(StatusBar).render()))
        assert reported.is_set() and bar.display and bar.total == 100 and bar.progress == 50
        release.set()
        await wait_until(pilot, lambda: not bar.display)


async def test_escape_stops_and_keeps_the_partial_answer() -> None:
    backend = FakeBackend(words=500, delay=0.01)
    app = TandemApp(lambda _: backend)
    async with app.run_test() as pilot:
        await ask(pilot, app, "Tell me everything")
        await wait_until(pilot, lambda: backend.produced >= 5)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not app.lifecycle.generating)
        kept = app.chat.current.turns[-1]
        assert kept.role == "assistant" and kept.content.startswith("word0 word1")
        assert backend.produced < 500
        assert "stopped" in str(app.query_one(StatusBar).render())


async def test_conversations_are_saved_and_restored(tandem_home: Path) -> None:
    app = TandemApp(lambda _: FakeBackend(words=3))
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "First question")
        await pilot.press("ctrl+n")
        await ask_and_wait(pilot, app, "Second question")
    again = TandemApp(lambda _: FakeBackend())
    async with again.run_test() as pilot:
        await pilot.pause()
        titles = sorted(c.title for c in again.chat.conversations)
        assert titles == ["First question", "Second question"]
        assert [t.role for t in again.chat.current.turns] == ["user", "assistant"]
        assert len(again.query(ChatMessage)) == 2


async def test_delete_and_export(tandem_home: Path) -> None:
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "Keep me")
        await press(pilot, "ctrl+s", "enter")  # the export dialog, its default path and format
        exported = list((tandem_home / "exports").glob("*.md"))
        assert exported and "Keep me" in exported[0].read_text()
        await press(pilot, "f8")
        assert len(ConversationStore().load_all()[0]) == 1  # the first press only asks
        await press(pilot, "f8")
        assert ConversationStore().load_all()[0] == []


async def test_a_corrupt_conversation_file_does_not_crash(tandem_home: Path) -> None:
    store = ConversationStore()
    store.save(Conversation(title="good one", turns=[Turn("user", "hi"), Turn("assistant", "hello")]))
    (store.folder / "broken.json").write_text("{ not json")
    app = TandemApp(lambda _: FakeBackend())
    async with app.run_test() as pilot:
        await pilot.pause()
        assert [c.title for c in app.chat.conversations] == ["good one"]
        assert list(store.folder.glob("broken.bad-*"))


async def test_a_model_that_fails_to_load_keeps_the_app_alive() -> None:
    def broken(path: str | None) -> FakeBackend:
        raise CheckpointError("model folder /nowhere does not exist")

    app = TandemApp(broken)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: "failed" in str(app.query_one(StatusBar).render()))
        assert app.is_running and app.lifecycle.backend is None


async def test_expert_heatmap_toggles_and_shows_rows() -> None:
    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test(size=(120, 30)) as pilot:
        await ask(pilot, app, "hi")
        await wait_until(pilot, lambda: not app.lifecycle.generating)
        await press(pilot, "f5")
        panel = app.query_one(ExpertHeatmap)
        text = panel.text
        assert panel.display and "experts per cell: 1" in text and "(dense)" in text and "█" in text


def test_heatmap_folds_128_experts() -> None:
    panel = ExpertHeatmap()
    panel.show([[1] * 128, [0] * 127 + [9]], width=40)
    lines = panel.text.splitlines()
    assert "experts per cell: 4" in lines[0] and len(lines[-1]) <= 4 + 40


async def test_with_the_real_runtime(mixtral_dir: Path) -> None:
    app = TandemApp(lambda _: RuntimeBackend(load_model(mixtral_dir, dtype="fp32", context=128)),
                    params=SamplingParams(max_new_tokens=8))
    async with app.run_test() as pilot:
        from textual.widgets import Button

        from tandem.app.chat.screens.wizard import WizardScreen

        await wait_for_screen(pilot, app, WizardScreen)  # no profile yet: offered
        app.screen.query_one("#skip", Button).press()
        await pilot.pause()
        await ask(pilot, app, "Hello")
        await wait_until(pilot, lambda: not app.lifecycle.generating and len(app.chat.current.turns) == 2)
        status = str(app.query_one(StatusBar).render())
        assert "CPU only" in status and "tok/s" in status and f"/{128}" in status
        assert app.lifecycle.backend.activity()
        # the next turn prefills only what the KV cache does not hold (prefix reuse), and answers as a whole prompt
        await ask(pilot, app, "And then?")
        await wait_until(pilot, lambda: not app.lifecycle.generating and len(app.chat.current.turns) == 4)
        conv = app.chat.current
        cached = app.lifecycle.backend.usage().cached
        assert cached > 0 and f"{cached} cached" in str(app.query_one(StatusBar).render())
        asked = conv.messages(app.chat.chat_settings(conv).system_prompt)[:-1]
    whole = RuntimeBackend(load_model(mixtral_dir, dtype="fp32", context=128, prefix_reuse=False))
    assert "".join(whole.stream(asked, SamplingParams(max_new_tokens=8))) == conv.turns[-1].content
    assert whole.usage().cached == 0


@pytest.mark.parametrize("case", ["qwen3_next", "lfm2_moe", "granitemoehybrid"])
async def test_a_hybrids_chat_reuses_its_state_for_the_next_turn_and_a_retry(hf_checkpoints: dict[str, Path],
                                                                            case: str) -> None:
    """A hybrid's recurrent state (runtime/state.py) in the chat app: the next turn takes up where the answer
    stopped, a retry (Ctrl+R) at the mark before its question's last token; each answer is the whole prompt's."""
    from textual.widgets import Button

    from tandem.app.chat.screens.wizard import WizardScreen

    folder = hf_checkpoints[case]
    app = TandemApp(lambda _: RuntimeBackend(load_model(folder, dtype="fp32", context=256)),
                    params=SamplingParams(max_new_tokens=8))
    whole = RuntimeBackend(load_model(folder, dtype="fp32", context=256, prefix_reuse=False))
    async with app.run_test() as pilot:
        await wait_for_screen(pilot, app, WizardScreen)
        app.screen.query_one("#skip", Button).press()
        await pilot.pause()
        await ask(pilot, app, "Hello")
        await wait_until(pilot, lambda: not app.lifecycle.generating and len(app.chat.current.turns) == 2)
        await ask(pilot, app, "And then?")
        await wait_until(pilot, lambda: not app.lifecycle.generating and len(app.chat.current.turns) == 4)
        conv = app.chat.current
        assert app.lifecycle.backend.usage().cached > 0
        asked = conv.messages(app.chat.chat_settings(conv).system_prompt)[:-1]
        assert "".join(whole.stream(asked, SamplingParams(max_new_tokens=8))) == conv.turns[-1].content
        await press(pilot, "ctrl+r")
        await wait_until(pilot, lambda: not app.lifecycle.generating and conv.turns[-1].version_count == 2)
        assert app.lifecycle.backend.usage().cached > 0  # (the mark before the question's last token)
        assert conv.turns[-1].content == "".join(whole.stream(asked, SamplingParams(max_new_tokens=8)))


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen2_moe-shared", "olmoe", "mixtral", "glm4_moe", "deepseek_v2",
                                  "gpt_oss", "gemma4_text", "qwen3_5_moe_text", "lfm2_moe", "granitemoehybrid"])
async def test_the_chat_app_on_a_gguf_file_of_each_architecture(hf_checkpoints: dict[str, Path], tmp_path: Path,
                                                               case: str) -> None:
    """The chat app answers from a GGUF file of every architecture it reads (tests/ggufs.py writes them as llama.cpp's
    converter does), with the file's own chat template: the answer the runtime streams for the conversation."""
    from tandem.app.chat.screens.wizard import WizardScreen
    from tests.ggufs import write_gguf

    file = write_gguf(hf_checkpoints[case], tmp_path / "m.gguf") and tmp_path / "m.gguf"
    backend = RuntimeBackend(load_model(file, dtype="fp32", context=128))
    want = "".join(backend.stream([{"role": "user", "content": "Hello"}], SamplingParams(max_new_tokens=6)))
    app = TandemApp(lambda _: RuntimeBackend(load_model(file, dtype="fp32", context=128)),
                    params=SamplingParams(max_new_tokens=6))
    async with app.run_test() as pilot:
        from textual.widgets import Button

        await wait_for_screen(pilot, app, WizardScreen)
        app.screen.query_one("#skip", Button).press()
        await pilot.pause()
        await ask(pilot, app, "Hello")
        await wait_until(pilot, lambda: not app.lifecycle.generating and len(app.chat.current.turns) == 2)
        assert app.chat.current.turns[1].content.strip() == want.strip() and want.strip()


async def test_settings_are_edited_validated_and_saved(tandem_home: Path) -> None:
    from textual.widgets import Button, Checkbox, Input, TextArea

    from tandem.app.chat.screens.settings import SettingsScreen
    from tandem.app.chat.settings import load_settings

    app = TandemApp(lambda _: FakeBackend())
    async with app.run_test(size=(100, 40)) as pilot:
        await press(pilot, "f2")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        screen.query_one("#temperature", Input).value = "hot"
        screen.query_one("#save", Button).press()
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen) and "not a number" in str(screen.query_one("#error").render())
        screen.query_one("#temperature", Input).value = "0.2"
        screen.query_one("#system_prompt", TextArea).text = "Be brief."
        screen.query_one("#for_new", Checkbox).value = True  # the defaults for new chats too: saved to the file
        screen.query_one("#save", Button).press()
        await pilot.pause()
        assert not isinstance(app.screen, SettingsScreen)
        assert app.params.temperature == 0.2
    saved, notice = load_settings()
    assert saved.temperature == 0.2 and saved.system_prompt == "Be brief." and notice is None


async def test_help_lists_every_key_and_the_palette_has_every_action() -> None:
    from tandem.app.chat.screens.help import HelpScreen

    app = TandemApp(lambda _: FakeBackend())
    async with app.run_test(size=(100, 40)) as pilot:
        await press(pilot, "f1")
        assert isinstance(app.screen, HelpScreen)
        text = " ".join(str(w.render()) for w in app.screen.query("Static"))
        for b in [*ChatScreen.BINDINGS, *TandemApp.BINDINGS]:
            assert b.description in text
        assert "Shift+Enter" in text
        await pilot.press("escape")
        commands = {c.title for c in app.get_system_commands(app.screen)}
        assert {b.description for b in [*ChatScreen.BINDINGS, *TandemApp.BINDINGS]} <= commands


async def test_picker_lists_lm_studio_ollama_and_gguf_repos_and_loads_the_one_chosen(tmp_path: Path) -> None:
    """A fake LM Studio folder, Ollama store and Hugging Face GGUF repository (tests/ggufs.py fake_stores) in the
    tests' home: each model is listed under its app's name, with its family, quantization and source, and the
    chosen one loads from its file (Ollama's: the blob its manifest names)."""
    from textual.widgets import DataTable

    from tandem.app.chat.screens.picker import PickerScreen
    from tests.conftest import build_hf_checkpoint
    from tests.ggufs import fake_stores, write_gguf

    hf = build_hf_checkpoint(tmp_path / "hf", "qwen3_moe", {"hidden_size": 256, "moe_intermediate_size": 256,
                                                             "head_dim": 64})
    write_gguf(hf, tmp_path / "tiny.gguf", "Q8_0", file_type="MOSTLY_Q8_0")
    names = fake_stores(Path.home(), tmp_path / "tiny.gguf")
    loaded: list[str | None] = []

    def load_backend(path: str | None) -> FakeBackend:
        loaded.append(path)
        return FakeBackend()

    app = TandemApp(load_backend)
    async with app.run_test(size=(140, 30)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        await press(pilot, "ctrl+o")
        picker = app.screen
        assert isinstance(picker, PickerScreen)
        entries = await found_models(pilot, picker)
        found = {e.name: e for e in entries}
        for source in ("LM Studio", "Ollama", "HF cache"):
            entry = found[names[source]]
            assert (entry.source, entry.family, entry.quant, entry.runs) == (source, "Qwen3-MoE", "Q8_0", True)
        rows = [picker.query_one(DataTable).get_row_at(i) for i in range(len(entries))]
        assert [names["Ollama"], "Qwen3-MoE", "Q8_0"] == [str(v) for v in rows[list(found).index(names["Ollama"])][:3]]
        picker.dismiss(found[names["Ollama"]])
        await wait_until(pilot, lambda: len(loaded) == 2)
    blob = Path(loaded[1] or "")
    assert blob.parent.name == "blobs" and blob.read_bytes() == (tmp_path / "tiny.gguf").read_bytes()


async def test_picker_lists_a_models_folder_and_a_broken_model_keeps_the_app_alive(tmp_path: Path) -> None:
    from textual.widgets import DataTable

    from tandem.app.chat.screens.picker import PickerScreen
    from tandem.runtime.synth import tiny_config, write_test_model

    folder = tmp_path / "models"
    write_test_model(folder / "tiny-olmoe", tiny_config("olmoe"))
    (folder / "broken").mkdir()
    (folder / "broken" / "config.json").write_text(json.dumps(tiny_config("qwen3_moe")))
    (folder / "broken" / "model.safetensors").write_bytes(b"garbage" * 100)
    (folder / "damaged").mkdir()  # listed as damaged by the search itself: picking it says why, and loads nothing
    (folder / "damaged" / "config.json").write_text("{not json")
    loads: list[str | None] = []

    def load_backend(path: str | None) -> FakeBackend:
        loads.append(path)
        if path and path.endswith("broken"):
            raise CheckpointError(f"{path}/model.safetensors is not a valid safetensors file")
        return FakeBackend()

    app = TandemApp(load_backend, models_folders=[folder])
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        await press(pilot, "ctrl+o")
        picker = app.screen
        assert isinstance(picker, PickerScreen)
        entries = await found_models(pilot, picker)
        names = [e.name for e in entries]
        assert "tiny-olmoe" in names and "broken" in names and names[0].startswith("built-in")
        tiny = next(e for e in entries if e.name == "tiny-olmoe")
        assert tiny.family == "OLMoE" and tiny.experts == 8 and tiny.params > 0
        assert tiny.fits(1 << 40) and not tiny.fits(1)
        table = picker.query_one(DataTable)
        table.move_cursor(row=names.index("damaged"))
        await press(pilot, "enter")
        assert app.screen is picker and len(loads) == 1  # (the first: the model the app started with)
        assert any(n.title == "This model cannot be loaded" and "cannot be read as JSON" in n.message
                   for n in app._notifications)
        picker.dismiss(next(e for e in entries if e.name == "broken"))
        await wait_until(pilot, lambda: isinstance(app.screen, PickerScreen) and app.screen is not picker
                         and app.screen.is_mounted)
        assert "not a valid safetensors" in str(app.screen.query_one("#picker-error").render())
        assert app.is_running and app.lifecycle.backend is not None  # the previous model is still loaded


async def test_the_picker_opens_before_its_search_ends_and_says_when_it_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The search runs in a worker: the picker is up (and Escape works) while it is still going; a search that
    fails says so in the picker and the chat goes on."""
    import threading

    from tandem.app.chat.screens.picker import PickerScreen
    from tandem.kernels.errors import CheckpointError

    release, outcome = threading.Event(), {"fail": False}

    def slow_discover(*args: object, **kwargs: object) -> list:
        assert release.wait(10)
        if outcome["fail"]:
            raise CheckpointError("Ollama's manifests are unreadable")
        return []

    monkeypatch.setattr("tandem.runtime.discover.discover", slow_discover)
    app = TandemApp(lambda path: FakeBackend())
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        await press(pilot, "ctrl+o")
        picker = await wait_for_screen(pilot, app, PickerScreen)
        assert picker.entries is None and "Looking for models" in str(picker.query_one("#picker-status").render())
        await press(pilot, "escape")
        assert not isinstance(app.screen, PickerScreen)
        release.set()  # the first search ends after its picker closed: nothing to fill
        await pilot.pause(0.1)
        outcome["fail"] = True
        await press(pilot, "ctrl+o")
        picker = await wait_for_screen(pilot, app, PickerScreen)
        entries = await found_models(pilot, picker)
        assert entries == [] and "unreadable" in str(picker.query_one("#picker-status").render())
        assert app.is_running and app.lifecycle.backend is not None


def fake_tune(path: str, dtype: str, progress) -> object:
    """The auto-tune on recorded hardware (a desktop with an RTX 4090) and stated measurements."""
    from tandem.autotune.measurements import from_hardware_file
    from tandem.autotune.plan import ModelShape, make_plan
    from tandem.autotune.probe import RecordedSources, probe
    from tandem.autotune.profile import Profile, model_fingerprint
    from tandem.autotune.run import Tuned

    hw = probe(RecordedSources.load(Path(__file__).parent / "fixtures/hardware/desktop_rtx4090_threadripper.json"))
    shape = ModelShape(8, 8, 2, (True,) * 8, 4096, 14336, 352_321_536, 100_000_000)
    for i in range(3):
        progress(Step(f"step {i + 1}", i + 1, 3))
    meas = from_hardware_file({"cores": 24, "cpu_bandwidth_gbps": 60, "cpu_gflops": 600,
                               "gpu": {"expert_ms": 0.35, "h2d_gbps": 25, "vram_bytes_for_experts": 16 * 2**30}},
                              shape.expert_bytes, 6 * 4096 * 14336)
    result = make_plan(shape, meas)
    # keyed by this machine, so the app finds it afterwards; with no more threads than it has (a plan with more
    # is no plan of this machine's: the profile would be set aside)
    machine = probe().fingerprint()
    plan = result.plan.to_dict()
    plan["threads"] = min(plan["threads"], machine.get("threads") or 1, os.cpu_count() or 1)
    profile = Profile(machine, model_fingerprint({"model_type": "mixtral", "hidden_size": 64}, dtype),
                      meas.to_dict(), plan, {"tok_s": result.predicted_tok_s})
    return Tuned(hw, result, profile, None)


async def test_first_run_wizard_tunes_and_saves_a_profile(tandem_home: Path) -> None:
    from textual.widgets import Button

    from tandem.app.chat.screens.wizard import WizardScreen, tuning_keys
    from tandem.autotune.profile import find_profile

    app = TandemApp(lambda _: TunableFake(), tune=fake_tune)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for_screen(pilot, app, WizardScreen)
        wizard = app.screen
        wizard.query_one("#start", Button).press()
        await wait_until(pilot, lambda: not wizard.query_one("#save", Button).disabled)
        assert "Predicted decode" in str(wizard.query_one("#step").render())
        wizard.query_one("#save", Button).press()
        await wait_until(pilot, lambda: not isinstance(app.screen, WizardScreen))
    assert list((tandem_home / "profiles").glob("*.json"))
    assert find_profile(*tuning_keys({"model_type": "mixtral", "hidden_size": 64}, "bf16")).profile is not None
    again = TandemApp(lambda _: TunableFake(), tune=fake_tune)
    async with again.run_test() as pilot:  # tuned already: no wizard this time
        await wait_until(pilot, lambda: again.lifecycle.backend is not None)
        await pilot.pause(0.2)
        assert not isinstance(again.screen, WizardScreen)


def test_heatmap_marks_where_experts_ran(mixtral_dir: Path) -> None:
    from tandem.runtime.dispatch import Strategy

    # layer 0's experts pinned on the accelerator, the rest on the CPU: both tiers run whatever the copies' timing
    # (a cache slot is a hit only once its copy has finished, which a busy machine may delay past a short answer)
    loaded = load_model(mixtral_dir, dtype="fp32", context=64, accelerator="emulated", vram_gb=0.002,
                        strategy=Strategy.CPU, cache_ways=0, static=tuple((0, e) for e in range(8)))
    assert len(loaded.model.dispatcher.static) == 8
    backend = RuntimeBackend(loaded)
    assert backend.placement.startswith("EMULATED:")
    "".join(backend.stream([{"role": "user", "content": "hello there"}], SamplingParams(max_new_tokens=12)))
    where = backend.where()
    flat = {w for row in where for w in row}
    assert "gpu" in flat and "cpu" in flat
    panel = ExpertHeatmap()
    panel.show(backend.activity(), width=40, where=where)
    text = panel.text
    assert "GPU" in text and ("copied" in text) == ("fetched" in flat)  # (the legend names only what occurs)
    assert backend.usage().hit_rate is not None
    used, budget = backend.vram()
    assert 0 < used <= budget  # the accelerator's memory, for the status bar
    loaded.model.close()


async def test_rename_a_conversation(tandem_home: Path) -> None:
    from textual.widgets import Input

    from tandem.app.chat.screens.rename import RenameScreen

    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "old title")
        await press(pilot, "f3")
        assert isinstance(app.screen, RenameScreen)
        field = app.screen.query_one("#title", Input)
        field.value = "Expert caching notes"
        await press(pilot, "enter")
    assert [c.title for c in ConversationStore().load_all()[0]] == ["Expert caching notes"]


def test_picker_vram_column() -> None:
    from tandem.app.chat.screens.picker import ModelEntry

    e = ModelEntry("/m", "m", "Mixtral", 46_700_000_000, 8, 93 * 10**9, "folder")
    assert e.fits_vram(None) == "no GPU" and e.fits_vram(24 * 2**30) == "24%" and e.fits_vram(200 * 10**9) == "all"


async def test_after_skipping_the_wizard_typing_goes_to_the_composer(tandem_home: Path) -> None:
    from tandem.app.chat.screens.wizard import WizardScreen

    app = TandemApp(lambda _: TunableFake(words=3), tune=fake_tune)
    async with app.run_test() as pilot:
        await wait_for_screen(pilot, app, WizardScreen)
        await pilot.press("escape")  # Escape skips the wizard (and closes any dialog)
        await wait_until(pilot, lambda: not isinstance(app.screen, WizardScreen))
        await pilot.press("h", "i", "enter")
        await wait_until(pilot, lambda: not app.lifecycle.generating and len(app.chat.current.turns) == 2)
        assert app.chat.current.turns[0].content == "hi"


async def test_escape_closes_dialogs() -> None:
    from tandem.app.chat.screens.help import HelpScreen
    from tandem.app.chat.screens.settings import SettingsScreen

    app = TandemApp(lambda _: FakeBackend())
    async with app.run_test(size=(100, 40)) as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        for key, screen in (("f2", SettingsScreen), ("f1", HelpScreen)):
            await press(pilot, key)
            assert isinstance(app.screen, screen)
            await press(pilot, "escape")
            assert not isinstance(app.screen, screen)


async def test_a_dialog_owns_the_keys_while_it_is_open(tandem_home: Path) -> None:
    """The chat's keys act on the chat screen only: behind a dialog they do nothing; Escape closes the dialog."""
    from tandem.app.chat.screens.help import HelpScreen
    from tandem.app.chat.screens.settings import SettingsScreen

    backend = FakeBackend(words=3)
    app = TandemApp(lambda _: backend)
    async with app.run_test(size=(100, 40)) as pilot:
        await ask_and_wait(pilot, app, "keep me")
        await press(pilot, "f2")
        assert isinstance(app.screen, SettingsScreen)
        await press(pilot, "ctrl+n", "f4", "ctrl+r", "f8", "f8", "f5")
        assert len(app.chat.conversations) == 1 and len(app.chat.current.turns) == 2 and len(backend.prompts) == 1
        assert ConversationStore().load_all()[0]
        await press(pilot, "escape")
        assert not isinstance(app.screen, SettingsScreen)
        backend.words, backend.hold = 5, threading.Event()
        await press(pilot, "ctrl+r")  # an answer under way, the help open over it: Escape closes the help
        await wait_until(pilot, lambda: backend.produced == 1)
        await press(pilot, "f1")
        assert isinstance(app.screen, HelpScreen)
        await press(pilot, "escape")
        assert not isinstance(app.screen, HelpScreen) and app.lifecycle.generating
        backend.hold.set()
        await wait_until(pilot, lambda: not app.lifecycle.generating)
        assert app.chat.current.turns[-1].content.split() == [f"word{i}" for i in range(5)]  # not stopped
        await press(pilot, "ctrl+n")
        assert len(app.chat.conversations) == 2


async def test_edit_the_last_message(tandem_home: Path) -> None:
    from tandem.app.chat.widgets import Composer

    app = TandemApp(lambda _: FakeBackend(words=2))
    async with app.run_test() as pilot:
        await ask_and_wait(pilot, app, "first try")
        await press(pilot, "f4")
        assert app.chat.current.turns == [] and app.query_one(Composer).text == "first try"
        assert len(app.query(ChatMessage)) == 0
        app.query_one(Composer).text = "second try"
        await pilot.press("enter")
        await wait_until(pilot, lambda: not app.lifecycle.generating and len(app.chat.current.turns) == 2)
        assert app.chat.current.turns[0].content == "second try"


class Memory:
    """Fake loading with room for `room` models at a time ("huge" never fits, "slow" waits for `gate`); every
    attempt, and what loaded."""

    def __init__(self, room: int, kind: type[FakeBackend] = FakeBackend) -> None:
        self.room, self.kind, self.loaded, self.attempts = room, kind, [], []
        self.gate = threading.Event()

    def load(self, path: str | None) -> FakeBackend:
        self.attempts.append(path)
        if path == "slow":
            self.gate.wait(10)
        if path == "huge" or sum(not b.closed for b in self.loaded) >= self.room:
            raise ResourceError(f"not enough RAM for {path}")
        self.loaded.append(self.kind(words=2, path=path))
        return self.loaded[-1]


@pytest.mark.parametrize("room", [2, 1])
async def test_a_new_model_replaces_the_old_one_which_is_released(room: int) -> None:
    memory = Memory(room)
    app = TandemApp(memory.load)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        first = app.lifecycle.backend
        app.load_model("second", from_picker=True)
        assert app.lifecycle.loading
        await wait_until(pilot, lambda: not app.lifecycle.loading)
        assert app.lifecycle.backend.path == "second" and first.closed and not app.lifecycle.backend.closed
    # with room for one: tried beside the first, then again once the first was unloaded
    assert memory.attempts == [None, "second"] + (["second"] if room == 1 else [])


async def test_a_model_that_fits_not_even_alone_brings_the_current_one_back(tandem_home: Path) -> None:
    from tandem.app.chat.screens.picker import PickerScreen
    from tandem.app.chat.screens.wizard import WizardScreen

    memory = Memory(room=1, kind=TunableFake)
    app = TandemApp(memory.load, tune=fake_tune)
    async with app.run_test() as pilot:
        await wait_for_screen(pilot, app, WizardScreen)  # not tuned yet: offered; skipped
        await press(pilot, "escape")
        first = app.lifecycle.backend
        app.load_model("huge", from_picker=True)
        await wait_for_screen(pilot, app, PickerScreen)
        assert memory.attempts == [None, "huge", "huge", None]  # beside it, alone, then the first one again
        assert first.closed and app.lifecycle.backend is not first and app.lifecycle.backend.path is None
        assert not app.lifecycle.loading
        error = str(app.screen.query_one("#picker-error").render())  # (the wizard is not offered again)
        assert "not enough RAM for huge" in error and "the built-in model is loaded again" in error


async def test_a_superseded_load_that_runs_out_of_memory_leaves_the_newer_model_alone() -> None:
    memory = Memory(room=1)
    app = TandemApp(memory.load)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        unloads = []
        unload = app.unload_model
        app.unload_model = lambda name, load: unloads.append(load) or unload(name, load)  # type: ignore[method-assign]
        app.load_model("slow")  # will not fit beside the first: it would unload whatever is loaded then
        await wait_until(pilot, lambda: "slow" in memory.attempts)
        app.load_model("fast")  # unloads the first, then loads
        await wait_until(pilot, lambda: getattr(app.lifecycle.backend, "path", None) == "fast")
        memory.gate.set()  # now the slow load finds no room
        await wait_until(pilot, lambda: len(unloads) == 2)
        assert unloads == [3, 2]  # both asked; the superseded load (2) was refused:
        assert app.lifecycle.backend.path == "fast" and not app.lifecycle.backend.closed
        assert memory.attempts == [None, "slow", "fast", "fast"]


async def test_a_replaced_load_is_dropped_and_a_replaced_answering_model_closed_after_its_answer() -> None:
    memory = Memory(room=3)
    app = TandemApp(memory.load)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.lifecycle.backend is not None)
        app.load_model("slow")
        await wait_until(pilot, lambda: "slow" in memory.attempts)
        app.load_model("fast")  # the slow load cannot be stopped; its model must not win when it comes
        await wait_until(pilot, lambda: getattr(app.lifecycle.backend, "path", None) == "fast")
        memory.gate.set()
        await wait_until(pilot, lambda: any(b.path == "slow" and b.closed for b in memory.loaded))
        assert app.lifecycle.backend.path == "fast" and not app.lifecycle.backend.closed
        answering = app.lifecycle.backend
        answering.words, answering.hold = 5, threading.Event()
        await ask(pilot, app, "hello")
        await wait_until(pilot, lambda: answering.produced == 1)
        app.load_model("other")  # (the picker refuses while answering; a model can still arrive then)
        await wait_until(pilot, lambda: app.lifecycle.backend.path == "other")
        assert app.lifecycle.generating and not answering.closed  # still answering with it
        answering.hold.set()
        await wait_until(pilot, lambda: not app.lifecycle.generating)
        assert answering.closed and app.chat.current.turns[-1].content.split() == [f"word{i}" for i in range(5)]


async def test_no_model_picking_while_answering_or_loading() -> None:
    from tandem.app.chat.screens.picker import PickerScreen

    backend = FakeBackend(words=50, delay=0.02)
    backend.hold = threading.Event()  # the answer waits after its first word: still coming however slow the machine
    app = TandemApp(lambda _: backend)
    async with app.run_test() as pilot:
        await ask(pilot, app, "hello")
        await wait_until(pilot, lambda: app.lifecycle.generating)
        app.action_pick_model()
        await pilot.pause()
        assert not isinstance(app.screen, PickerScreen)
        assert any("answer is still coming" in n.message for n in app._notifications)
        backend.hold.set()
        await press(pilot, "escape")
        await wait_until(pilot, lambda: not app.lifecycle.generating)
        app.lifecycle.loading = True  # as while a model loads
        app.action_pick_model()
        await pilot.pause()
        assert not isinstance(app.screen, PickerScreen)
        assert any("wait for the model" in n.message for n in app._notifications)


async def test_a_tuning_run_keeps_its_model_even_after_its_wizard_is_closed(tandem_home: Path) -> None:
    from textual.widgets import Button

    from tandem.app.chat.screens.picker import PickerScreen
    from tandem.app.chat.screens.wizard import WizardScreen

    go = threading.Event()

    def slow_tune(path: str, dtype: str, progress) -> object:
        go.wait(PATIENCE_S)
        return fake_tune(path, dtype, progress)

    app = TandemApp(lambda path: TunableFake(words=2, path=path), tune=slow_tune)
    async with app.run_test() as pilot:
        wizard = await wait_for_screen(pilot, app, WizardScreen)  # no profile yet: offered
        measured = app.lifecycle.backend
        wizard.query_one("#start", Button).press()
        await wait_until(pilot, lambda: app.lifecycle.tuning_active)
        await press(pilot, "escape")  # the wizard closes; its measurement goes on with the model
        assert not isinstance(app.screen, WizardScreen) and app.lifecycle.tuning()
        app.action_pick_model()
        await pilot.pause()
        assert not isinstance(app.screen, PickerScreen)
        assert any("being tuned" in n.message for n in app._notifications)
        app.load_model("other")  # a model arriving meanwhile: the measured one is closed only afterwards
        await wait_until(pilot, lambda: app.lifecycle.backend.path == "other")
        assert not measured.closed
        go.set()
        await wait_until(pilot, lambda: measured.closed)
        assert not app.lifecycle.tuning() and not app.lifecycle.backend.closed


async def test_an_answer_that_fails_says_so_and_leaves_loading_alone() -> None:
    from tandem.kernels.errors import GenerationError

    release = threading.Event()

    class Failing(FakeBackend):
        def stream(self, messages, params):  # type: ignore[override]
            yield "partial "
            release.wait(10)
            raise GenerationError("the context is full: start a new conversation")

    app = TandemApp(lambda _: Failing())
    async with app.run_test() as pilot:
        await ask(pilot, app, "hello")
        await wait_until(pilot, lambda: app.lifecycle.generating)
        app.lifecycle.loading = True  # as if a model were loading meanwhile: the answer's error must not end that
        release.set()
        await wait_until(pilot, lambda: not app.lifecycle.generating)
        await pilot.pause()
        assert any(n.title == "The answer failed" and "context is full" in n.message for n in app._notifications)
        assert app.lifecycle.loading and app.chat.current.turns[-1].content == "partial "
