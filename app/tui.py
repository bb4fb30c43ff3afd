"""`tandem chat`: the terminal chat app.

Model loading and generation run in declared thread workers; they talk to the widgets through small
message dataclasses. Tokens reach the screen in batches (at most every `REPAINT_S`), Escape stops an
answer and keeps what was produced, conversations are saved after every turn. A save that fails (a full
disk) is a notice: the conversation stays in memory and the next save tries again. A conversation longer
than the context goes to the model without its oldest turns, and the status bar says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Label, ListItem, ListView, ProgressBar
from textual.worker import get_current_worker

from tandem.app.backend import ChatBackend
from tandem.app.context import answer_room, fit_messages
from tandem.app.lifecycle import Failed, ModelLifecycle, Ready, Unloaded, load_in_turn
from tandem.app.screens.help import HelpScreen
from tandem.app.screens.picker import ModelEntry, PickerScreen, discover
from tandem.app.screens.rename import RenameScreen
from tandem.app.screens.settings import SettingsScreen
from tandem.app.screens.wizard import WizardScreen, needs_tuning
from tandem.app.settings import Settings, load_settings, save_settings
from tandem.app.store import Conversation, ConversationStore, Turn
from tandem.app.widgets import ChatMessage, Composer, ExpertHeatmap, StatusBar
from tandem.autotune.microbench import Step
from tandem.autotune.run import Tuned, autotune
from tandem.kernels.errors import TandemError
from tandem.runtime.sampling import SamplingParams

REPAINT_S = 0.05


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


@dataclass
class AnswerFailed(Message):
    error: str


@dataclass
class ContextTrimmed(Message):
    dropped: int  # the oldest messages left out of the prompt


@dataclass
class TokensArrived(Message):
    text: str  # every token since the last batch


@dataclass
class AnswerDone(Message):
    stopped: bool


class TandemApp(App[None]):
    CSS_PATH = "tandem.tcss"
    TITLE = "Tandem"
    # priority: they work while the composer has focus (its own keys would otherwise take them)
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+n", "new_conversation", "New chat", priority=True),
        Binding("ctrl+d", "delete_conversation", "Delete chat", priority=True),
        Binding("ctrl+r", "retry", "Retry", priority=True),
        Binding("f4", "edit_last", "Edit last", priority=True),
        Binding("ctrl+e", "toggle_experts", "Experts", priority=True),
        Binding("ctrl+s", "export", "Export", priority=True),
        Binding("f3", "rename", "Rename chat", priority=True),
        Binding("f2", "settings", "Settings", priority=True),
        Binding("ctrl+o", "pick_model", "Models", priority=True),
        Binding("ctrl+t", "tune", "Auto-tune", priority=True),
        Binding("f1,question_mark", "help", "Help"),
    ]
    COMPOSER_KEYS = [("Enter", "send"), ("Shift+Enter, Ctrl+J", "new line in the message")]
    CONFIRM_S = 3.0

    def __init__(self, load_backend: Callable[[str | None], ChatBackend], model: str | None = None,
                 store: ConversationStore | None = None, params: SamplingParams | None = None,
                 models_folders: list[Path] | None = None,
                 tune: Callable[[str, str, Callable[[Step], None]], Tuned] | None = None) -> None:
        """`load_backend(path)` loads a model folder (None: the built-in model) in a worker thread."""
        super().__init__()
        self.load_backend = load_backend
        self.model_path = model
        self.models_folders = models_folders or []
        self.tune = tune or self.tune_loaded
        self.store = store or ConversationStore()
        self.settings, self.settings_notice = load_settings()
        self.params = params or self.settings.params()
        self.lifecycle = ModelLifecycle(
            tuning_open=lambda: any(isinstance(screen, WizardScreen) for screen in self.screen_stack))
        self.conversations: list[Conversation] = []
        self.current = Conversation()
        self.answer: ChatMessage | None = None
        self.context_note = ""  # what the status bar adds while the prompt leaves turns out
        self._delete_armed = 0.0

    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            yield ListView(id="sidebar")
            with Vertical(id="chat"):
                yield VerticalScroll(id="messages")
                yield Composer(id="composer")
            yield ExpertHeatmap(id="experts")
        yield ProgressBar(id="loading", show_eta=False, show_percentage=False)
        yield StatusBar(id="status")
        yield Footer()

    # -- start-up -------------------------------------------------------------------------------
    def on_mount(self) -> None:
        try:
            self.conversations, notices = self.store.load_all()
        except OSError as e:  # the folder cannot be read (or locked): start empty, say so
            self.conversations, notices = [], [f"the saved conversations could not be read ({e})"]
        if self.settings_notice:
            notices.append(self.settings_notice)
        for notice in notices:
            self.notify(notice, severity="warning", timeout=10)
        if self.conversations:
            self.current = self.conversations[0]
        else:
            self.conversations = [self.current]
        self.refresh_sidebar()
        self.show_conversation()
        self.load_model(self.model_path)

    def load_model(self, path: str | None, from_picker: bool = False) -> None:
        """Load in the background; the current model stays until the new one is ready, unless the two do not fit
        in memory side by side: then the current one is let go first and the load tried once more (and should
        that fail too, the current one is loaded again). No answer starts meanwhile."""
        self.load_worker(path, from_picker, self.lifecycle.begin_load())

    @work(thread=True, exclusive=True, group="model")
    def load_worker(self, path: str | None, from_picker: bool, load: int) -> None:
        name = path or "the built-in model"
        self.call_from_thread(self.show_loading, f"loading {name}…")

        def report(outcome: Ready | Failed) -> None:
            if isinstance(outcome, Ready):
                self.post_message(ModelReady(outcome, load))
            else:
                self.post_message(ModelFailed(outcome.error, from_picker, load))

        load_in_turn(self.load_backend, path, lambda: self.call_from_thread(self.unload_model, name, load), report)

    def unload_model(self, name: str, load: int) -> Unloaded | None:
        """Let the current model go to make room for `name` (load number `load`), if it may go (see
        `ModelLifecycle.unload`), and say so."""
        unloaded = self.lifecycle.unload(load)
        if unloaded is not None:
            self.show_loading(f"unloaded {unloaded.name} to make room; loading {name}…")
        return unloaded

    def show_loading(self, text: str, fraction: float | None = None) -> None:
        """The loading bar: indeterminate, or `fraction` done when the loader reports it."""
        bar = self.query_one("#loading", ProgressBar)
        bar.display = True
        bar.update(total=None if fraction is None else 100, progress=0 if fraction is None else 100 * fraction)
        self.query_one(StatusBar).update(text)

    def loading_progress(self, message: str, fraction: float) -> None:
        """For the loader, from the loading worker's thread: a long step's progress (reading experts into RAM)."""
        self.call_from_thread(self.show_loading, f"{message} {fraction:.0%}", fraction)

    def on_model_ready(self, message: ModelReady) -> None:
        if not self.lifecycle.arrived(message.ready, message.load):
            return
        self.query_one("#loading", ProgressBar).display = False
        self.update_status()
        self.query_one(Composer).focus()
        target = message.ready.backend.tuning_target()
        if target is not None and not message.ready.restored and needs_tuning(target.raw_config, target.dtype):
            self.action_tune()

    def action_tune(self) -> None:
        """The auto-tune wizard for the loaded model (offered on first run, or any time from the palette)."""
        backend = self.lifecycle.backend
        target = backend.tuning_target() if backend is not None else None
        if target is None or self.busy():
            return

        def done(saved: bool | None) -> None:
            self.query_one(Composer).focus()
            if saved:
                self.notify("profile saved; it applies the next time this model loads")

        self.push_screen(WizardScreen(lambda progress: self.measure(target.path, target.dtype, progress)), done)

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

    def on_model_failed(self, message: ModelFailed) -> None:
        if not self.lifecycle.load_failed(message.load):
            return
        self.query_one("#loading", ProgressBar).display = False
        if message.from_picker:  # back to the picker with the error; the current model stays loaded
            self.update_status()
            self.action_pick_model(message.error)
            return
        self.query_one(StatusBar).update(f"model failed to load: {message.error}")
        self.notify(message.error, title="The model could not be loaded", severity="error", timeout=30)

    def action_pick_model(self, error: str = "") -> None:
        if any(isinstance(screen, PickerScreen) for screen in self.screen_stack):
            return
        if self.busy():
            return
        from tandem.runtime.builtin import builtin_dir

        def chosen(entry: ModelEntry | None) -> None:
            if entry is not None and not self.busy():  # (an answer may have started from the keyboard meanwhile)
                self.load_model(entry.path, from_picker=True)

        from tandem.autotune.probe import probe

        gpus = probe().gpus
        vram = gpus[0].memory_total if gpus else None
        self.push_screen(PickerScreen(discover(self.models_folders, builtin_dir()), error, vram), chosen)

    # -- conversations --------------------------------------------------------------------------
    def refresh_sidebar(self) -> None:
        sidebar = self.query_one("#sidebar", ListView)
        sidebar.clear()
        for conv in self.conversations:
            sidebar.append(ListItem(Label(conv.title[:24]), name=conv.id))
        sidebar.index = self.conversations.index(self.current)

    def show_conversation(self) -> None:
        box = self.query_one("#messages", VerticalScroll)
        box.remove_children()
        box.mount_all([ChatMessage(t.role, t.content) for t in self.current.turns])
        box.scroll_end(animate=False)

    @on(ListView.Selected, "#sidebar")
    def pick_conversation(self, event: ListView.Selected) -> None:
        if self.lifecycle.generating:
            return
        chosen = next((c for c in self.conversations if c.id == event.item.name), None)
        if chosen is not None and chosen is not self.current:
            self.current = chosen
            self.show_conversation()

    def save(self, conv: Conversation) -> bool:
        """Save `conv` (merging what other windows saved meanwhile); whether it worked. A failure is a notice: the
        conversation stays in memory, whole, and its next save writes it all."""
        try:
            merged = self.store.save(conv)
        except (OSError, TandemError) as e:
            self.notify(f"the conversation could not be saved ({e}); it stays open here, and the next save "
                        "tries again (Ctrl+S exports it)", title="Not saved", severity="error", timeout=20)
            return False
        if merged and conv is self.current and not self.lifecycle.generating:  # another window's turns came in
            self.show_conversation()
            self.refresh_sidebar()
        return True

    def action_new_conversation(self) -> None:
        if self.lifecycle.generating:
            return
        self.current = Conversation()
        self.conversations.insert(0, self.current)
        self.refresh_sidebar()
        self.show_conversation()
        self.query_one(Composer).focus()

    def action_delete_conversation(self) -> None:
        """Deletes only when pressed twice within a few seconds: the first press asks for confirmation."""
        if self.lifecycle.generating:
            return
        if time.monotonic() - self._delete_armed > self.CONFIRM_S:
            self._delete_armed = time.monotonic()
            self.notify(f"press Ctrl+D again to delete “{self.current.title}”", severity="warning")
            return
        self._delete_armed = 0.0
        try:
            self.store.delete(self.current)
        except (OSError, TandemError) as e:
            self.notify(f"the conversation could not be deleted ({e})", severity="error", timeout=20)
            return
        self.conversations.remove(self.current)
        if not self.conversations:
            self.conversations = [Conversation()]
        self.current = self.conversations[0]
        self.refresh_sidebar()
        self.show_conversation()
        self.notify("conversation deleted")

    def action_rename(self) -> None:
        def apply(title: str | None) -> None:
            self.query_one(Composer).focus()
            if title:
                self.current.title = title
                self.save(self.current)
                self.refresh_sidebar()

        self.push_screen(RenameScreen(self.current.title), apply)

    def action_export(self) -> None:
        try:
            path = self.store.export(self.current)
        except (OSError, TandemError) as e:
            self.notify(f"the conversation could not be exported ({e})", title="Not exported", severity="error",
                        timeout=20)
            return
        self.notify(f"exported to {path}")

    # -- asking and answering -------------------------------------------------------------------
    def busy(self) -> bool:
        """Whether an answer, a model load or a tuning run is under way (saying which); nothing else may start."""
        reason = self.lifecycle.busy_reason()
        if reason is not None:
            self.notify(reason)
        return reason is not None

    def ready_to_answer(self) -> bool:
        """Whether an answer can start now (nothing else under way, a model loaded); says why not."""
        reason = self.lifecycle.answer_refusal()
        if reason is not None:
            self.notify(reason)
        return reason is None

    @on(Composer.Submitted)
    def ask(self, event: Composer.Submitted) -> None:
        if not self.ready_to_answer():
            return
        if not self.current.turns:
            self.current.title = event.text.splitlines()[0][:40]
            self.refresh_sidebar()
        self.current.turns.append(Turn("user", event.text))
        box = self.query_one("#messages", VerticalScroll)
        box.mount(ChatMessage("user", event.text))
        self.start_answer()

    def start_answer(self) -> None:
        box = self.query_one("#messages", VerticalScroll)
        self.answer = ChatMessage("assistant", "")
        box.mount(self.answer)
        box.scroll_end(animate=False)
        self.lifecycle.answer_started()
        self.context_note = ""
        self.update_status("answering… (Esc stops)")
        self.generate(self.current.messages(self.settings.system_prompt))

    @work(thread=True, exclusive=True, group="generate")
    def generate(self, messages: list[dict[str, str]]) -> None:
        worker = get_current_worker()
        backend = self.lifecycle.backend
        assert backend is not None
        pending, last = [], time.monotonic()
        stopped = False
        try:
            limit = backend.context - answer_room(backend.context, self.params.max_new_tokens)
            messages, dropped = fit_messages(messages, backend.prompt_tokens, limit)
            if dropped:
                self.post_message(ContextTrimmed(dropped))
            for piece in backend.stream(messages, self.params):
                pending.append(piece)
                if worker.is_cancelled:
                    stopped = True
                    break
                if time.monotonic() - last >= REPAINT_S:
                    self.post_message(TokensArrived("".join(pending)))
                    pending, last = [], time.monotonic()
        except TandemError as e:
            self.post_message(AnswerFailed(str(e)))
        if pending:
            self.post_message(TokensArrived("".join(pending)))
        self.post_message(AnswerDone(stopped))

    def on_tokens_arrived(self, message: TokensArrived) -> None:
        if self.answer is not None:
            self.answer.set_text(self.answer.text + message.text)
            self.query_one("#messages", VerticalScroll).scroll_end(animate=False)
            self.update_status("answering… (Esc stops)")

    def on_context_trimmed(self, message: ContextTrimmed) -> None:
        self.context_note = f"{message.dropped} earliest messages left out to fit the context"
        self.notify(f"this conversation is longer than the model's context: its {message.dropped} earliest "
                    "messages were left out of the prompt (Ctrl+N starts a new one)", severity="warning")
        self.update_status("answering… (Esc stops)")

    def on_answer_failed(self, message: AnswerFailed) -> None:
        self.notify(message.error, title="The answer failed", severity="error", timeout=30)

    def on_answer_done(self, message: AnswerDone) -> None:
        self.lifecycle.answer_finished()
        if self.answer is not None:
            if self.answer.text:
                self.current.turns.append(Turn("assistant", self.answer.text))
            else:  # failed or stopped before a word: no empty answer (the question stays, to retry or edit)
                self.answer.remove()
            self.answer = None
        self.save(self.current)
        self.update_status("stopped" if message.stopped else "")
        self.update_experts()

    def action_stop(self) -> None:
        """Escape: stops an answer; otherwise closes the dialog on top (this binding has priority over theirs)."""
        if self.lifecycle.generating:
            for worker in self.workers:
                if worker.group == "generate":
                    worker.cancel()
        elif isinstance(self.screen, ModalScreen):
            self.screen.dismiss(False if isinstance(self.screen, WizardScreen) else None)

    def action_retry(self) -> None:
        """Ask the last question again (the previous answer is replaced)."""
        if not self.current.turns or not self.ready_to_answer():
            return
        if self.current.turns[-1].role == "assistant":
            self.current.turns.pop()
            answers = self.query(ChatMessage).filter(".assistant")
            if answers:
                answers.last().remove()
        self.start_answer()

    def action_edit_last(self) -> None:
        """Take the last question (and its answer) back into the composer to edit and send again."""
        if self.lifecycle.generating or not self.current.turns:
            return
        while self.current.turns and self.current.turns[-1].role == "assistant":
            self.current.turns.pop()
        if not self.current.turns:
            return
        question = self.current.turns.pop()
        messages = list(self.query(ChatMessage))
        for widget in messages[len(self.current.turns):]:
            widget.remove()
        composer = self.query_one(Composer)
        composer.text = question.content
        composer.focus()
        self.save(self.current)

    # -- settings, help, command palette --------------------------------------------------------
    def action_settings(self) -> None:
        def apply(new: Settings | None) -> None:
            self.query_one(Composer).focus()
            if new is not None:
                self.settings, self.params = new, new.params()
                try:
                    save_settings(new)
                except (OSError, TandemError) as e:  # TandemError: a folder that cannot be created
                    self.notify(f"the settings apply now but could not be saved ({e})", title="Not saved",
                                severity="error", timeout=20)
                    return
                self.notify("settings saved")

        self.push_screen(SettingsScreen(self.settings), apply)

    def action_help(self) -> None:
        keys = [(b.key.replace("_", " ").replace(",", ", "), b.description) for b in self.BINDINGS]
        self.push_screen(HelpScreen(self.COMPOSER_KEYS + keys + [("Ctrl+P", "command palette"),
                                                                 ("Ctrl+Q", "quit")]))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for b in self.BINDINGS:
            action = b.action
            yield SystemCommand(b.description, f"{b.key}", lambda a=action: self.run_action(a))

    # -- panels and status ----------------------------------------------------------------------
    def action_toggle_experts(self) -> None:
        panel = self.query_one(ExpertHeatmap)
        panel.toggle_class("visible")
        self.update_experts()

    def update_experts(self) -> None:
        panel = self.query_one(ExpertHeatmap)
        backend = self.lifecycle.backend
        if backend is not None and panel.has_class("visible"):
            panel.show(backend.activity(), width=max(8, panel.size.width - 6), where=backend.where())

    def update_status(self, state: str = "") -> None:
        b = self.lifecycle.backend
        if b is None:
            return
        state = " · ".join(filter(None, (state, self.context_note)))
        self.query_one(StatusBar).show(b.name, b.family, b.placement, b.usage(), state)
