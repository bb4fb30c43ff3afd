"""The files of `tandem batch`: OpenAI batch-file requests in, one result line per request out.

Input: one JSON object a line, as OpenAI's Batch API takes them: `custom_id`, optionally `method` and `url`
(`/v1/chat/completions` or `/v1/completions`), and `body` with `messages` (chat) or `prompt` (completion), plus the
request's own sampling settings (`max_tokens` or `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop`, and
Tandem's `top_k` and `repetition_penalty`). A line that cannot run becomes an error record; the rest go on.

Output: one JSON object a line, as OpenAI's batch output: `custom_id`, `response` (`status_code` 200 and a
`chat.completion` or `text_completion` body with the text, `finish_reason` and `usage`), and `error` (null, or code and
message). Lines are appended as requests finish and synced to the disk, so an interrupted run loses only the requests
in flight, and a run over the same files again answers only those not yet in the output.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.app.openai_api import CHAT, COMPLETION, Answer, completion_body, finish_reason, parse_body, usage_of
from tandem.kernels.errors import GenerationError, OutputError, TandemError
from tandem.runtime.batch import BatchRequest, BatchResult
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.tokenizer import Tokenizer

MAX_LINE_BYTES = 16 * 2**20  # one request: a long document to summarise fits many times over


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
    def key(self) -> str:
        """What the output knows it by: its custom_id, or its line number when it has none (an error record)."""
        return self.custom_id if self.custom_id is not None else f"#line {self.number}"


def parse_line(number: int, text: str, tokenizer: Tokenizer, defaults: SamplingParams) -> Line:
    """One input line -> its request, with the command line's settings where the body gives none."""
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:
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


def read_requests(path: Path, tokenizer: Tokenizer, defaults: SamplingParams) -> list[Line]:
    """Every non-blank line of the input file; a custom_id seen before makes its later lines error records."""
    if not path.is_file():
        raise TandemError(f"input file {path} is {'a folder' if path.is_dir() else 'missing'}")
    lines: list[Line] = []
    seen: set[str] = set()
    try:
        with path.open("rb") as f:
            for number, data in enumerate(f, 1):
                if len(data) > MAX_LINE_BYTES:
                    lines.append(Line(number, None, error=f"line {number} is over {MAX_LINE_BYTES >> 20} MiB"))
                    continue
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError:
                    lines.append(Line(number, None, error=f"line {number} is not UTF-8 text"))
                    continue
                if not text.strip():
                    continue
                line = parse_line(number, text, tokenizer, defaults)
                if line.custom_id is not None and line.custom_id in seen:
                    line = Line(number, None, error=f"line {number}: custom_id {line.custom_id!r} is used by an "
                                                    "earlier line; each request needs its own")
                elif line.custom_id is not None:
                    seen.add(line.custom_id)
                lines.append(line)
    except OSError as e:
        raise TandemError(f"cannot read input file {path}: {e.strerror or e}") from None
    return lines


class ResultsFile:
    """The output file, appended to. Opening it keeps its complete lines and drops a last line cut off by an
    interruption (the request it held runs again); `done` holds the keys already answered."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: set[str] = set()
        if path.is_dir():
            raise OutputError(f"--out {path} is a folder; give a file name")
        try:
            data = path.read_bytes() if path.exists() else b""
            keep = data[: data.rfind(b"\n") + 1]
            for raw in keep.splitlines():
                self.done.add(self._key(raw))
            if len(keep) != len(data):
                with path.open("r+b") as f:
                    f.truncate(len(keep))
            self._file = path.open("ab")
        except OSError as e:
            raise OutputError(f"cannot write {path}: {e.strerror or e}") from None

    def _key(self, raw: bytes) -> str:
        try:
            record = json.loads(raw)
            return record["custom_id"] if record.get("custom_id") is not None else f"#line {record['line']}"
        except (ValueError, KeyError, TypeError, AttributeError):
            raise OutputError(f"{self.path} holds a line that is not a batch result ({raw[:60]!r}); give another "
                              "--out, or move this file away") from None

    def write(self, record: dict[str, Any]) -> None:
        """One line, on the disk before this returns."""
        try:
            self._file.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            raise OutputError(f"cannot write {self.path}: {e.strerror or e}") from None

    def close(self) -> None:
        self._file.close()


def result_record(line: Line, result: BatchResult, answer: Answer, model: str) -> dict[str, Any]:
    if result.finish_reason == "error":
        return error_record(line, result.error, "generation_failed")
    completion = answer.tokens if answer.stopped else len(result.tokens)
    chat = line.endpoint == CHAT
    body = completion_body(line.endpoint, f"{'chatcmpl' if chat else 'cmpl'}-{line.number}", int(answer.started),
                           model, answer.text, finish_reason(answer, str(result.finish_reason)),
                           usage_of(result.prompt_tokens, completion))
    return {"id": f"batch_req_{line.number}", "custom_id": line.custom_id, "line": line.number,
            "response": {"status_code": 200, "request_id": f"req_{line.number}", "body": body}, "error": None}


def error_record(line: Line, message: str, code: str = "invalid_request") -> dict[str, Any]:
    return {"id": f"batch_req_{line.number}", "custom_id": line.custom_id, "line": line.number, "response": None,
            "error": {"code": code, "message": message}}
