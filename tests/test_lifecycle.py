"""The model lifecycle without Textual: loads, replacements (beside the current model, or after unloading it when
the two do not fit), the previous model restored after a failed load, busy states and retired models."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.app.chat.lifecycle import Failed, ModelLifecycle, Ready, Unloaded, load_in_turn
from tandem.kernels.errors import CheckpointError, ResourceError
from tests.fakes import FakeBackend


class Memory:
    """Loads fake models with room for `room` open at a time ("huge" never fits, "broken" is no model); logs every
    load attempt and every close, in order."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.models: list[Logged] = []
        self.events: list[tuple[str, str | None]] = []

    def load(self, path: str | None) -> Logged:
        self.events.append(("load", path))
        if path == "broken":
            raise CheckpointError(f"{path} is not a model folder")
        if path == "huge" or sum(not m.closed for m in self.models) >= self.room:
            raise ResourceError(f"not enough RAM for {path}")
        self.models.append(Logged(self, path))
        return self.models[-1]


class Logged(FakeBackend):
    def __init__(self, memory: Memory, path: str | None) -> None:
        super().__init__(path=path)
        self.memory = memory

    def close(self) -> None:
        super().close()
        self.memory.events.append(("close", self.path))


def run_load(lifecycle: ModelLifecycle, memory: Memory, path: str | None) -> list[Ready | Failed]:
    """One load as the app runs it, in one thread: the worker's steps, then the app handling each reply."""
    load = lifecycle.begin_load()
    outcomes: list[Ready | Failed] = []
    load_in_turn(memory.load, path, lambda: lifecycle.unload(load), outcomes.append, lifecycle.holds_accelerator())
    for outcome in outcomes:
        if isinstance(outcome, Ready):
            lifecycle.arrived(outcome, load)
        else:
            lifecycle.load_failed(load)
    return outcomes


def loaded(path: str | None = None) -> tuple[ModelLifecycle, FakeBackend]:
    lifecycle = ModelLifecycle()
    model = FakeBackend(path=path)
    assert lifecycle.arrived(Ready(model, path), lifecycle.begin_load())
    return lifecycle, model


# -- states -------------------------------------------------------------------------------------
def test_a_load_is_busy_until_its_model_arrives() -> None:
    lifecycle = ModelLifecycle()
    assert lifecycle.busy_reason() is None and lifecycle.answer_refusal() == "no model is loaded: Ctrl+O picks one"
    load = lifecycle.begin_load()
    assert load == 1 and lifecycle.loading and lifecycle.busy_reason() == "wait for the model"
    model = FakeBackend(path="a")
    assert lifecycle.arrived(Ready(model, "a"), load)
    assert lifecycle.backend is model and lifecycle.path == "a" and not lifecycle.loading
    assert lifecycle.busy_reason() is None and lifecycle.answer_refusal() is None


def test_what_runs_says_why_nothing_else_may_start() -> None:
    open_dialog = [False]
    lifecycle = ModelLifecycle(tuning_open=lambda: open_dialog[0])
    lifecycle.arrived(Ready(FakeBackend(), None), lifecycle.begin_load())
    open_dialog[0] = True
    assert lifecycle.tuning() and lifecycle.busy_reason() == "the model is being tuned; wait until that is done"
    open_dialog[0] = False
    lifecycle.tuning_active = True  # the dialog closed, its measurement still runs
    assert lifecycle.tuning() and lifecycle.answer_refusal() == "the model is being tuned; wait until that is done"
    lifecycle.begin_load()
    assert lifecycle.busy_reason() == "wait for the model"  # a load comes before tuning
    lifecycle.answer_started()
    assert lifecycle.busy_reason() == "an answer is still coming; Esc stops it"  # an answer before both


def test_a_measurement_marks_the_model_busy_while_it_runs_even_when_it_fails() -> None:
    lifecycle, _ = loaded()
    assert lifecycle.measure(lambda: lifecycle.tuning_active) is True
    assert not lifecycle.tuning_active

    def broken() -> None:
        assert lifecycle.tuning()
        raise RuntimeError("no GPU after all")

    with pytest.raises(RuntimeError):
        lifecycle.measure(broken)
    assert not lifecycle.tuning() and lifecycle.busy_reason() is None


