"""First-run auto-tune wizard: explains, measures in a worker with a progress bar per step, shows the plan,
and saves it only if asked."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, Label, ProgressBar, Static

from tandem.autotune.microbench import Step
from tandem.autotune.plan import PlanResult
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
        self.query_one("#step", Static).update(describe_plan(message.tuned.result))
        self.query_one(ProgressBar).update(progress=self.query_one(ProgressBar).total)
        self.query_one("#save", Button).disabled = False


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# the kernel variants by the CPU feature each needs, as a user knows them (kernels/names.py: ISAS)
ISA_NAMES = {"base": "portable", "avx2": "AVX2", "avx512": "AVX-512", "avx512bf16": "AVX-512 BF16", "amx": "AMX"}
STRATEGY_WORDS = {"fiddler": "runs each missing expert where it is predicted to finish first",
                  "cpu": "runs missing experts on the CPU", "fetch": "copies missing experts to the GPU"}


def kernel_words(isa: str | None, crossover: int | None) -> str:
    """What the kernel choice means. `crossover` is the most tokens one expert may get at once for the compiled
    kernel to beat torch (None or 0: not measured, the built-in limit applies, never "up to 0 tokens"); decoding
    gives an expert one token at a time, reading a prompt many."""
    variant = f"its {ISA_NAMES.get(isa, isa)} version" if isa else "the version this CPU runs best"
    batch = f"up to {plural(crossover, 'token')}" if crossover else "a few tokens (the built-in limit)"
    return (f"Expert maths: Tandem's C kernel ({variant}) when an expert gets {batch} at once, as when writing "
            "an answer; PyTorch for more, as when reading a long prompt")


def describe_plan(result: PlanResult) -> str:
    """The plan in words, one line each: CPU threads, kernel, GPU use, predicted speed."""
    p = result.plan
    lines = [f"{plural(p.threads, 'CPU thread')} for the experts that run on the CPU", kernel_words(p.kernel_isa,
                                                                                                    p.crossover)]
    if p.accelerator:
        cache = (f"a cache of {plural(p.cache_ways, 'expert')} in each of {plural(p.cache_indexes, 'layer')} "
                 f"({str(p.cache_policy).upper()})" if p.cache_ways else "no cache")
        lines.append(f"GPU: {plural(p.static_experts, 'expert')} kept on it, {cache}; "
                     f"{STRATEGY_WORDS.get(str(p.strategy), str(p.strategy))}")
    else:
        lines.append("No GPU: everything runs on the CPU")
    return "Plan:\n" + "\n".join(f"• {line}" for line in lines) + \
        f"\nPredicted decode: {result.predicted_tok_s:.1f} tokens/s"


def tuning_keys(raw_config: dict, dtype: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """This machine's fingerprint and the model's: what a profile, and a skip, are keyed by."""
    from tandem.autotune.probe import probe
    from tandem.autotune.profile import model_fingerprint

    return probe().fingerprint(), model_fingerprint(raw_config, dtype)
