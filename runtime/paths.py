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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from tandem.kernels.errors import OutputError, StoreError, TandemError

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


MAX_JSON_DEPTH = 64  # Tandem's own files nest a few levels; far deeper is a damaged or hostile file
SAVED_MAX_BYTES = 16 * 2**20  # a saved settings or choices file holds kilobytes; far more is not one of ours


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, in words, for a message."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a plain file"


def _check_regular(info: os.stat_result, most: int | None) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise OSError(f"it is not a regular file but {file_kind(info.st_mode)}")
    if most is not None and info.st_size > most:
        raise OSError(f"it holds {_size(info.st_size)}, more than the {_size(most)} such a file may hold")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 2**20 else f"{n} bytes"


def open_regular(path: Path, most: int | None = None) -> BinaryIO:
    """`path` opened for reading if it is a regular file (of at most `most` bytes), else OSError saying why.

    Every file a user names or a scan finds is opened through this: a FIFO would block forever, a device such
    as /dev/zero (or a link to it) never end. The file is looked at before it is opened (opening a device can
    itself do something), opened without waiting (O_NONBLOCK: a FIFO swapped in meanwhile is not waited for) and
    looked at again through the open file, so what is read is what was checked. A reader that reads to the end
    still bounds what it reads: the file may grow."""
    _check_regular(os.stat(path), most)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        _check_regular(os.fstat(fd), most)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: Path, most: int) -> bytes:
    """The bytes of `path` if it is a regular file of at most `most` bytes, else OSError saying why (see
    `open_regular`); a file that grows while read stops at the bound."""
    with open_regular(path, most) as f:
        data = f.read(most + 1)
    if len(data) > most:
        raise OSError(f"it holds more than the {_size(most)} such a file may hold")
    return data


def json_depth(value: Any) -> int:
    """How deep `value` (parsed JSON) nests lists and objects: 0 for a scalar. Walked with a stack, not recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (list, dict)):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)
                        if isinstance(child, (list, dict)))
    return deepest


def loads_bounded(text: str, depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads` of text nested at most `depth` deep, else ValueError (json's own, or the depth's): a file nested
    deeper is damaged or hostile, and would exhaust the recursion of the parser or of a later reader."""
    try:
        value = json.loads(text)
    except RecursionError:  # (the parser stops at the interpreter's recursion limit, before the stack ends)
        raise ValueError(f"it is nested too deeply (more than {depth} levels)") from None
    # a text with fewer brackets than `depth` cannot nest deeper: counted at C speed, walked only past it
    if text.count("[") + text.count("{") > depth and json_depth(value) > depth:
        raise ValueError(f"it is nested too deeply (more than {depth} levels)")
    return value


JSON_COUNT_CHUNK = 1 << 20  # bytes counted in one C call: the GIL is free between two (about a millisecond)


@dataclass
class JsonItems:
    """What `json_items` counted: the `[` and `{`, the `,` outside strings, and the escaped quotes inside them."""

    containers: int = 0
    separators: int = 0
    escaped_quotes: int = 0

    def past(self, most: int) -> bool:
        return max(self.containers, self.separators, self.escaped_quotes) > most


def json_items(data: bytes, most: int) -> JsonItems:
    """A bound on the Python objects parsing JSON text would make, counted without making them: its arrays and
    objects (`[`, `{`) and separators (`,`) outside strings, and the escaped quotes inside them (each costs this
    count a step); counting stops once one passes `most`. `json.loads` holds the GIL from start to end (16 MiB of
    `[],` held it for seconds, the GC walking millions of lists), so a server counts first, on a thread: strings
    are skipped with `bytes.find` and the text between them counted with `bytes.count`, a megabyte a call, so
    that no call holds the GIL for long and the event loop runs meanwhile."""
    items, pos = JsonItems(), 0
    while True:
        quote = data.find(b'"', pos)
        end = len(data) if quote < 0 else quote
        for start in range(pos, end, JSON_COUNT_CHUNK):
            stop = min(start + JSON_COUNT_CHUNK, end)
            items.containers += data.count(b"[", start, stop) + data.count(b"{", start, stop)
            items.separators += data.count(b",", start, stop)
            if items.past(most):
                return items
        if quote < 0:
            return items
        pos = _string_end(data, quote + 1, items, most)
        if pos < 0:  # a string that never ends (not JSON: the parser says so), or counting passed `most`
            return items


