"""The files of `tandem batch`: OpenAI batch-file requests in, one result line per request out.

Input: one JSON object a line, as OpenAI's Batch API takes them: `custom_id`, optionally `method` and `url`
(`/v1/chat/completions` or `/v1/completions`), and `body` with `messages` (chat) or `prompt` (completion), plus the
request's own sampling settings (`max_tokens` or `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop`, and
Tandem's `top_k` and `repetition_penalty`). A line that cannot run becomes an error record; the rest go on.

Output: one JSON object a line, as OpenAI's batch output: `custom_id`, `response` (`status_code` 200 and a
`chat.completion` or `text_completion` body with the text, `finish_reason` and `usage`), and `error` (null, or code and
message). Lines are appended as requests finish and synced to the disk, so an interrupted run loses only the requests
in flight, and a run over the same files again answers only those not yet in the output. A line that cannot run
has no id of its own to be known by: its record has `custom_id` null and the line number in `line` (where no id a
request gives can collide with it).

Both files are checked before any work: the input must be a regular file of bounded size, the output a regular file
(or none yet) that is not the input, however named (same device and inode), and the input's custom_ids distinct.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tandem.app.cli.prompt_input import BOM_BYTES
from tandem.app.serve.openai_api import CHAT, COMPLETION, Answer, completion_body, finish_reason, parse_body, usage_of
from tandem.kernels.errors import GenerationError, OutputError, TandemError, UsageError
from tandem.runtime.batch import BatchRequest, BatchResult
from tandem.runtime.paths import check_output, loads_bounded, open_output, open_regular
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.tokenizer import Tokenizer

MAX_LINE_BYTES = 16 * 2**20  # one request: a long document to summarise fits many times over
MAX_INPUT_BYTES = 256 * 2**20  # OpenAI takes files of up to 200 MB; every prompt's tokens are held in RAM
MAX_RECORD_BYTES = 64 * 2**20  # one result line: an answer as long as any context, its id as long as any line
MAX_LINE_DEPTH = 64  # a request nests a few levels (body, messages, content parts); deeper is hostile
RECORD_START = b'{"id": "batch_req_'  # how every result line begins (`result_record`, `error_record`)
SAME_IDS_SHOWN = 5  # repeated custom_ids named in the refusal; the count says how many more

Key = str | int  # what the output knows a line by: its custom_id, or (no usable id) its line number


@dataclass
class Line:
    """One input line: a request to run, or why it cannot."""

    number: int  # from 1
    custom_id: str | None
    endpoint: str = CHAT
    request: BatchRequest | None = None
    stops: tuple[str, ...] = ()
    error: str = ""

    @property
    def key(self) -> Key:
        """What the output knows it by: its custom_id, or its line number (an int, so no custom_id, a text, can
        take it) when it has none (an error record)."""
        return self.custom_id if self.custom_id is not None else self.number


def parse_line(number: int, text: str, tokenizer: Tokenizer, defaults: SamplingParams) -> Line:
    """One input line -> its request, with the command line's settings where the body gives none."""
    try:
        raw = loads_bounded(text, MAX_LINE_DEPTH)
    except ValueError as e:
        return Line(number, None, error=f"line {number} is not JSON: {e}")
    if not isinstance(raw, dict):
        return Line(number, None, error=f"line {number} is not a JSON object")
    cid = raw.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return Line(number, None, error=f"line {number} has no custom_id (a non-empty text)")
    line = Line(number, cid)
    try:
        body = raw.get("body")
        if not isinstance(body, dict):
            raise ValueError("the request has no body object")
        url = raw.get("url")
        if url is None:
            url = CHAT if "messages" in body else COMPLETION
        if url not in (CHAT, COMPLETION):
            raise ValueError(f"url {json.dumps(url)[:60]}: batch mode answers {CHAT} and {COMPLETION}")
        if raw.get("method", "POST") != "POST":
            raise ValueError("method must be POST")
        line.endpoint = url
        parsed = parse_body(url, body, tokenizer, defaults)
    except (ValueError, GenerationError, TandemError) as e:  # a chat template problem is the line's, too
        line.error = f"{cid}: {e}"
        return line
    line.request, line.stops = BatchRequest(cid, parsed.ids, parsed.params), parsed.stops
    return line


