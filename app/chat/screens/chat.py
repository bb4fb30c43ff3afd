"""The chat screen: the conversations (sidebar), the one shown, the composer, the streamed answer, retry, edit,
rename, delete, copy and export, the expert-activity panel, the loading bar and the status bar.

It keeps no model: the app around it loads models (`ModelLifecycle`) and holds the settings; the chat asks the
lifecycle whether an answer may start and tells it when one starts and ends. Nothing the user typed is lost: a
message sent while an answer streams or a model loads waits (shown as queued) and goes when the model is free; a
question is saved as soon as it is sent, and quitting mid-answer saves what came so far. Tokens reach the screen in
batches (at most every `REPAINT_S`); the view follows them only while the user is at the bottom. Escape stops an
answer and keeps what was produced. A save that fails (a full disk) is a notice: the conversation stays in memory
and the next save tries again. A conversation longer than the context goes to the model without its oldest turns,
and the status bar says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

import psutil
from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Input, Label, ListItem, ListView, ProgressBar, Static
from textual.worker import get_current_worker

from tandem.app.chat.context import answer_room, fit_messages
from tandem.app.chat.heatmap import ExpertHeatmap
from tandem.app.chat.lifecycle import ModelLifecycle
from tandem.app.chat.screens.export import ExportChoice, ExportScreen
from tandem.app.chat.screens.fork import ForkScreen
from tandem.app.chat.screens.rename import RenameScreen
from tandem.app.chat.settings import Settings
from tandem.app.chat.store import ChatModel, Conversation, ConversationStore, Turn
from tandem.app.chat.text import code_blocks, fit, human_bytes, title_from
from tandem.app.chat.widgets import ChatMessage, Composer, StatusBar
from tandem.kernels.errors import TandemError
from tandem.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from tandem.app.chat.backend import Usage
    from tandem.app.chat.tui import TandemApp

# Streamed text is painted at most about three times a second (the first piece at once): on two cores the app's
# painting takes the engine's core (10-12 % of one at 0.1 s, 7-8 % at 0.3 s, 3-5 % with none until the end); at
# 0.3 s the chat decoded at 0.93 and 0.97 of the bare stream, at 0.1 s at 0.75 and 0.79 (docs/bench/chat.md).
REPAINT_S = 0.3
COUNT_AFTER_S = 0.25  # the draft's tokens are counted once typing pauses this long, not on every key
NARROW = 100  # below this many columns the sidebar folds away by itself (Ctrl+B brings it back)
SIDEBAR_TEXT = 22  # characters of a title the sidebar shows (its width, less padding and border)


@dataclass
class ChatOpened(Message):
    """The chat is composed and its conversations shown: the app may start loading the model."""


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


@dataclass
class Queued:
    """A message sent while the model was busy: it goes, in its conversation, once the model is free."""

    conversation: Conversation
    text: str
    widget: ChatMessage


class Sidebar(ListView):
    """The conversations, newest use first; Delete deletes the highlighted one (asking first, as F8 does)."""

    BINDINGS = [Binding("delete", "screen.delete_conversation", "Delete chat", show=False)]


class ChatScreen(Screen[None]):
    # priority: they work while the composer has focus (its own keys would otherwise take them); none of them is a
    # key the composer edits with (Ctrl+D deletes a character there, Ctrl+E goes to the line's end)
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+n", "new_conversation", "New chat", priority=True),
        # works in every terminal, unlike Shift+Enter; the composer takes it first, so here it is for the footer
        Binding("ctrl+j", "new_line", "New line"),
        # in the help and the command palette, not the footer: it keeps the keys a newcomer needs, and fits in 80
        # columns with the app's Settings, Models and Help
        *(Binding(key, action, description, priority=True, show=False) for key, action, description in (
            ("ctrl+r", "retry", "Retry"),
            ("f3", "rename", "Rename chat"),
            ("f4", "edit_last", "Edit last"),
            ("ctrl+up", "edit_earlier", "Edit an earlier message"),
            ("alt+left", "previous_version", "Previous version"),
            ("alt+right", "next_version", "Next version"),
            ("f5", "toggle_experts", "Expert heatmap"),
            ("f8", "delete_conversation", "Delete chat"),
            ("f9", "copy_answer", "Copy answer"),
            ("ctrl+g", "copy_code", "Copy code"),
            ("ctrl+s", "export", "Export"),
            ("ctrl+b", "toggle_sidebar", "Show or hide the chat list"),
            ("ctrl+f", "find_chat", "Filter the chat list"),
        )),
    ]
    COMPOSER_KEYS = [("Enter", "send (while an answer streams, it waits and goes next)"),
                     ("Shift+Enter", "new line, in terminals with extended key reporting (kitty, WezTerm, foot, "
                                     "iTerm2 with CSI u); elsewhere it arrives as Enter and sends: Ctrl+J always "
                                     "works")]
    CONFIRM_S = 3.0

    def __init__(self, store: ConversationStore) -> None:
        super().__init__()
        self.store = store
        self.conversations: list[Conversation] = []
        self.current = Conversation()
        self.answer: ChatMessage | None = None
        self.answering: Conversation | None = None  # the conversation the streaming answer belongs to
        self.again: Turn | None = None  # the answer the streaming one is a new version of (Ctrl+R)
        self.queued: list[Queued] = []
        self.usage: dict[str, Usage] = {}  # each chat's last answer's numbers, by conversation id
        self.trimmed: dict[str, int] = {}  # messages each chat's last prompt left out (app/chat/context.py), by id
        self.context_note = ""  # what the status bar adds while the prompt leaves turns out
        self.state = ""  # what the status bar says first ("answering… (Esc stops)", "stopped")
        self._delete_armed = 0.0
        self._sidebar_wanted = True  # Ctrl+B's choice; a narrow window folds the sidebar regardless
        self._count_timer: Timer | None = None

    @property
    def shell(self) -> TandemApp:
        """The app around the chat: its model lifecycle and its settings."""
        return cast("TandemApp", self.app)

    @property
    def lifecycle(self) -> ModelLifecycle:
        return self.shell.lifecycle

    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            with Vertical(id="side"):
                yield Input(placeholder="find a chat (Ctrl+F)", id="filter")
                yield Sidebar(id="sidebar")
            with Vertical(id="chat"):
                yield VerticalScroll(id="messages")
                yield Composer(id="composer")
            yield ExpertHeatmap(id="experts")
        yield ProgressBar(id="loading", show_eta=False, show_percentage=False)
        yield StatusBar(id="status")
        yield Footer(compact=True)  # compact: the main keys and Help fit in 80 columns

    def on_mount(self) -> None:
        try:
            self.conversations, notices = self.store.load_all()
        except OSError as e:  # the folder cannot be read (or locked): start empty, say so
            self.conversations, notices = [], [f"the saved conversations could not be read ({e})"]
        for notice in notices:
            self.notify(notice, severity="warning", timeout=10)
        if self.conversations:
            self.current = self.conversations[0]
        else:
            self.conversations = [self.current]
        # the view follows new text while the user is at the bottom; scrolling up lets go until they are back
        self.query_one("#messages", VerticalScroll).anchor()
        self.refresh_sidebar()
        self.show_conversation()
        self.post_message(ChatOpened())

    def on_resize(self, event: events.Resize) -> None:
        self.query_one("#side").display = self._sidebar_wanted and event.size.width >= NARROW

    # -- conversations --------------------------------------------------------------------------
    def refresh_sidebar(self) -> None:
        """The conversations matching the filter, by last use, the current one marked."""
        sidebar = self.query_one("#sidebar", ListView)
        query = self.query_one("#filter", Input).value.strip()
        shown = [c for c in self.conversations if not query or c.matches(query)]
        sidebar.clear()
        for conv in shown:
            item = ListItem(Label(fit(conv.title, SIDEBAR_TEXT)), name=conv.id)
            item.set_class(conv is self.current, "active")
            sidebar.append(item)
        sidebar.index = shown.index(self.current) if self.current in shown else None

    def show_conversation(self) -> None:
        box = self.query_one("#messages", VerticalScroll)
        box.remove_children()
        widgets: list[Static | ChatMessage] = [message_widget(t) for t in self.current.turns]
        for q in self.queued:  # (a widget removed with the view it was in is not mounted again: a new one)
            if q.conversation is self.current:
                q.widget = queued_widget(q.text)
                widgets.append(q.widget)
        if not widgets:
            widgets.append(Static(self.welcome(), id="welcome"))
        box.mount_all(widgets)
        box.scroll_end(animate=False)
        self.update_status()

    def welcome(self) -> str:
        """An empty chat's text: the model, where it runs, the keys that matter."""
        b = self.lifecycle.backend
        model = f"{b.name} ({b.family}) · {b.placement}" if b is not None else "The model is loading…"
        return (f"{model}\n\nEnter sends · Ctrl+J starts a new line · Ctrl+O picks another model · "
                "F1 shows every key")

    def refresh_welcome(self) -> None:
        for welcome in self.query("#welcome").results(Static):
            welcome.update(self.welcome())

    @on(ListView.Selected, "#sidebar")
    def pick_conversation(self, event: ListView.Selected) -> None:
        chosen = next((c for c in self.conversations if c.id == event.item.name), None)
        if chosen is not None:
            self.open_conversation(chosen)

    def open_conversation(self, conv: Conversation) -> None:
        """Show `conv` (not while an answer streams: it would land in the other chat's view). A chat that another
        model answered brings that model back: each chat keeps its model."""
        if self.lifecycle.generating or conv is self.current:
            return
        self.current = conv
        self.refresh_sidebar()
        self.show_conversation()  # (its status counts this chat's context)
        wanted = conv.model
        if wanted is not None and wanted.path != self.lifecycle.path and self.lifecycle.busy_reason() is None \
                and self.shell.can_load(wanted.path):
            self.notify(f"this chat used {wanted.name}: loading it (Ctrl+O picks another)")
            self.shell.load_model(wanted.path)

    def chat_settings(self, conv: Conversation) -> Settings:
        """The chat's own settings; a chat saved before chats kept them uses the app's."""
        return conv.settings if conv.settings is not None else self.shell.settings

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

    def used(self, conv: Conversation) -> None:
        """`conv` was just used (a turn added, renamed): it goes to the top of the list."""
        conv.touch()
        if conv in self.conversations:
            self.conversations.remove(conv)
        self.conversations.insert(0, conv)
        self.refresh_sidebar()

    def action_new_conversation(self) -> None:
        """A new chat, unless one is empty already: that one is opened instead (no pile of empty chats)."""
        if self.lifecycle.generating:
            return
        empty = next((c for c in self.conversations if not c.turns), None)
        if empty is None:
            empty = Conversation()
            self.conversations.insert(0, empty)
        if empty is not self.current:
            self.current = empty
            self.refresh_sidebar()
            self.show_conversation()
        self.focus_composer()

    def action_delete_conversation(self) -> None:
        """Deletes only when pressed twice within a few seconds: the first press asks for confirmation."""
        if self.lifecycle.generating:
            return
        if time.monotonic() - self._delete_armed > self.CONFIRM_S:
            self._delete_armed = time.monotonic()
            self.notify(f"press F8 again to delete “{self.current.title}”", severity="warning")
            return
        self._delete_armed = 0.0
        try:
            self.store.delete(self.current)
        except (OSError, TandemError) as e:
            self.notify(f"the conversation could not be deleted ({e})", severity="error", timeout=20)
            return
        self.conversations.remove(self.current)
        self.queued = [q for q in self.queued if q.conversation is not self.current]
        if not self.conversations:
            self.conversations = [Conversation()]
        self.current = self.conversations[0]
        self.refresh_sidebar()
        self.show_conversation()
        self.notify("conversation deleted")

    def action_rename(self) -> None:
        conv = self.current  # the one renamed, whatever is current when the dialog closes

        def apply(title: str | None) -> None:
            self.focus_composer()
            if title:
                conv.title = title
                self.used(conv)
                self.save(conv)

        self.app.push_screen(RenameScreen(conv.title), apply)

    def action_export(self) -> None:
        """Ctrl+S: the export dialog (a path, Markdown or JSON, with the chat's model, dates and settings)."""
        conv = self.current
        try:
            defaults = {fmt: self.store.default_export(conv, fmt) for fmt in ("md", "json")}
        except TandemError as e:
            self.notify(str(e), title="Not exported", severity="error", timeout=20)
            return

        def export(choice: ExportChoice | None) -> None:
            self.focus_composer()
            if choice is None:
                return
            try:
                path = self.store.export(conv, choice.path, choice.fmt)
            except (OSError, TandemError) as e:
                self.notify(f"the conversation could not be exported ({e})", title="Not exported",
                            severity="error", timeout=20)
                return
            self.notify(f"exported to {path}")

        self.app.push_screen(ExportScreen(defaults), export)

    def action_toggle_sidebar(self) -> None:
        side = self.query_one("#side")
        self._sidebar_wanted = not side.display
        side.display = self._sidebar_wanted

    def action_find_chat(self) -> None:
        side = self.query_one("#side")
        side.display = True
        self.query_one("#filter", Input).focus()

    @on(Input.Changed, "#filter")
    def filter_chats(self) -> None:
        self.refresh_sidebar()

    @on(Input.Submitted, "#filter")
    def open_first_match(self) -> None:
        sidebar = self.query_one("#sidebar", ListView)
        if sidebar.children:
            first = next(c for c in self.conversations if c.id == sidebar.children[0].name)
            self.open_conversation(first)
            self.focus_composer()

    # -- asking and answering -------------------------------------------------------------------
    @on(Composer.Submitted)
    def ask(self, event: Composer.Submitted) -> None:
        """Send the message now if the model is free; else it waits, shown as queued, and goes once the answer
        ends or the model is ready. With no model coming, the text goes back to the composer."""
        if self.lifecycle.answer_refusal() is None and not self.queued:
            self.send(self.current, event.text)
            return
        if self.lifecycle.backend is None and not self.lifecycle.loading:
            self.query_one(Composer).text = event.text
            self.notify(self.lifecycle.answer_refusal() or "no model is loaded: Ctrl+O picks one")
            return
        widget = queued_widget(event.text)
        self.queued.append(Queued(self.current, event.text, widget))
        self.query("#welcome").remove()
        self.query_one("#messages", VerticalScroll).mount(widget)
        self.send_queued()  # (the model may be free already: the earlier queued messages go first)

    def send_queued(self) -> None:
        """Send the oldest queued message, if the model is free (in its own conversation, shown)."""
        if not self.queued or self.lifecycle.answer_refusal() is not None:
            return
        first = self.queued.pop(0)
        first.widget.remove()
        if first.conversation is not self.current:
            self.current = first.conversation
            self.refresh_sidebar()
            self.show_conversation()
        self.send(first.conversation, first.text)

    def unqueue(self) -> None:
        """The queued messages go back to the composer (Escape, a model that failed): nothing sends by surprise."""
        if not self.queued:
            return
        composer = self.query_one(Composer)
        texts = [q.text for q in self.queued]
        for q in self.queued:
            q.widget.remove()
        self.queued.clear()
        composer.text = "\n\n".join(filter(None, [composer.text.strip(), *texts]))
        self.notify("the messages that were waiting are back in the composer")

    def send(self, conv: Conversation, text: str) -> None:
        """`text` joins `conv` as the user's message and its answer starts; a message that cannot fit the context
        even alone goes back to the composer, saying so (kept in the chat, it would be resent with every later
        message, and each of those would fail the same way)."""
        problem = self.too_long(conv, text)
        if problem is not None:
            composer = self.query_one(Composer)  # (after what is being typed there: nothing is lost)
            composer.text = "\n\n".join(filter(None, [composer.text.strip(), text]))
            self.notify(problem, title="Not sent", severity="error", timeout=20)
            self.send_queued()  # (the messages waiting behind it go on)
            return
        if not conv.turns:
            conv.title = title_from(text)
        if conv.settings is None:  # the chat keeps the settings it started with (F2 changes them for it)
            conv.settings = replace(self.shell.settings)
        conv.turns.append(Turn("user", text))
        self.query("#welcome").remove()
        self.query_one("#messages", VerticalScroll).mount(ChatMessage("user", text))
        self.used(conv)
        self.save(conv)  # the question is kept even if the app dies before the answer ends
        self.start_answer()

    def too_long(self, conv: Conversation, text: str) -> str | None:
        """Why `text` cannot be sent in `conv` (with its system prompt, and room kept for the answer, it is over the
        context), or None."""
        backend = self.lifecycle.backend
        if backend is None or not backend.context:
            return None
        settings = self.chat_settings(conv)
        messages = conv.messages(settings.system_prompt)
        head = messages[: next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))]
        tokens = backend.prompt_tokens([*head, {"role": "user", "content": text}])
        room = answer_room(backend.context, settings.params().max_new_tokens)
        if tokens + room <= backend.context:
            return None
        return (f"this message takes {tokens} tokens and the context holds {backend.context}, {room} of them kept "
                "for the answer: shorten or split it, or load the model with a larger context (--context, or F2 "
                "for a shorter answer)")

    def start_answer(self, again: Turn | None = None) -> None:
        """Answer the chat's last question; `again`: the last answer, to which this one is added as a version."""
        conv = self.current
        backend = self.lifecycle.backend
        assert backend is not None
        settings = self.chat_settings(conv)
        messages = conv.messages(settings.system_prompt)
        if again is not None:
            messages.pop()  # the answer being done again
        conv.model = ChatModel(self.lifecycle.path, backend.name)
        box = self.query_one("#messages", VerticalScroll)
        self.answer = ChatMessage("assistant", "", note=backend.name)
        self.answering, self.again = conv, again
        box.mount(self.answer)
        box.scroll_end(animate=False)
        self.lifecycle.answer_started()
        self.context_note = ""
        self.update_status("answering… (Esc stops)")
        self.generate(messages, settings.params(), conv.id)

    def answer_text(self) -> str | None:
        """The answer streaming now, as far as it came; None when none streams."""
        return self.answer.text if self.answer is not None else None

    @work(thread=True, exclusive=True, group="generate")
    def generate(self, messages: list[dict[str, str]], params: SamplingParams, conv_id: str = "") -> None:
        worker = get_current_worker()
        backend = self.lifecycle.backend
        assert backend is not None
        pending, last = [], 0.0  # (the first piece is shown at once: it says the answer has begun)
        stopped = False
        try:
            if backend.context:  # (a server that does not say its context says when a prompt is too long)
                limit = backend.context - answer_room(backend.context, params.max_new_tokens)
                # (where the last prompt of this chat began, while it fits: the KV cache holds that prompt)
                messages, dropped = fit_messages(messages, backend.prompt_tokens, limit, self.trimmed.get(conv_id, 0))
                self.trimmed[conv_id] = dropped
                if dropped:
                    self.post_message(ContextTrimmed(dropped))
            for piece in backend.stream(messages, params):
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

    async def on_tokens_arrived(self, message: TokensArrived) -> None:
        # Awaited, so this screen handles AnswerDone only once every piece before it is on screen.
        if self.answer is not None:  # the view follows by its anchor, only while the user is at the bottom
            await self.answer.append_text(message.text)
            self.update_experts(live=True)

    def on_context_trimmed(self, message: ContextTrimmed) -> None:
        self.context_note = f"{message.dropped} earliest messages left out to fit the context"
        self.notify(f"this conversation is longer than the model's context: its {message.dropped} earliest "
                    "messages were left out of the prompt (Ctrl+N starts a new one)", severity="warning")
        self.update_status("answering… (Esc stops)")

    def on_answer_failed(self, message: AnswerFailed) -> None:
        self.notify(message.error, title="The answer failed", severity="error", timeout=30)

    async def on_answer_done(self, message: AnswerDone) -> None:
        if self.answer is not None and self.answer.text:  # (before the answer counts as done: nothing new starts)
            await self.answer.finish()
        self.lifecycle.answer_finished()
        conv = self.answering
        if self.answer is not None and conv is not None:  # (None: kept already, the app is quitting)
            self.keep_answer(conv, self.answer)
            self.save(conv)
        self.answer = self.answering = self.again = None
        self.update_status("stopped" if message.stopped else "")
        self.update_experts()
        self.send_queued()

    def keep_answer(self, conv: Conversation, answer: ChatMessage) -> None:
        """The answer as far as it came joins the conversation, with the model that wrote it (done again: as a new
        version of the last answer). One without a word is never kept (the question, or the earlier answer,
        stays)."""
        again = self.again
        if not answer.text:
            answer.remove()
            if again is not None and conv is self.current:
                self.show_conversation()  # the earlier version comes back
            return
        backend = self.lifecycle.backend
        name = backend.name if backend is not None else answer.note
        if again is not None and again in conv.turns:
            again.add_version(answer.text, name)
            answer.set_note(answer_note(again))
        else:
            conv.turns.append(Turn("assistant", answer.text, model=name))
        if backend is not None:
            self.usage[conv.id] = backend.usage()

    def keep_unfinished(self) -> None:
        """The app is closing: the answer streaming now (as far as it came) and the messages still waiting are
        saved, so quitting loses nothing."""
        touched: list[Conversation] = []
        if self.answer is not None and self.answering is not None:
            for worker in self.workers:
                if worker.group == "generate":
                    worker.cancel()
            self.keep_answer(self.answering, self.answer)
            touched.append(self.answering)
            self.answer = None
        for q in self.queued:
            q.conversation.turns.append(Turn("user", q.text))
            touched.append(q.conversation)
        self.queued.clear()
        for conv in {id(c): c for c in touched}.values():  # (dataclasses with fields: not hashable)
            self.save(conv)

    def action_stop(self) -> None:
        """Escape: stops the answer (what was produced is kept) and gives the waiting messages back to the
        composer; in the chat filter, clears it."""
        if self.focused is self.query_one("#filter", Input):
            self.query_one("#filter", Input).value = ""
            self.focus_composer()
            return
        if self.lifecycle.generating:
            for worker in self.workers:
                if worker.group == "generate":
                    worker.cancel()
        self.unqueue()

    def action_retry(self) -> None:
        """Answer the last question again: the new answer is a version beside the earlier ones (‹2/2›; Alt+Left
        and Alt+Right go through them)."""
        if not self.current.turns or not self.ready_to_answer():
            return
        last = self.current.turns[-1]
        if last.role == "assistant":
            answers = [m for m in self.query(ChatMessage) if m.role == "assistant" and not m.has_class("queued")]
            if answers:
                answers[-1].remove()
            self.start_answer(again=last)
        else:
            self.start_answer()

    def action_previous_version(self) -> None:
        self.show_version(-1)

    def action_next_version(self) -> None:
        self.show_version(+1)

    def show_version(self, step: int) -> None:
        """Show the last answer's previous or next version (the one shown is what the next prompt holds)."""
        if self.lifecycle.generating or not self.current.turns or self.current.turns[-1].role != "assistant":
            return
        last = self.current.turns[-1]
        k = last.shown + step
        if not 0 <= k < last.version_count:
            self.notify(f"this answer has {last.version_count} version{'s' if last.version_count > 1 else ''}; "
                        "Ctrl+R writes another")
            return
        last.show_version(k)
        self.save(self.current)
        self.show_conversation()

    def action_edit_earlier(self) -> None:
        """Ctrl+Up: choose a question to edit; a new chat forks there (this one is kept as it is)."""
        if self.lifecycle.generating:
            return
        conv = self.current
        questions = [(i, t.content) for i, t in enumerate(conv.turns) if t.role == "user"]
        if not questions:
            self.notify("this chat has no message to edit yet")
            return

        def fork(index: int | None) -> None:
            self.focus_composer()
            if index is None:
                return
            new = conv.fork(index, f"{conv.title} (edited)")
            self.conversations.insert(0, new)
            self.current = new
            self.refresh_sidebar()
            self.show_conversation()
            composer = self.query_one(Composer)
            composer.text = conv.turns[index].content
            composer.move_cursor(composer.document.end)
            if new.turns:  # kept even if the edit is never sent
                self.save(new)
            self.notify("a new chat starts here: edit the message and send it (the earlier chat is kept)")

        self.app.push_screen(ForkScreen(questions), fork)

    def ready_to_answer(self) -> bool:
        """Whether an answer can start now (nothing else under way, a model loaded); says why not."""
        reason = self.lifecycle.answer_refusal()
        if reason is not None:
            self.notify(reason)
        return reason is None

    def action_edit_last(self) -> None:
        """Take the last question (and its answer) back into the composer to edit and send again."""
        if self.lifecycle.generating or not self.current.turns:
            return
        while self.current.turns and self.current.turns[-1].role == "assistant":
            self.current.turns.pop()
        if not self.current.turns:
            return
        question = self.current.turns.pop()
        messages = [m for m in self.query(ChatMessage) if not m.has_class("queued")]
        for widget in messages[len(self.current.turns):]:
            widget.remove()
        composer = self.query_one(Composer)
        composer.text = question.content
        composer.focus()
        self.save(self.current)

    def action_new_line(self) -> None:
        composer = self.query_one(Composer)
        composer.focus()
        composer.insert("\n")

    def focus_composer(self) -> None:
        self.query_one(Composer).focus()

    # -- copying (through the terminal's clipboard, OSC 52: it works over SSH) --------------------------
    def last_answer(self) -> str:
        if self.answer is not None and self.answer.text:
            return self.answer.text
        return next((t.content for t in reversed(self.current.turns) if t.role == "assistant"), "")

    def action_copy_answer(self) -> None:
        text = self.last_answer()
        if not text:
            self.notify("there is no answer to copy yet")
            return
        self.app.copy_to_clipboard(text)
        self.notify(f"the last answer is copied ({len(text)} characters)")

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.last_answer())
        if not blocks:
            self.notify("the last answer has no code block")
            return
        self.app.copy_to_clipboard(blocks[-1])
        more = f" (the last of {len(blocks)})" if len(blocks) > 1 else ""
        self.notify(f"the code block is copied{more}")

    # -- the draft's tokens -------------------------------------------------------------------
    @on(Composer.Changed, "#composer")
    def draft_changed(self) -> None:
        if self._count_timer is not None:
            self._count_timer.stop()
        self._count_timer = self.set_timer(COUNT_AFTER_S, self.count_draft, name="count draft")

    def count_draft(self) -> None:
        self.update_status()  # (it counts the chat and its draft)

    def context_use(self) -> tuple[int, int] | None:
        """Tokens this chat's prompt would take with the draft sent now, and the context; None without a model."""
        backend = self.lifecycle.backend
        if backend is None:
            return None
        messages = self.current.messages(self.chat_settings(self.current).system_prompt)
        draft = self.query_one(Composer).text.strip()
        if draft:
            messages.append({"role": "user", "content": draft})
        if not self.current.turns and not draft:
            return 0, backend.context
        return backend.prompt_tokens(messages), backend.context

    # -- panels and status ----------------------------------------------------------------------
    def action_toggle_experts(self) -> None:
        panel = self.query_one(ExpertHeatmap)
        panel.toggle_class("visible")
        self.update_experts()

    def update_experts(self, live: bool = False) -> None:
        """`live`: while tokens stream (the panel then redraws at most twice a second)."""
        self.query_one(ExpertHeatmap).follow(self.lifecycle.backend, live)

    def update_status(self, state: str | None = None) -> None:
        """The status bar: `state` (kept until changed: None keeps it), with what the prompt left out, the model,
        this chat's last speed, its context use and the memory in use; nothing without a model."""
        if state is not None:
            self.state = state
        b = self.lifecycle.backend
        if b is None:
            return
        self.refresh_welcome()
        state = " · ".join(filter(None, (self.state, self.context_note)))
        bar = self.query_one(StatusBar)
        bar.show(f"{b.name} ({b.family})", b.placement, state, self.usage.get(self.current.id),
                 self.context_use(), self.memory())

    def memory(self) -> str:
        """RAM this process holds, and accelerator memory when the model has some."""
        ram = f"RAM {human_bytes(process_rss())}"
        backend = self.lifecycle.backend
        vram = backend.vram() if backend is not None else None
        return ram if vram is None else f"{ram} · VRAM {human_bytes(vram[0])}/{human_bytes(vram[1])}"

    def show_status(self, text: str) -> None:
        self.query_one(StatusBar).update(text)

    def show_loading(self, text: str, fraction: float | None = None) -> None:
        """The loading bar: indeterminate, or `fraction` done when the loader reports it."""
        bar = self.query_one("#loading", ProgressBar)
        bar.display = True
        bar.update(total=None if fraction is None else 100, progress=0 if fraction is None else 100 * fraction)
        self.show_status(text)

    def hide_loading(self) -> None:
        self.query_one("#loading", ProgressBar).display = False


def process_rss() -> int:
    """Bytes of RAM this process holds (resident)."""
    return psutil.Process().memory_info().rss


def answer_note(turn: Turn) -> str:
    """An answer's border: the model that wrote it and, with several versions, which one this is (‹2/3›)."""
    version = f"‹{turn.shown + 1}/{turn.version_count}›" if turn.version_count > 1 else ""
    return " · ".join(filter(None, (turn.model, version)))


def queued_widget(text: str) -> ChatMessage:
    return ChatMessage("user", text, note="queued: goes when the model is free", queued=True)


def message_widget(turn: Turn) -> ChatMessage:
    return ChatMessage(turn.role, turn.content, note=answer_note(turn) if turn.role == "assistant" else "")