# -- replacing and releasing --------------------------------------------------------------------
def test_a_replaced_model_is_closed_at_once_when_nothing_uses_it() -> None:
    lifecycle, first = loaded("first")
    second = FakeBackend(path="second")
    assert lifecycle.arrived(Ready(second, "second"), lifecycle.begin_load())
    assert lifecycle.backend is second and first.closed and not second.closed and lifecycle.retired == []


def test_a_model_replaced_while_answering_is_closed_after_the_answer() -> None:
    lifecycle, first = loaded("first")
    lifecycle.answer_started()
    lifecycle.arrived(Ready(FakeBackend(path="second"), "second"), lifecycle.begin_load())
    assert lifecycle.backend.path == "second" and not first.closed and lifecycle.retired == [first]
    lifecycle.answer_finished()
    assert first.closed and lifecycle.retired == [] and not lifecycle.generating


def test_a_model_replaced_while_tuning_is_closed_after_the_measurement() -> None:
    lifecycle, first = loaded("first")

    def measuring() -> None:
        lifecycle.arrived(Ready(FakeBackend(path="second"), "second"), lifecycle.begin_load())
        assert not first.closed  # the measurement still uses it

    lifecycle.measure(measuring)
    assert not first.closed  # released by the app's thread once told the measurement ended
    lifecycle.release_retired()
    assert first.closed and lifecycle.backend.path == "second"


def test_a_reply_of_a_load_since_replaced_is_dropped() -> None:
    lifecycle, first = loaded("first")
    slow, fast = lifecycle.begin_load(), lifecycle.begin_load()
    late = FakeBackend(path="slow")
    assert not lifecycle.arrived(Ready(late, "slow"), slow)
    assert late.closed and lifecycle.backend is first and lifecycle.loading  # the newer load still runs
    assert not lifecycle.load_failed(slow) and lifecycle.loading
    assert lifecycle.arrived(Ready(FakeBackend(path="fast"), "fast"), fast) and not lifecycle.loading


def test_a_failed_load_keeps_the_current_model() -> None:
    lifecycle, first = loaded("first")
    assert lifecycle.load_failed(lifecycle.begin_load())
    assert not lifecycle.loading and lifecycle.backend is first and not first.closed


def test_unloading_lets_the_model_go_with_its_folder() -> None:
    lifecycle, first = loaded("first")
    load = lifecycle.begin_load()
    assert lifecycle.unload(load) == Unloaded("fake-moe", "first")
    assert first.closed and lifecycle.backend is None and lifecycle.loading


@pytest.mark.parametrize("why", ["stale", "no model", "answering", "measuring", "tuning dialog open"])
def test_a_model_in_use_or_a_stale_load_unloads_nothing(why: str) -> None:
    lifecycle, first = loaded("first")
    lifecycle.tuning_open = lambda: why == "tuning dialog open"
    load = lifecycle.begin_load()
    if why == "stale":
        lifecycle.begin_load()
    elif why == "no model":
        lifecycle.unload(load)
    elif why == "answering":
        lifecycle.answer_started()
    elif why == "measuring":
        lifecycle.tuning_active = True
    assert lifecycle.unload(load) is None
    assert why == "no model" or (lifecycle.backend is first and not first.closed)


# -- loading in turn ----------------------------------------------------------------------------
def test_a_model_that_fits_beside_the_current_one_loads_beside_it() -> None:
    memory = Memory(room=2)
    lifecycle = ModelLifecycle()
    run_load(lifecycle, memory, None)
    first = lifecycle.backend
    assert run_load(lifecycle, memory, "second") == [Ready(memory.models[1], "second")]
    assert memory.events == [("load", None), ("load", "second"), ("close", None)]  # closed after, not before
    assert lifecycle.backend.path == "second" and first.closed and not lifecycle.loading