def check_files(src: Path, out: Path) -> None:
    """Refuse, before anything is read or written, an output that is not a regular file (or none yet) and an output
    that is the input however named (`./in.jsonl`, a link, a hard link: the same device and inode). The input's
    lines would read as answers already given, and its last one be cut off as an interrupted write."""
    was = check_output(out, "--out")
    try:
        given = os.stat(src)
    except OSError:
        return  # (reading it says what is wrong)
    if was is not None and (was.st_dev, was.st_ino) == (given.st_dev, given.st_ino):
        raise UsageError(f"--out {out} is the input file {src}: the answers would overwrite the requests; give "
                         "another file for --out")


def read_requests(path: Path, tokenizer: Tokenizer, defaults: SamplingParams) -> list[Line]:
    """Every non-blank line of the input file, a byte order mark before the first dropped. The file must be a
    regular one of at most MAX_INPUT_BYTES; a repeated custom_id refuses the whole file (as OpenAI's batch API
    does: an answer could not say which request it is for), naming the lines."""
    lines: list[Line] = []
    with _open_input(path) as f:
        for number, data in _numbered_lines(f, path):
            if number == 1 and data is not None:
                data = data.removeprefix(BOM_BYTES)  # it marks the encoding, it is not part of the request
            line = _line(number, data, tokenizer, defaults)
            if line is not None:
                lines.append(line)
    _refuse_repeated_ids(path, lines)
    return lines


