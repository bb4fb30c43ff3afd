"""Where results go: standard output guarded against closed pipes and full disks, and output paths checked
before the work that fills them (a long run must not end in "cannot write" with its results lost)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from tandem.kernels.errors import OutputError

EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for `cat`, `yes` etc. when the reader goes away


class PipeClosed(Exception):
    """The reader of standard output went away (`tandem generate ... | head -c1`): not an error, stop quietly."""


class _GuardedStream:
    """Standard output whose write failures become `PipeClosed` or `OutputError` instead of a traceback."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def _guard(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except BrokenPipeError:
            raise PipeClosed from None
        except OSError as e:
            raise OutputError(f"could not write the output: {e.strerror or e}") from None

    def write(self, text: str) -> int:
        return self._guard(self._stream.write, text)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class guarded_stdout:
    """Within: writes to `sys.stdout` raise `PipeClosed`/`OutputError`. On a clean exit everything is flushed
    here, where a failure is still reported (Python's own flush at exit could only print "Exception ignored")."""

    def __enter__(self) -> None:
        if sys.stdout is None:  # started with standard output closed (`tandem ... >&-`): nowhere for results
            raise OutputError("standard output is closed; redirect it to a file or to /dev/null instead")
        self._original = sys.stdout
        sys.stdout = _GuardedStream(self._original)  # type: ignore[assignment]

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if kind is None:
                sys.stdout.flush()
            else:  # the error already on its way is the one to report
                try:
                    sys.stdout.flush()
                except (PipeClosed, OutputError):
                    pass
        finally:
            sys.stdout = self._original


def silence_stdout() -> None:
    """Point standard output at /dev/null, so the flush at interpreter exit finds no closed pipe to complain
    about (a stream without a file descriptor, as under test capture, is left alone)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _writable_folder(folder: Path, flag: str, path: str) -> None:
    """A real write test (permissions alone say nothing for root, read-only mounts or full quotas)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot write in {folder} ({e.strerror or e}); choose another place"
                          ) from None


def check_output_file(path: str, flag: str) -> None:
    """Refuse, before any work, a file that could not be written at the end: a folder in its place, a missing
    or unwritable folder to hold it, or an existing file that cannot be overwritten."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise OutputError(f"{flag} {path}: that is a folder; give a file name (e.g. {target / 'out'})")
    if not folder.exists():
        raise OutputError(f"{flag} {path}: the folder {folder} does not exist; create it first")
    if not folder.is_dir():
        raise OutputError(f"{flag} {path}: {folder} is not a folder")
    if target.exists() and not os.access(target, os.W_OK):
        raise OutputError(f"{flag} {path}: the file exists and cannot be overwritten (permission denied)")
    _writable_folder(folder, flag, path)


def check_output_folder(path: str, flag: str) -> None:
    """Refuse, before any work, a folder to create that exists already or whose parent cannot take it (missing
    parents are created, as the writers do)."""
    target = Path(path)
    if target.exists() or target.is_symlink():
        raise OutputError(f"{flag} {path} already exists; choose a new folder")
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{flag} {path}: {ancestor} is not a folder")
    _writable_folder(ancestor, flag, path)


@contextmanager
def writing(path: str, flag: str) -> Iterator[None]:
    """A file output that fails while written (a full disk, a quota) is an error naming the flag: the folder was
    checked before the work, but only the write itself can find the space missing."""
    try:
        yield
    except OSError as e:
        raise OutputError(f"{flag} {path}: could not write it ({e.strerror or e}); free some space or choose "
                          "another place") from None