def test_a_model_that_does_not_fit_beside_the_current_one_replaces_it_after_unloading_it() -> None:
    memory = Memory(room=1)
    lifecycle = ModelLifecycle()
    run_load(lifecycle, memory, None)
    assert run_load(lifecycle, memory, "second") == [Ready(memory.models[1], "second")]
    # beside it (no room), the current one closed, then alone
    assert memory.events == [("load", None), ("load", "second"), ("close", None), ("load", "second")]
    assert lifecycle.backend.path == "second" and not lifecycle.backend.closed and not lifecycle.loading


def test_a_model_that_fits_not_even_alone_brings_the_previous_one_back() -> None:
    memory = Memory(room=1)
    lifecycle = ModelLifecycle()
    run_load(lifecycle, memory, "first")
    outcomes = run_load(lifecycle, memory, "huge")
    assert outcomes == [Ready(memory.models[1], "first", restored=True),
                        Failed("not enough RAM for huge; first is loaded again")]
    assert memory.events == [("load", "first"), ("load", "huge"), ("close", "first"), ("load", "huge"),
                             ("load", "first")]
    assert lifecycle.backend is memory.models[1] and lifecycle.path == "first" and not lifecycle.loading


def test_when_the_previous_model_cannot_come_back_either_the_error_says_so() -> None:
    attempts: list[str | None] = []

    def load_backend(path: str | None) -> FakeBackend:
        attempts.append(path)
        raise ResourceError("not enough RAM" if path == "huge" else "the disk is gone")

    outcomes: list[Ready | Failed] = []
    load_in_turn(load_backend, "huge", lambda: Unloaded("fake-moe", None), outcomes.append)
    assert attempts == ["huge", "huge", None]
    assert outcomes == [Failed("not enough RAM; the built-in model could not be loaded again either: "
                               "the disk is gone")]


def test_a_load_that_fails_for_another_reason_unloads_nothing() -> None:
    memory = Memory(room=1)
    lifecycle = ModelLifecycle()
    run_load(lifecycle, memory, None)
    assert run_load(lifecycle, memory, "broken") == [Failed("broken is not a model folder")]
    assert memory.events == [("load", None), ("load", "broken")] and not memory.models[0].closed


def test_no_room_is_made_while_the_current_model_answers() -> None:
    memory = Memory(room=1)
    lifecycle = ModelLifecycle()
    run_load(lifecycle, memory, None)
    lifecycle.answer_started()
    assert run_load(lifecycle, memory, "second") == [Failed("not enough RAM for second")]
    assert memory.events == [("load", None), ("load", "second")]
    assert lifecycle.backend is memory.models[0] and not lifecycle.loading


def test_the_lifecycle_imports_no_textual() -> None:
    code = ("import sys, tandem.app.chat.lifecycle\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'textual'], 'textual imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_model_on_the_accelerator_goes_before_the_next_load_measures_its_memory() -> None:
    """Room for two in RAM, but the current model holds accelerator memory: a load beside it would find the
    device's memory taken (its budget is what is free then), so the current one is let go first."""
    memory = Memory(room=2)
    lifecycle = ModelLifecycle()
    run_load(lifecycle, memory, "first")
    memory.models[0].on_gpu = (1 << 30, 2 << 30)
    assert lifecycle.holds_accelerator()
    outcomes = run_load(lifecycle, memory, "second")
    assert outcomes == [Ready(memory.models[1], "second")]
    assert memory.events == [("load", "first"), ("close", "first"), ("load", "second")]


def test_a_model_let_go_first_comes_back_when_the_new_one_fails() -> None:
    memory = Memory(room=2)
    lifecycle = ModelLifecycle()
    run_load(lifecycle, memory, "first")
    memory.models[0].on_gpu = (1 << 30, 2 << 30)
    outcomes = run_load(lifecycle, memory, "broken")
    assert outcomes == [Ready(memory.models[1], "first", restored=True),
                        Failed("broken is not a model folder; first is loaded again")]
    assert memory.events == [("load", "first"), ("close", "first"), ("load", "broken"), ("load", "first")]
