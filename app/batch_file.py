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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.kernels.errors import GenerationError, OutputError, TandemError
from tandem.runtime.batch import BatchRequest, BatchResult
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.tokenizer import Tokenizer

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
MAX_LINE_BYTES = 16 * 2**20  # one request: a long document to summarise fits many times over
MAX_STOPS = 4  # as OpenAI
# body fields that would change what the answer means: refused rather than ignored
UNSUPPORTED = {"n": "more than one choice a request", "tools": "tools", "functions": "functions",
               "response_format": "response formats", "logprobs": "log probabilities", "logit_bias": "logit biases"}
HARMLESS = (None, False, 1, [], {}, {"type": "text"})  # those fields' values that ask for nothing more


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


def _number(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ValueError(f"body.{name} must be a {'number' if kind is float else 'whole number'}, not "
                         f"{json.dumps(value)[:40]}")
    return kind(value)


def _messages(value: Any) -> list[dict[str, str]]:
    """Chat messages as the chat template takes them; a content given as parts keeps its text parts."""
    if not isinstance(value, list) or not value:
        raise ValueError("body.messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"body.messages[{i}] must be an object with a role")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"body.messages[{i}].content: only text parts can be read")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"body.messages[{i}].content must be text")
        out.append({"role": m["role"], "content": content})
    return out


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
        for name, what in UNSUPPORTED.items():
            value = body.get(name)
            if value not in HARMLESS:
                raise ValueError(f"body.{name}: batch mode does not offer {what}")
        if url == CHAT:
            ids = tokenizer.encode_chat(_messages(body.get("messages")))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
                ids = list(prompt)  # token ids, as the completions API allows
            elif isinstance(prompt, str):
                ids = tokenizer.encode(prompt)
            else:
                raise ValueError("body.prompt must be text or a list of token ids (one prompt a line)")
        stop = body.get("stop")
        stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else ()
        if stop is not None and (not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS):
            raise ValueError(f"body.stop must be a text or a list of up to {MAX_STOPS} non-empty texts")
        most = body.get("max_completion_tokens", body.get("max_tokens"))
        params = SamplingParams(
            max_new_tokens=_number({"max_tokens": most}, "max_tokens", int, defaults.max_new_tokens),
            temperature=_number(body, "temperature", float, defaults.temperature),
            top_k=_number(body, "top_k", int, defaults.top_k),
            top_p=_number(body, "top_p", float, defaults.top_p),
            repetition_penalty=_number(body, "repetition_penalty", float, defaults.repetition_penalty),
            seed=_number(body, "seed", int, defaults.seed),
        )
        params.check()
        if params.seed is not None and not 0 <= params.seed < 2**63:
            raise ValueError("body.seed must be from 0 to 2^63 - 1")
    except (ValueError, GenerationError, TandemError) as e:  # a chat template problem is the line's, too
        line.error = f"{cid}: {e}"
        return line
    line.request, line.stops = BatchRequest(cid, ids, params), stops
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


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}  # OpenAI's names


@dataclass
class Answer:
    """A request's text as it streams, cut at the first stop sequence."""

    stops: tuple[str, ...]
    text: str = ""
    stopped: bool = False
    tokens: int = 0
    started: float = field(default_factory=time.time)

    def add(self, delta: str, token: bool = True) -> bool:
        """Append a token's text (or, `token` False, text held back until the end); True when a stop sequence has
        just appeared (the text is cut before it)."""
        if self.stopped:
            return False
        self.tokens += token
        tail = len(self.text)
        self.text += delta
        for s in self.stops:
            at = self.text.find(s, max(0, tail - len(s) + 1))
            if at >= 0:
                self.text, self.stopped = self.text[:at], True
                return True
        return False


def result_record(line: Line, result: BatchResult, answer: Answer, model: str) -> dict[str, Any]:
    if result.finish_reason == "error":
        return error_record(line, result.error, "generation_failed")
    reason = "stop" if answer.stopped else FINISH.get(result.finish_reason, result.finish_reason)
    completion = answer.tokens if answer.stopped else len(result.tokens)
    usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
             "total_tokens": result.prompt_tokens + completion}
    chat = line.endpoint == CHAT
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": answer.text}
    else:
        choice["text"] = answer.text
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{line.number}", "object": "chat.completion" if chat else
            "text_completion", "created": int(answer.started), "model": model, "choices": [choice], "usage": usage}
    return {"id": f"batch_req_{line.number}", "custom_id": line.custom_id, "line": line.number,
            "response": {"status_code": 200, "request_id": f"req_{line.number}", "body": body}, "error": None}


def error_record(line: Line, message: str, code: str = "invalid_request") -> dict[str, Any]:
    return {"id": f"batch_req_{line.number}", "custom_id": line.custom_id, "line": line.number, "response": None,
            "error": {"code": code, "message": message}}