def _line(number: int, data: bytes | None, tokenizer: Tokenizer, defaults: SamplingParams) -> Line | None:
    """The line's request or error; None for a blank line (no request)."""
    if data is None:
        return Line(number, None, error=f"line {number} is over {MAX_LINE_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return Line(number, None, error=f"line {number} is not UTF-8 text")
    if not text.strip():
        return None
    return parse_line(number, text, tokenizer, defaults)


def _open_input(path: Path) -> BinaryIO:
    try:
        return open_regular(path, MAX_INPUT_BYTES)
    except FileNotFoundError:
        raise TandemError(f"input file {path} is missing") from None
    except OSError as e:
        split = "; split it into several" if "MiB" in str(e) else ""
        raise TandemError(f"cannot read input file {path}: {e.strerror or e}{split}") from None


def _numbered_lines(f: BinaryIO, path: Path) -> Iterator[tuple[int, bytes | None]]:
    """The file's lines from 1, each read only up to MAX_LINE_BYTES (None for a longer one, read past in pieces
    and never held whole); the file read no further than MAX_INPUT_BYTES even if it grows meanwhile."""
    number = total = 0
    try:
        while data := f.readline(MAX_LINE_BYTES + 1):
            number, total = number + 1, total + len(data)
            too_long = len(data) > MAX_LINE_BYTES
            while data and not data.endswith(b"\n") and too_long:
                data = f.readline(MAX_LINE_BYTES)
                total += len(data)
                _check_total(total, path)
            _check_total(total, path)
            yield number, None if too_long else data
    except OSError as e:
        raise TandemError(f"cannot read input file {path}: {e.strerror or e}") from None


def _check_total(total: int, path: Path) -> None:
    if total > MAX_INPUT_BYTES:
        raise TandemError(f"input file {path} grew past {MAX_INPUT_BYTES >> 20} MiB while read; give a file "
                          "nothing writes to")


def _refuse_repeated_ids(path: Path, lines: list[Line]) -> None:
    where: dict[str, list[int]] = {}
    for x in lines:
        if x.custom_id is not None:
            where.setdefault(x.custom_id, []).append(x.number)
    repeated = [(cid, numbers) for cid, numbers in where.items() if len(numbers) > 1]
    if not repeated:
        return
    shown = "; ".join(f"{json.dumps(cid)[:60]} on lines {', '.join(map(str, numbers[:10]))}"
                      + (" ..." if len(numbers) > 10 else "") for cid, numbers in repeated[:SAME_IDS_SHOWN])
    more = f" (and {len(repeated) - SAME_IDS_SHOWN} more)" if len(repeated) > SAME_IDS_SHOWN else ""
    raise TandemError(f"input file {path} repeats custom_ids: {shown}{more}; each request needs its own "
                      "(an answer names the request by it), so nothing was run: make them distinct")


class ResultsFile:
    """The output file, appended to. Opening it keeps its complete lines and drops a last line cut off by an
    interruption (the request it held runs again); `done` holds the keys already answered. Only a regular file is
    taken (or a new one), and never the input (`avoid`: its device and inode)."""

    def __init__(self, path: Path, avoid: tuple[int, int] | None = None) -> None:
        self.path = path
        self.done: set[Key] = set()
        self._file = open_output(path, "--out")
        try:
            info = os.fstat(self._file.fileno())
            if avoid is not None and (info.st_dev, info.st_ino) == avoid:
                raise UsageError(f"--out {path} is the input file: the answers would overwrite the requests; give "
                                 "another file for --out")
            self._read_back()
        except OSError as e:
            self._file.close()
            raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
        except BaseException:
            self._file.close()
            raise

    def _read_back(self) -> None:
        """Every complete line's key; a cut-off last line (only the start of a record) is truncated away. Lines are
        read one at a time and bounded, so a huge file never fills the memory."""
        f = self._file
        f.seek(0)
        keep = 0
        while data := f.readline(MAX_RECORD_BYTES + 1):
            if not data.endswith(b"\n"):
                if len(data) > MAX_RECORD_BYTES or not (data.startswith(RECORD_START) or RECORD_START.startswith(data)):
                    raise self._not_results(data)
                break  # an interrupted write: its request runs again
            self.done.add(self._key(data))
            keep += len(data)
        if f.tell() != keep:
            f.truncate(keep)
        f.seek(0, os.SEEK_END)

    def _not_results(self, raw: bytes) -> OutputError:
        return OutputError(f"{self.path} holds a line that is not a batch result ({raw[:60]!r}); give another "
                           "--out, or move this file away")

    def _key(self, raw: bytes) -> Key:
        """A result line's key; a line that is not one (a request, notes) is refused: its file is not ours."""
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):
            raise self._not_results(raw) from None
        if not isinstance(record, dict) or not {"custom_id", "response", "error", "line"} <= record.keys():
            raise self._not_results(raw)
        cid, number = record["custom_id"], record["line"]
        if isinstance(cid, str):
            return cid
        if cid is None and isinstance(number, int) and not isinstance(number, bool):
            return number
        raise self._not_results(raw)

    def write(self, record: dict[str, Any]) -> None:
        """One line, on the disk before this returns."""
        try:
            self._file.write(_record_line(record))
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            raise OutputError(f"cannot write {self.path}: {e.strerror or e}") from None

    def close(self) -> None:
        self._file.close()


def _record_line(record: dict[str, Any]) -> bytes:
    """A record as one JSON line: UTF-8 kept readable, but the characters that some readers take as line breaks
    (U+2028, U+2029, U+0085: Python's str.splitlines, JavaScript) escaped, so one record is always one line."""
    text = json.dumps(record, ensure_ascii=False)
    for char in ("\u2028", "\u2029", "\u0085"):
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text.encode("utf-8") + b"\n"


def result_record(line: Line, result: BatchResult, answer: Answer, model: str) -> dict[str, Any]:
    if result.finish_reason == "error":
        return error_record(line, result.error, "generation_failed")
    completion = answer.tokens if answer.stopped else len(result.tokens)
    chat = line.endpoint == CHAT
    body = completion_body(line.endpoint, f"{'chatcmpl' if chat else 'cmpl'}-{line.number}", int(answer.started),
                           model, answer.text, finish_reason(answer, str(result.finish_reason)),
                           usage_of(result.prompt_tokens, completion, result.cached))
    return {"id": f"batch_req_{line.number}", "custom_id": line.custom_id, "line": line.number,
            "response": {"status_code": 200, "request_id": f"req_{line.number}", "body": body}, "error": None}


def error_record(line: Line, message: str, code: str = "invalid_request") -> dict[str, Any]:
    return {"id": f"batch_req_{line.number}", "custom_id": line.custom_id, "line": line.number, "response": None,
            "error": {"code": code, "message": message}}
