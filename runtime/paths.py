"""Where Tandem keeps its files: the user's data and cache folders, or `$TANDEM_HOME` when set (tests).

Also the rules every saved file follows: written atomically (never half a file, even after a crash), a
file that cannot be used set aside under a name no other one has, and folders that several processes
write guarded by a lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from tandem.kernels.errors import StoreError, TandemError

T = TypeVar("T")
STALE_TEMP_S = 60.0  # a small file's save takes milliseconds: a temporary file this old was left by a killed one

try:  # a lock between processes; a platform without it saves unlocked (still atomically)
    import fcntl
except ImportError:  # pragma: no cover - not on Linux or macOS
    fcntl = None  # type: ignore[assignment]


def data_dir() -> Path:
    override = os.environ.get("TANDEM_HOME")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_data_dir("tandem", appauthor=False))


def cache_dir() -> Path:
    override = os.environ.get("TANDEM_HOME")
    if override:
        return Path(override) / "cache"
    import platformdirs

    return Path(platformdirs.user_cache_dir("tandem", appauthor=False))


def ensure_folder(folder: Path) -> Path:
    """Create `folder` (and its parents) for saving, or raise a `StoreError` saying how to fix what is in the way:
    TANDEM_HOME naming a file, a file where a folder belongs, no permission. Reading never needs this: a
    missing folder just holds nothing yet."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        home = os.environ.get("TANDEM_HOME")
        if home and Path(home).exists() and not Path(home).is_dir():
            raise StoreError(f"TANDEM_HOME {home} is a file; point it to a folder (or unset it to use the "
                             "default one)") from None
        raise StoreError(f"cannot create the folder {folder} ({e.strerror or e}); make room for it, fix its "
                         "permissions or set TANDEM_HOME to a folder you can write") from None
    return folder


def read_bounded(path: Path, most: int) -> bytes:
    """The bytes of `path` if it is a regular file of at most `most` bytes, else OSError saying why. Files named by
    a model folder or the command line are read whole, so only those: a FIFO would block forever, a device such as
    /dev/zero (or a link to it) never end, and a file that grows while read stops at the bound."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it (no race with a swapped file)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError("it is not a regular file")
        if info.st_size > most:
            raise OSError(f"it holds {info.st_size >> 20} MiB, more than the {most >> 20} MiB such a file may hold")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(most + 1)
    finally:
        os.close(fd)
    if len(data) > most:
        raise OSError(f"it holds more than the {most >> 20} MiB such a file may hold")
    return data


def temp_prefix(path: Path) -> str:
    """Temporary files of `path` are `.<stem>-<random>.json` beside it (hidden, so never taken for the file)."""
    return f".{path.stem}-"


def atomic_write_json(path: Path, data: Any) -> Path:
    """Write JSON atomically (see `atomic_write_text`)."""
    return atomic_write_text(path, json.dumps(data, indent=1))


def atomic_write_text(path: Path, text: str) -> Path:
    """Write `text` to a temporary file in the same folder, flush it to the disk, then rename it over `path`.

    The data reach the disk before the rename, so a crash or power cut leaves the old file or the new one,
    never an empty or half-written one; the folder is synced after so the rename itself is kept. The temporary
    file ends like `path` (`.json` for JSON), so `remove_stale_temporaries` finds a JSON save's leftovers."""
    return atomic_write_with(path, lambda f: f.write(text.encode("utf-8")))


def atomic_write_with(path: Path, fill: Callable[[BinaryIO], object]) -> Path:
    """`atomic_write_text` for any bytes: `fill` writes them to the temporary file (a large file, piece by piece)."""
    ensure_folder(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=path.suffix or ".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)
    return path


def _sync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable; a platform or file system that cannot sync folders is not an error."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_stale_temporaries(folder: Path, older_than_s: float = 0.0) -> list[Path]:
    """Delete the temporary files a killed writer left in `folder` (`.<stem>-<random>.json`, see `temp_prefix`).

    Call it while holding the folder's lock (then no live writer has one open), or with `older_than_s` large
    enough that no save in progress can be that old. Returns what was removed."""
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    now = time.time()
    for tmp in folder.glob(".*-*.json"):
        try:
            if tmp.is_file() and now - tmp.stat().st_mtime >= older_than_s:
                tmp.unlink()
                removed.append(tmp)
        except OSError:
            continue  # gone meanwhile, or not ours to delete: it is ignored when reading anyway
    return removed


def read_saved(path: Path, parse: Callable[[Any], T], default: T, what: str, fallback: str) -> tuple[T, str | None]:
    """A small saved JSON file (settings, choices) read with `parse`, which raises ValueError or a TandemError
    naming what is wrong; `default` when there is no file. A file that cannot be used is set aside and the notice
    says so: "the `what` could not be used (why); it was set aside as … and `fallback`". Never raises."""
    remove_stale_temporaries(path.parent, older_than_s=STALE_TEMP_S)
    if not path.exists():
        return default, None
    try:
        return parse(json.loads(path.read_text(encoding="utf-8"))), None
    except (OSError, ValueError, RecursionError, TandemError) as e:  # (json's and UTF-8's errors are ValueErrors)
        why = "it is nested too deeply" if isinstance(e, RecursionError) else str(e)
        try:
            aside = set_aside(path)
        except OSError as moved:
            return default, f"the {what} {path} could not be used ({why}) nor set aside ({moved}); {fallback}"
        return default, f"the {what} could not be used ({why}); it was set aside as {aside.name} and {fallback}"


def set_aside(path: Path, suffix: str = ".json.txt") -> Path:
    """Rename an unusable file to `<stem>.bad-<nanoseconds>[-n]<suffix>` beside it and return the new path.

    The name holds the time to the nanosecond plus a counter when needed, and `os.link` refuses to replace an
    existing file, so two files set aside in the same instant (or by two processes) never overwrite each other.
    Raises OSError when the file cannot be moved."""
    stamp = time.time_ns()
    for n in range(1000):
        aside = path.with_name(f"{path.stem}.bad-{stamp}{f'-{n}' if n else ''}{suffix}")
        try:
            os.link(path, aside)
        except FileExistsError:
            continue
        except OSError:  # no hard links here (some file systems): a checked rename instead
            if aside.exists():
                continue
            path.rename(aside)
            return aside
        path.unlink()
        return aside
    raise OSError(f"no free name to set {path.name} aside")


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on `folder` (its `.lock` file) between processes, waiting for it if needed.

    Writers that read, merge and write files in the folder hold it so none of them works on a stale copy.
    The lock goes with the process, so a crash never leaves it held."""
    ensure_folder(folder)
    if fcntl is None:
        yield
        return
    with open(folder / ".lock", "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