def _string_end(data: bytes, at: int, items: JsonItems, most: int) -> int:
    """Where the JSON string whose text starts at `at` ends (just past its closing quote: the first quote after an
    even run of backslashes), each escaped quote counted in `items`; -1 when it never ends or the count passes
    `most`."""
    while True:
        close = data.find(b'"', at)
        if close < 0:
            return -1
        run = 0
        while close - run - 1 >= at and data[close - run - 1] == 0x5C:
            run += 1
        if run % 2 == 0:
            return close + 1
        items.escaped_quotes += 1
        if items.past(most):
            return -1
        at = close + 1


def read_json(path: Path, most: int, depth: int = MAX_JSON_DEPTH) -> Any:
    """A saved or named JSON file: a regular file of at most `most` bytes (`read_bounded`), UTF-8, nested at most
    `depth` deep. OSError for the file, ValueError for its contents, each saying what is wrong."""
    return loads_bounded(read_bounded(path, most).decode("utf-8"), depth)


def check_output(path: Path, what: str) -> os.stat_result | None:
    """Refuse, before any work starts, an output that exists and is not a regular file: /dev/full or /dev/zero
    (or a link to one) would swallow or feed data forever, a FIFO block, a folder fail at the end. Returns the
    file's status, or None when there is none yet (it will be created). Raises OutputError."""
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # (no folder to hold it yet: the writer says so)
        return None
    except OSError as e:
        raise OutputError(f"{what} {path}: cannot use it ({e.strerror or e}); give another file name") from None
    if not stat.S_ISREG(info.st_mode):
        raise OutputError(f"{what} {path} is {file_kind(info.st_mode)}, not a regular file; give a file name")
    return info


def open_output(path: Path, what: str, append: bool = True) -> BinaryIO:
    """`path` opened for reading and writing, created if missing: appended to, or emptied (`append` False) only
    once it is known to be a regular file. Anything else is refused as `check_output` says, checked again on the
    open file (it may have been swapped). Raises OutputError."""
    check_output(path, what)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags | (os.O_APPEND if append else 0), 0o666)
    except OSError as e:
        raise OutputError(f"cannot write {what} {path}: {e.strerror or e}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OutputError(f"{what} {path} is {file_kind(info.st_mode)}, not a regular file; give a file name")
        if not append:
            os.ftruncate(fd, 0)
        return os.fdopen(fd, "a+b" if append else "r+b")
    except OSError as e:
        os.close(fd)
        raise OutputError(f"cannot write {what} {path}: {e.strerror or e}") from None
    except BaseException:
        os.close(fd)
        raise


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


def read_saved(path: Path, parse: Callable[[Any], T], default: T, what: str, fallback: str,
               most: int = SAVED_MAX_BYTES) -> tuple[T, str | None]:
    """A small saved JSON file (settings, choices) read with `parse`, which raises ValueError or a TandemError
    naming what is wrong; `default` when there is no file. A file that cannot be used (not a regular file, over
    `most` bytes, nested too deeply, not JSON, refused by `parse`) is set aside and the notice says so: "the `what`
    could not be used (why); it was set aside as … and `fallback`". Never raises, never blocks."""
    remove_stale_temporaries(path.parent, older_than_s=STALE_TEMP_S)
    if not path.exists():
        return default, None
    try:
        return parse(read_json(path, most)), None
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
        try:  # a link is moved itself, never what it points to (a device, a file elsewhere)
            os.link(path, aside, follow_symlinks=False)
        except FileExistsError:
            continue
        except OSError:  # no hard links here (some file systems): a checked rename instead
            if os.path.lexists(aside):
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
    with _open_lock(folder / ".lock") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _open_lock(path: Path) -> BinaryIO:
    """The lock file. Anything but a regular file there (a FIFO would block the opening forever, a device or a
    folder is no lock) was never one of ours: it is set aside and a new lock file made."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | \
        getattr(os, "O_NOFOLLOW", 0)  # (a link, even a dangling one, is not followed out of the folder)
    for _ in range(2):
        try:
            regular = stat.S_ISREG(os.lstat(path).st_mode)
        except FileNotFoundError:
            regular = True  # none yet: made now
        if regular:
            try:
                fd = os.open(path, flags, 0o666)
            except OSError:  # (a link swapped in meanwhile: ELOOP; anything else is said when it is set aside)
                fd = -1
            if fd >= 0 and stat.S_ISREG(os.fstat(fd).st_mode):  # (checked again: it may have been swapped)
                return os.fdopen(fd, "r+b")
            if fd >= 0:
                os.close(fd)
        try:
            set_aside(path, ".txt")
        except OSError as e:
            raise StoreError(f"{path} is not a regular file and cannot be moved ({e}); delete it") from None
    raise StoreError(f"{path} is not a regular file; delete it")
