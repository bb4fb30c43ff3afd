"""First-run auto-tune wizard: explains, measures in a worker with a progress bar per step, shows the plan,
and saves it only if asked."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, Label, ProgressBar, Static

from tandem.autotune.microbench import Step
from tandem.autotune.profile import save_profile
from tandem.autotune.run import Tuned
from tandem.kernels.errors import TandemError

EXPLAIN = (
    "Tandem has not been tuned for this machine and model yet.\n\n"
    "The auto-tuner probes the CPU, memory and GPU, times the model's experts on this machine (about a "
    "minute), and picks thread counts, the kernel and — with a GPU — which experts stay on it. Nothing "
    "changes until you save the plan."
)


@dataclass
class TuneProgress(Message):
    step: Step


@dataclass
class TuneDone(Message):
    tuned: Tuned | None
    error: str = ""


class WizardScreen(ModalScreen[bool]):
    """Dismisses with True when a profile was saved; Escape skips, as Skip does (the measurement, once started,
    goes on without the dialog)."""

    BINDINGS = [Binding("escape", "dismiss(False)", "Skip")]

    def __init__(self, tune: Callable[[Callable[[Step], None]], Tuned]) -> None:
        super().__init__()
        self.tune = tune
        self.tuned: Tuned | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="wizard"):
            yield Label("Tune Tandem to this machine")
            yield Static(EXPLAIN, id="explain")
            yield ProgressBar(total=1, show_eta=False, id="progress")
            yield Static("", id="step")
            with Horizontal():
                yield Button("Tune now", variant="primary", id="start")
                yield Button("Save", variant="success", id="save", disabled=True)
                yield Button("Skip", id="skip")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "start":
            event.button.disabled = True
            self.run_tuning()
        elif event.button.id == "save" and self.tuned is not None:
            try:
                self.tuned.path = save_profile(self.tuned.profile)
            except (OSError, TandemError) as e:  # a full disk, or TANDEM_HOME naming a file: say so, stay open
                self.notify(f"the profile could not be saved ({e})", title="Not saved", severity="error",
                            timeout=20)
                return
            self.dismiss(True)
        elif event.button.id == "skip":
            self.dismiss(False)

    @work(thread=True, exclusive=True, group="tune")
    def run_tuning(self) -> None:
        try:
            tuned = self.tune(lambda step: self.post_message(TuneProgress(step)))
        except (TandemError, OSError, RuntimeError, ValueError) as e:  # a failed measurement must not end the chat
            self.post_message(TuneDone(None, f"{type(e).__name__}: {e}"))
            return
        self.post_message(TuneDone(tuned))

    def on_tune_progress(self, message: TuneProgress) -> None:
        bar = self.query_one(ProgressBar)
        bar.update(total=message.step.total, progress=message.step.done)
        self.query_one("#step", Static).update(message.step.name)

    def on_tune_done(self, message: TuneDone) -> None:
        if message.tuned is None:
            self.query_one("#step", Static).update(f"tuning failed: {message.error}")
            return
        self.tuned = message.tuned
        r = message.tuned.result
        p = r.plan
        cache = f"{p.cache_indexes} indexes × {p.cache_ways} ways ({p.cache_policy})" if p.cache_ways else "none"
        self.query_one("#step", Static).update(
            f"Plan: {p.threads} CPU threads · kernel {p.kernel_isa or 'torch'} up to {p.crossover or 0} tokens · "
            f"{'GPU ' + p.strategy if p.accelerator else 'CPU only'} · cache {cache} · {p.static_experts} GPU experts\n"
            f"Predicted decode: {r.predicted_tok_s:.1f} tokens/s"
        )
        self.query_one(ProgressBar).update(progress=self.query_one(ProgressBar).total)
        self.query_one("#save", Button).disabled = False


def needs_tuning(raw_config: dict, dtype: str) -> bool:
    """True when this machine has no profile for this model (or only one made on other hardware)."""
    from tandem.autotune.probe import probe
    from tandem.autotune.profile import find_profile, model_fingerprint

    return find_profile(probe().fingerprint(), model_fingerprint(raw_config, dtype)).profile is None
