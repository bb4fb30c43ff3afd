"""`tandem chat`: the terminal chat app, the shell around the chat screen.

The shell keeps the model (`ModelLifecycle`: loading, replacing, restoring, what may start while what runs), runs
the load and tuning workers, holds the settings, opens the dialogs (settings, help, model picker, tuning wizard)
and owns the app-wide keys. The chat itself (conversations, composer, streaming, status bar) is `ChatScreen`,
the default screen. Workers talk to the app through small message dataclasses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.command import CommandPalette
from textual.message import Message
from textual.screen import ModalScreen, Screen
from textual.theme import Theme

from tandem.app.chat.backend import ChatBackend
from tandem.app.chat.lifecycle import Failed, ModelLifecycle, Ready, Unloaded, load_in_turn
from tandem.app.chat.remote import RemoteServer
from tandem.app.chat.screens.chat import ChatOpened, ChatScreen
from tandem.app.chat.screens.help import (
    HelpContent,
    HelpScreen,
    KeyRow,
    bindings_of,
    key_label,
    key_rows,
    own_widget_bindings,
)
from tandem.app.chat.screens.picker import PickerScreen
from tandem.app.chat.screens.settings import SettingsChoice, SettingsScreen
from tandem.app.chat.screens.wizard import WizardScreen, tuning_keys
from tandem.app.chat.search import ChatSearch
from tandem.app.chat.settings import load_settings, save_settings
from tandem.app.chat.store import ConversationStore
from tandem.app.chat.tuning_choices import load_tuning_choices, save_skip
from tandem.autotune.microbench import Step
from tandem.autotune.run import Tuned, autotune
from tandem.kernels.errors import TandemError
from tandem.runtime.discover import Stores
from tandem.runtime.sampling import SamplingParams


@dataclass
class ModelReady(Message):
    ready: Ready
    load: int  # which load: replies of a load since replaced are stale


@dataclass
class TuningFinished(Message):
    pass


@dataclass
class ModelFailed(Message):
    error: str
    from_picker: bool
    load: int


class TandemApp(App[None]):
    CSS_PATH = "tandem.tcss"
    TITLE = "Tandem"
    # priority: they work while the composer has focus (its own keys would otherwise take them)
    BINDINGS = [
        Binding("f2", "settings", "Settings", priority=True),
        Binding("ctrl+o", "pick_model", "Models", priority=True),
        Binding("ctrl+t", "tune", "Auto-tune", priority=True, show=False),  # (offered by itself; in the help)
        Binding("f1,question_mark", "help", "Help"),
    ]
    DIALOG_ACTIONS = {"settings", "pick_model", "tune", "help"}
    COMMANDS = App.COMMANDS | {ChatSearch}

    def __init__(self, load_backend: Callable[[str | None], ChatBackend], model: str | None = None,
                 store: ConversationStore | None = None, params: SamplingParams | None = None,
                 models_folders: list[Path] | None = None,
                 tune: Callable[[str, str, Callable[[Step], None]], Tuned] | None = None,
                 stores: Stores | None = None, remote: RemoteServer | None = None) -> None:
        """`load_backend(path)` loads a model folder (None: the built-in model) in a worker thread. The picker lists
        `models_folders` and other apps' `stores` (None: where they keep models on this machine); with `remote`, the
        models that server serves instead (`load_backend` then takes their names)."""
        super().__init__()
        self.load_backend = load_backend
        self.remote = remote
        self.model_path = model
        self.models_folders = models_folders or []
        self.stores = stores
        self.tune = tune or self.tune_loaded
        self.store = store or ConversationStore()
        self.settings, self.settings_notice = load_settings()  # the defaults new chats start with
        if params is not None:  # given (by a test, say): new chats sample so, whatever was saved
            self.settings = replace(self.settings, temperature=params.temperature, top_p=params.top_p,
                                    top_k=params.top_k, max_new_tokens=params.max_new_tokens,
                                    repetition_penalty=params.repetition_penalty)
        self.tuning_choices, self.tuning_choices_notice = load_tuning_choices()
        self.lifecycle = ModelLifecycle(
            tuning_open=lambda: any(isinstance(screen, WizardScreen) for screen in self.screen_stack))
        # the model the wizard waits to be offered for, until no dialog is open (it never stacks on one)
        self.tuning_offer: ChatBackend | None = None

    def get_default_screen(self) -> Screen:
        return ChatScreen(self.store)

    @property
    def chat(self) -> ChatScreen:
        return cast(ChatScreen, self.default_screen)

    # -- start-up -------------------------------------------------------------------------------
    def on_mount(self) -> None:
        """The theme last chosen comes back, and a newly chosen one is remembered."""
        if self.settings.theme in self.available_themes:
            self.theme = self.settings.theme
        else:  # a theme of another Textual version: the default, said once
            self.notify(f"the saved theme {self.settings.theme!r} does not exist here; the default is used",
                        severity="warning")
        self.theme_changed_signal.subscribe(self, self.remember_theme)

    def remember_theme(self, theme: Theme) -> None:
        if theme.name == self.settings.theme:
            return
        self.settings.theme = theme.name
        try:
            save_settings(self.settings)
        except (OSError, TandemError) as e:
            self.notify(f"the theme applies now but could not be saved ({e})", severity="error", timeout=20)

    def on_chat_opened(self, message: ChatOpened) -> None:
        for notice in (self.settings_notice, self.tuning_choices_notice):
            if notice:
                self.notify(notice, severity="warning", timeout=10)
        self.screen_change_signal.subscribe(self, self.screen_changed)
        self.load_model(self.model_path)

    # -- the model ------------------------------------------------------------------------------
    def load_model(self, path: str | None, from_picker: bool = False) -> None:
        """Load in the background; the current model stays until the new one is ready, unless the two do not fit
        in memory side by side: then the current one is let go first and the load tried once more (and should
        that fail too, the current one is loaded again). No answer starts meanwhile."""
        self.load_worker(path, from_picker, self.lifecycle.begin_load(), self.lifecycle.holds_accelerator())

    @work(thread=True, exclusive=True, group="model")
    def load_worker(self, path: str | None, from_picker: bool, load: int, release_first: bool) -> None:
        name = path or "the built-in model"
        self.call_from_thread(self.chat.show_loading, f"loading {name}…")

        def report(outcome: Ready | Failed) -> None:
            if isinstance(outcome, Ready):
                self.post_message(ModelReady(outcome, load))
            else:
                self.post_message(ModelFailed(outcome.error, from_picker, load))

        load_in_turn(self.load_backend, path, lambda: self.call_from_thread(self.unload_model, name, load), report,
                     release_first)

    def unload_model(self, name: str, load: int) -> Unloaded | None:
        """Let the current model go to make room for `name` (load number `load`), if it may go (see
        `ModelLifecycle.unload`), and say so."""
        unloaded = self.lifecycle.unload(load)
        if unloaded is not None:
            self.chat.show_loading(f"unloaded {unloaded.name} to make room; loading {name}…")
        return unloaded

    def loading_progress(self, message: str, fraction: float) -> None:
        """For the loader, from the loading worker's thread: a long step's progress (reading experts into RAM)."""
        self.call_from_thread(self.chat.show_loading, f"{message} {fraction:.0%}", fraction)

    def on_model_ready(self, message: ModelReady) -> None:
        if not self.lifecycle.arrived(message.ready, message.load):
            return
        self.chat.hide_loading()
        self.chat.update_status()
        self.chat.focus_composer()
        self.chat.send_queued()
        self.tuning_offer = None if message.ready.restored else message.ready.backend
        self.offer_tuning()

    def on_model_failed(self, message: ModelFailed) -> None:
        if not self.lifecycle.load_failed(message.load):
            return
        self.chat.hide_loading()
        if self.lifecycle.backend is None:  # no model to answer the messages that were waiting: give them back
            self.chat.unqueue()
        if message.from_picker:  # back to the picker with the error; the current model stays loaded
            self.chat.update_status()
            self.action_pick_model(message.error)
            return
        self.chat.show_status(f"model failed to load: {message.error}")
        self.notify(message.error, title="The model could not be loaded", severity="error", timeout=30)

    def busy(self) -> bool:
        """Whether an answer, a model load or a tuning run is under way (saying which); nothing else may start."""
        reason = self.lifecycle.busy_reason()
        if reason is not None:
            self.notify(reason)
        return reason is not None

    def action_pick_model(self, error: str = "") -> None:
        if any(isinstance(screen, PickerScreen) for screen in self.screen_stack):
            return
        if self.busy():
            return
        from tandem.runtime.builtin import builtin_dir
        from tandem.runtime.discover import ModelEntry, discover

        def chosen(entry: ModelEntry | None) -> None:
            if entry is not None and not self.busy():  # (an answer may have started from the keyboard meanwhile)
                self.load_model(entry.path, from_picker=True)

        def find() -> tuple[list[ModelEntry], int | None]:  # (in the picker's worker thread)
            from tandem.autotune.probe import probe

            if self.remote is not None:
                return self.remote.entries(), None

            gpu = probe().gpu(0)  # (the GPU `--gpu 0` runs on)
            return discover(self.models_folders, builtin_dir(), self.stores), gpu.memory_total if gpu else None

        self.push_screen(PickerScreen(find, error), chosen)

    # -- tuning ---------------------------------------------------------------------------------
    def screen_changed(self, screen: Screen) -> None:
        """Called (posted, so after the closed dialog's own callback) whenever another screen is on top."""
        if self.tuning_offer is not None:
            self.offer_tuning()

    def offer_tuning(self) -> None:
        """Offer the wizard for the model that just loaded when neither a profile for it on this machine nor a
        skip exists, and only on the chat screen: a wizard over another dialog would take its keys. With a
        dialog open the offer waits until the chat is back on top (`screen_changed`)."""
        backend = self.tuning_offer
        if backend is None or backend is not self.lifecycle.backend:  # (another model came meanwhile)
            self.tuning_offer = None
            return
        if self.screen is not self.chat:
            return
        self.tuning_offer = None
        target = backend.tuning_target()
        if target is None:
            return
        from tandem.autotune.profile import find_profile

        machine, model = tuning_keys(target.raw_config, target.dtype)
        if find_profile(machine, model).profile is not None or self.tuning_choices.is_skipped(machine, model):
            return
        if self.lifecycle.busy_reason() is not None:  # (an answer started while it loaded): no wizard now
            self.notify("this model is not tuned for this machine yet: Ctrl+T tunes it")
            return
        self.action_tune()

    def can_load(self, path: str | None) -> bool:
        """Whether a chat's model can be brought back here: on a server, only a model it serves (a chat answered by
        a local model keeps the server's current one)."""
        if self.remote is None:
            return True
        try:
            return path is not None and path in {e.path for e in self.remote.entries()}
        except TandemError:
            return False

    def action_tune(self) -> None:
        """The auto-tune wizard for the loaded model (offered after a load, or any time with Ctrl+T). Skip
        remembers the model as skipped on this machine; Save applies the plan by loading the model again."""
        backend = self.lifecycle.backend
        target = backend.tuning_target() if backend is not None else None
        if target is None:
            if backend is not None and backend.remote is not None:
                self.notify(f"tuning measures this machine for a model run here; this chat runs on {backend.remote}")
            return
        if self.screen is not self.chat:  # a priority key reaches here from a dialog too: no wizard over it
            self.notify("close this dialog first (Esc); then Ctrl+T tunes the model")
            return
        if self.busy():
            return
        machine, model = tuning_keys(target.raw_config, target.dtype)

        def done(saved: bool | None) -> None:
            self.chat.focus_composer()
            self.chat.send_queued()
            if saved:
                self.notify("profile saved; it applies now: loading the model again with it…")
                self.call_later(self.load_model, self.lifecycle.path)  # (once the wizard is closed)
            elif saved is False:
                self.remember_skip(machine, model)

        self.push_screen(WizardScreen(lambda progress: self.measure(target.path, target.dtype, progress)), done)

    def remember_skip(self, machine: dict, model: dict) -> None:
        """The wizard was skipped: it is not offered again for this model on this machine (Ctrl+T still opens
        it). Kept for this session even when it cannot be saved."""
        self.tuning_choices = self.tuning_choices.with_skip(machine, model)
        try:
            self.tuning_choices = save_skip(self.tuning_choices)
        except (OSError, TandemError) as e:  # TandemError: a folder that cannot be created
            self.notify(f"skipping the tuning could not be saved ({e}); it will be offered at the next start",
                        severity="warning", timeout=10)
            return
        self.notify("tuning skipped: Ctrl+T tunes this model any time")

    def tune_loaded(self, path: str, dtype: str, progress: Callable[[Step], None]) -> Tuned:
        """The tuning run; its calibration decode reuses the model in memory (a second copy might not fit)."""
        backend = self.lifecycle.backend
        return autotune(path, dtype, progress=progress, save=False,
                        loaded=backend.loaded_model() if backend is not None else None)

    def measure(self, path: str, dtype: str, progress: Callable[[Step], None]) -> Tuned:
        """In the wizard's worker thread: the tuning run, the model marked busy meanwhile."""
        try:
            return self.lifecycle.measure(lambda: self.tune(path, dtype, progress))
        finally:
            self.post_message(TuningFinished())

    def on_tuning_finished(self, message: TuningFinished) -> None:
        self.lifecycle.release_retired()
        self.chat.send_queued()

    async def action_quit(self) -> None:
        """Ctrl+Q: the answer under way (as far as it came) and the messages waiting are saved first."""
        self.chat.keep_unfinished()
        self.exit()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The app's dialog keys act from the chat only: a dialog owns the keyboard while it is open (F2 twice
        opens one Settings; Ctrl+O in the rename box opens no picker)."""
        if action in self.DIALOG_ACTIONS and self.dialog_open():
            return False
        return True

    def dialog_open(self) -> bool:
        """Whether one of the app's dialogs is open (the command palette is not one: its commands close it)."""
        return any(isinstance(s, ModalScreen) and not isinstance(s, CommandPalette) for s in self.screen_stack)

    # -- settings, help, command palette --------------------------------------------------------
    @property
    def params(self) -> SamplingParams:
        """How the current chat samples (its own settings, or the defaults for a chat without any)."""
        return self.chat.chat_settings(self.chat.current).params()

    def action_settings(self) -> None:
        """F2: the current chat's settings; ticked, the defaults for new chats too."""
        conv = self.chat.current

        def apply(choice: SettingsChoice | None) -> None:
            self.chat.focus_composer()
            if choice is None:
                return
            conv.settings = choice.settings
            if conv.turns:
                self.chat.save(conv)
            self.chat.update_status()
            if not choice.for_new_chats:
                self.notify("settings saved for this chat")
                return
            self.settings = replace(choice.settings, theme=self.settings.theme)
            try:
                save_settings(self.settings)
            except (OSError, TandemError) as e:  # TandemError: a folder that cannot be created
                self.notify(f"the settings apply now but could not be saved ({e})", title="Not saved",
                            severity="error", timeout=20)
                return
            self.notify("settings saved for this chat and new ones")

        self.push_screen(SettingsScreen(self.chat.chat_settings(conv)), apply)

    def action_help(self) -> None:
        """The help, its keys read from the bindings now (the chat's, the app's, Tandem's widgets'): a key bound
        anywhere is listed without editing the help."""
        if any(isinstance(screen, HelpScreen) for screen in self.screen_stack):
            return
        bound = [*bindings_of(self.chat), *bindings_of(self), *own_widget_bindings(self.chat.query("*"))]
        rows = [KeyRow(keys, what, "composer") for keys, what in ChatScreen.COMPOSER_KEYS] + [
            KeyRow(r.keys, "Command palette: every action", r.action) if r.action == "command_palette" else r
            for r in key_rows(bound)]
        # Tandem's own keys first; then Textual's (namespaced actions: "app.focus_next", "screen.copy_text")
        rows.sort(key=lambda row: "." in row.action)
        self.push_screen(HelpScreen(HelpContent(rows, self.store.folder.absolute(), self.store.exports.absolute())))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for namespace, bindings in ((self.chat, ChatScreen.BINDINGS), (self, self.BINDINGS)):
            for b in bindings:
                yield SystemCommand(b.description, key_label(b.key),
                                    lambda a=b.action, n=namespace: self.run_action(a, n))
