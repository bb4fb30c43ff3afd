"""The loaded model's lifecycle in the chat app: which model is current, what runs on it, and what may start.

Plain Python, no Textual: the app calls `ModelLifecycle` from its message handlers (all on the app's thread) and
runs `load_in_turn` in its load worker; tests drive both directly. It is not the loader (`load_backend` is) and
it does not show anything (the app says what it answers).

States: loading (a load is under way), generating (an answer streams), tuning (the tuning dialog is open or its
measurement runs). While any of them runs, no answer, model pick or tuning run may start. A load that was already
under way may still finish meanwhile: its model becomes the current one, and the model it replaces is closed once
no answer or tuning run uses it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tandem.app.chat.backend import ChatBackend
from tandem.kernels.errors import ResourceError, TandemError
from tandem.runtime.accelerator import release_device_memory

T = TypeVar("T")


@dataclass(frozen=True)
class Ready:
    """A load's model, loaded."""

    backend: ChatBackend
    path: str | None  # its folder (None: the built-in model)
    restored: bool = False  # the previous model, loaded again after the new one failed


@dataclass(frozen=True)
class Failed:
    error: str


@dataclass(frozen=True)
class Unloaded:
    """The model let go to make room for another."""

    name: str
    path: str | None  # its folder (None: the built-in model), to load it again should the other one fail


def load_in_turn(load_backend: Callable[[str | None], ChatBackend], path: str | None,
                 make_room: Callable[[], Unloaded | None], report: Callable[[Ready | Failed], None],
                 release_first: bool = False) -> None:
    """Load `path` while the current model stays. Should the two not fit in memory side by side (ResourceError), let
    the current one go (`make_room`; None when it may not) and try once more; should that fail too, load the one
    let go again. `release_first`: the current model holds accelerator memory, whose free share the new load would
    measure, so it goes before the first try. Runs in a worker thread; `report` gets a Ready or a Failed, or (after
    a restore) both."""
    previous = make_room() if release_first else None
    if previous is not None:
        _load_or_restore(load_backend, path, previous, report)
        return
    too_big = ""
    try:
        backend = load_backend(path)
    except ResourceError as e:
        too_big = str(e)  # retried below, outside this handler (its traceback would keep the partial load)
    except TandemError as e:
        report(Failed(str(e)))
        return
    if not too_big:
        report(Ready(backend, path))
        return
    previous = make_room()
    if previous is None:
        report(Failed(too_big))
        return
    _load_or_restore(load_backend, path, previous, report)


def _load_or_restore(load_backend: Callable[[str | None], ChatBackend], path: str | None, previous: Unloaded,
                     report: Callable[[Ready | Failed], None]) -> None:
    """Load `path` now that `previous` has been let go; should that fail, load `previous` again."""
    try:
        report(Ready(load_backend(path), path))
        return
    except TandemError as e:
        error = str(e)
    name = previous.path or "the built-in model"
    try:  # back to the model that was let go for it
        report(Ready(load_backend(previous.path), previous.path, restored=True))
        error += f"; {name} is loaded again"
    except TandemError as e:
        error += f"; {name} could not be loaded again either: {e}"
    report(Failed(error))


class ModelLifecycle:
    """The current model, the loads under way, and whether an answer or a tuning run uses the model."""

    def __init__(self, tuning_open: Callable[[], bool] = lambda: False) -> None:
        """`tuning_open()`: whether the tuning dialog is open (a measurement may start from it at any time)."""
        self.backend: ChatBackend | None = None
        self.path: str | None = None  # the current model's folder (None: the built-in model)
        self.loading = False
        self.loads = 0  # loads begun so far: each load's number, and replies of a load since replaced are stale
        self.retired: list[ChatBackend] = []  # replaced while answering or tuning: closed when that is done
        self.generating = False
        self.tuning_active = False  # a measurement on the current model runs (set in the tuning worker's thread)
        self.tuning_open = tuning_open

    # -- what runs ------------------------------------------------------------------------------
    def tuning(self) -> bool:
        """The tuning dialog is open, or its measurement still runs (it goes on after the dialog is closed)."""
        return self.tuning_active or self.tuning_open()

    def busy_reason(self) -> str | None:
        """Why nothing else may start now (an answer, a load or a tuning run is under way); None: nothing runs."""
        if self.generating:
            return "an answer is still coming; Esc stops it"
        if self.loading:
            return "wait for the model"
        if self.tuning():
            return "the model is being tuned; wait until that is done"
        return None

    def answer_refusal(self) -> str | None:
        """Why an answer cannot start now; None: it can."""
        if reason := self.busy_reason():
            return reason
        return None if self.backend is not None else "no model is loaded: Ctrl+O picks one"

    # -- loading --------------------------------------------------------------------------------
    def begin_load(self) -> int:
        """A load starts: its number."""
        self.loading = True
        self.loads += 1
        return self.loads

    def unload(self, load: int) -> Unloaded | None:
        """Let the current model go, memory included, to make room for load number `load`. None when there is none,
        it is in use (answering, being tuned) or `load` has been replaced by a newer load."""
        if load != self.loads or self.backend is None or self.generating or self.tuning():
            return None
        old, self.backend = self.backend, None
        unloaded = Unloaded(old.name, self.path)
        old.close()
        del old
        gc.collect()  # the model's own reference cycles: its memory goes back now, before the retry measures RAM
        release_device_memory()  # and the accelerator's, before the next load measures what is free there
        return unloaded

    def holds_accelerator(self) -> bool:
        """Whether the current model keeps weights in accelerator memory."""
        return self.backend is not None and self.backend.vram() is not None

    def arrived(self, ready: Ready, load: int) -> bool:
        """Load number `load` brought `ready`: it becomes the current model (True), unless a newer load has begun
        since, in which case it is closed (False). The model it replaces is closed once nothing uses it."""
        if load != self.loads:
            ready.backend.close()
            return False
        self.loading = False
        old, self.backend, self.path = self.backend, ready.backend, ready.path
        if old is not None:  # released now rather than whenever it is collected (accelerator memory, RAM copies)
            self.retired.append(old)
            self.release_retired()
        return True

    def load_failed(self, load: int) -> bool:
        """Load number `load` failed: whether that is news (False: a newer load has begun since)."""
        if load != self.loads:
            return False
        self.loading = False
        return True

    # -- using the model ------------------------------------------------------------------------
    def answer_started(self) -> None:
        self.generating = True

    def answer_finished(self) -> None:
        self.generating = False
        self.release_retired()

    def measure(self, run: Callable[[], T]) -> T:
        """In the tuning worker's thread: `run()`, the model marked busy meanwhile. Once it returns, the app's
        thread calls `release_retired`."""
        self.tuning_active = True
        try:
            return run()
        finally:
            self.tuning_active = False

    def release_retired(self) -> None:
        """Close the models replaced while in use, once nothing uses them."""
        if not (self.generating or self.tuning_active):
            for old in self.retired:
                old.close()
            self.retired.clear()
