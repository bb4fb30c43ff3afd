"""`tandem batch` against careless and hostile files: an output that is the input or not a regular file, inputs that
are not regular files, byte order marks, repeated custom_ids, error records whose key a request's id could take, and
a seeded fuzzer over input lines (every line is run or answered with an error record; nothing crashes)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.app.cli import batch_file
from tandem.app.cli.batch import workload
from tandem.app.cli.batch_file import Line, ResultsFile, read_requests
from tandem.app.cli.main import main
from tandem.kernels.errors import UsageError
from tandem.runtime.batch import BatchRequest
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--dtype", "fp32", "--threads", "1", "--no-profile"]
BOM = "\ufeff"
# a command that would read a device forever runs in a child with this much address space: it fails, not the machine
CHILD_MEMORY = 4 * 2**30


def request(cid: Any, prompt: Any = "Hi", **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": 2, **body}}


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in path.read_text(encoding="utf-8").splitlines()]


def batch(src: Path, out: Path | str, model: Path, *more: str) -> int:
    return main(["batch", str(src), "--out", str(out), "--model", str(model), *FLAGS, *more])


def batch_in_child(src: Path, out: Path | str, model: Path) -> subprocess.CompletedProcess[str]:
    """The command in a child process bounded in memory and time: a regression that reads a device forever or
    waits on a FIFO fails this test instead of filling the machine's RAM or hanging it."""
    code = ("import resource, sys\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({CHILD_MEMORY}, {CHILD_MEMORY}))\n"
            "from tandem.app.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    argv = [sys.executable, "-c", code, "batch", str(src), "--out", str(out), "--model", str(model), *FLAGS]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("tandem batch blocked on its output or input")


def run_guarded(src: Path, out: Path | str, model: Path, capsys: pytest.CaptureFixture[str], in_child: bool
                ) -> tuple[int, str]:
    """The command's status and standard error: in a bounded child where a regression could read a device or wait
    on a FIFO, else here."""
    if in_child:
        done = batch_in_child(src, out, model)
        return done.returncode, done.stderr
    rc = batch(src, out, model)
    return rc, capsys.readouterr().err


# -- the output is the input, however named ------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["same path", "./in.jsonl", "symlink", "hard link", "absolute and relative"])
def test_an_output_that_is_the_input_is_refused_and_the_input_kept(mixtral_dir: Path, tmp_path: Path, capsys,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   spelling: str) -> None:
    src = write_lines(tmp_path / "in.jsonl", [request("a"), request("b"), request("c")])
    before = src.read_bytes()
    monkeypatch.chdir(tmp_path)
    out: Path | str = {"same path": src, "./in.jsonl": "./in.jsonl", "absolute and relative": "in.jsonl",
                       "symlink": tmp_path / "link.jsonl", "hard link": tmp_path / "hard.jsonl"}[spelling]
    if spelling == "symlink":
        Path(out).symlink_to(src)
    elif spelling == "hard link":
        os.link(src, out)
    assert batch(src, out, mixtral_dir) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "is the input file" in err and "Traceback" not in err
    assert src.read_bytes() == before


def test_the_results_file_refuses_the_input_by_device_and_inode(tmp_path: Path) -> None:
    """The second guard: the output opened for writing is compared with the input (a swap after the first check)."""
    src = write_lines(tmp_path / "in.jsonl", [request("a")])
    info = src.stat()
    with pytest.raises(UsageError, match="is the input file"):
        ResultsFile(src, avoid=(info.st_dev, info.st_ino))
    assert json.loads(src.read_text())["custom_id"] == "a"


def test_an_output_holding_requests_or_notes_is_refused_and_kept(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    """Another request file as --out: its lines name custom_ids but are no answers (no response, no error)."""
    src = write_lines(tmp_path / "in.jsonl", [request("a"), request("b")])
    other = write_lines(tmp_path / "other.jsonl", [request("a"), request("b")])
    kept = other.read_bytes()
    assert batch(src, other, mixtral_dir) == 2
    assert "not a batch result" in capsys.readouterr().err and other.read_bytes() == kept
    notes = tmp_path / "notes.txt"
    notes.write_text("one line of notes, no newline")  # would be cut off as an interrupted write
    assert batch(src, notes, mixtral_dir) == 2
    assert "not a batch result" in capsys.readouterr().err
    assert notes.read_text() == "one line of notes, no newline"


# -- an output that is not a regular file ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["/dev/full", "/dev/zero", "link to /dev/zero", "link to /dev/full"])
def test_an_output_that_is_a_device_is_refused_before_any_work(mixtral_dir: Path, tmp_path: Path, kind: str) -> None:
    src = write_lines(tmp_path / "in.jsonl", [request("a")])
    out: Path | str = kind
    if kind.startswith("link to "):
        out = tmp_path / "out.jsonl"
        Path(out).symlink_to(kind.removeprefix("link to "))
    done = batch_in_child(src, out, mixtral_dir)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("error: --out") and "is a device, not a regular file" in done.stderr
    assert "reading the experts" not in done.stderr  # refused before the model was loaded


@pytest.mark.parametrize("kind", ["fifo", "link to a fifo", "folder", "link to a folder"])
def test_an_output_that_is_a_fifo_or_a_folder_is_refused(mixtral_dir: Path, tmp_path: Path, capsys,
                                                         kind: str) -> None:
    src = write_lines(tmp_path / "in.jsonl", [request("a")])
    target = tmp_path / "target"
    if "fifo" in kind:
        os.mkfifo(target)
    else:
        target.mkdir()
    out = target
    if kind.startswith("link"):
        out = tmp_path / "out.jsonl"
        out.symlink_to(target)
    rc, err = run_guarded(src, out, mixtral_dir, capsys, in_child="fifo" in kind)
    assert rc == 2, err[-2000:]
    what = "a FIFO (named pipe)" if "fifo" in kind else "a folder"
    assert err.startswith("error: --out") and f"is {what}, not a regular file" in err


# -- an input that is not a regular file ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind, needle", [("fifo", "not a regular file but a FIFO"),
                                          ("link to /dev/zero", "not a regular file but a device"),
                                          ("folder", "not a regular file but a folder"),
                                          ("huge", "more than the 256 MiB"),
                                          ("missing", "is missing")])
def test_an_input_that_is_not_a_bounded_regular_file_is_refused(mixtral_dir: Path, tmp_path: Path, capsys,
                                                               kind: str, needle: str) -> None:
    src = tmp_path / "in.jsonl"
    if kind == "fifo":
        os.mkfifo(src)
    elif kind == "link to /dev/zero":
        src.symlink_to("/dev/zero")
    elif kind == "folder":
        src.mkdir()
    elif kind == "huge":
        with src.open("wb") as f:
            f.truncate(300 * 2**20)  # sparse: no disk taken
    out = tmp_path / "out.jsonl"
    rc, err = run_guarded(src, out, mixtral_dir, capsys, in_child=kind in ("fifo", "link to /dev/zero"))
    assert rc == 2, err[-2000:]
    assert err.startswith("error: ") and needle in err
    assert not out.exists()  # nothing written, not even an empty file


def test_a_line_over_the_bound_is_an_error_record_and_never_held_whole(tmp_path: Path, tiny_tokenizer: Tokenizer,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_file, "MAX_LINE_BYTES", 200)
    src = write_lines(tmp_path / "in.jsonl", [request("a", "x" * 1000), request("b"), "y" * 450, request("c")])
    lines = read_requests(src, tiny_tokenizer, SamplingParams())
    assert [(x.number, x.custom_id, bool(x.request)) for x in lines] == [
        (1, None, False), (2, "b", True), (3, None, False), (4, "c", True)]
    assert "over" in lines[0].error and "over" in lines[2].error


# -- byte order marks, repeated ids, error-record keys --------------------------------------------------------------

def test_a_byte_order_mark_on_the_first_line_is_dropped(mixtral_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(BOM + json.dumps(request("first")) + "\n" + json.dumps(request("second")) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert batch(src, out, mixtral_dir) == 0
    got = {r["custom_id"]: r for r in records(out)}
    assert set(got) == {"first", "second"}
    assert got["first"]["error"] is None and got["first"]["response"]["status_code"] == 200


def test_a_byte_order_mark_does_not_let_a_later_line_answer_for_the_first(mixtral_dir: Path, tmp_path: Path,
                                                                          capsys) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(BOM + json.dumps(request("same", "first prompt")) + "\n"
                   + json.dumps(request("same", "an impostor")) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert batch(src, out, mixtral_dir) == 2
    assert '"same" on lines 1, 2' in capsys.readouterr().err and not out.exists()


def test_a_byte_order_mark_after_the_first_line_is_that_line_s_error(tmp_path: Path, tiny_tokenizer: Tokenizer
                                                                     ) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(request("a")) + "\n" + BOM + json.dumps(request("b")) + "\n", encoding="utf-8")
    lines = read_requests(src, tiny_tokenizer, SamplingParams())
    assert lines[0].request is not None and lines[1].custom_id is None and "not JSON" in lines[1].error


def test_repeated_custom_ids_refuse_the_file_naming_the_lines(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    """OpenAI's batch API refuses a file whose custom_ids repeat: an answer names its request by it."""
    src = write_lines(tmp_path / "in.jsonl", [request("a"), request("b"), request("a"), "{broken",
                                              {"custom_id": "b"}, request("c")])
    out = tmp_path / "out.jsonl"
    assert batch(src, out, mixtral_dir) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and '"a" on lines 1, 3' in err and '"b" on lines 2, 5' in err
    assert "nothing was run" in err and not out.exists()


def test_an_error_record_s_key_is_never_a_request_s_id(mixtral_dir: Path, tmp_path: Path) -> None:
    """A request whose custom_id reads like the old line keys is still answered after a resume that found the bad
    line's error record already written (error records are written first, so an interrupted run leaves them)."""
    src = write_lines(tmp_path / "in.jsonl", ["{not json", request("#line 1"), request("1"), request("line 1")])
    out = tmp_path / "out.jsonl"
    bad = Line(1, None)
    out.write_text(json.dumps(batch_file.error_record(bad, "line 1 is not JSON")) + "\n")
    assert batch(src, out, mixtral_dir) == 0
    got = records(out)
    assert [r["custom_id"] for r in got] == [None, "#line 1", "1", "line 1"]
    assert got[0]["line"] == 1 and got[0]["error"]["code"] == "invalid_request"
    assert all(r["error"] is None for r in got[1:])
    before = out.read_bytes()
    assert batch(src, out, mixtral_dir) == 0 and out.read_bytes() == before  # all answered: nothing redone


def test_results_are_keyed_by_id_or_line_number_apart(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    lines = [Line(3, None), Line(4, "3"), Line(5, "#line 3")]
    out.write_text(json.dumps(batch_file.error_record(lines[0], "bad")) + "\n")
    results = ResultsFile(out)
    results.close()
    assert [x.key in results.done for x in lines] == [True, False, False]


def test_the_policy_never_simulates_more_tokens_than_the_context_holds() -> None:
    """A max_tokens of a billion (valid JSON, a whole number) made the policy's simulation step a billion times."""
    lines = [Line(1, "a", request=BatchRequest("a", [1, 2, 3], SamplingParams(max_new_tokens=10**9)))]
    w = workload(lines, 512)
    assert w.new_tokens <= 512 and w.prompt_tokens == 3


# -- the fuzzer -----------------------------------------------------------------------------------------------------

FUZZ_CASES = 240
FUZZ_SEED = 20240611


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**63, -(2**63), 10**40, 7])
    if kind == 3:
        return rng.choice([0.5, -0.0, 1e308, 2.5e-324, 3.0])
    if kind in (4, 5):
        return rng.choice(["", "hi", "\u0000", "\ud800", "😀" * 3, "x" * 500, "#line 1", "\ufeff"])
    if kind in (6, 7):
        return [_json_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["prompt", "messages", "body", "custom_id", "max_tokens", "role", "content", "x"]):
            _json_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _mutated_request(rng: random.Random, cid: str) -> dict[str, Any]:
    if rng.random() < 0.5:
        r: dict[str, Any] = request(cid, rng.choice(["Hello", [3, 4, 5], "", [], [-1], [10**12], ["a"]]))
    else:
        r = {"custom_id": cid, "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}}
    for _ in range(rng.randrange(3)):
        field = rng.choice(["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                            "repetition_penalty", "n", "messages", "prompt", "logprobs"])
        r["body"][field] = _json_value(rng)
    if rng.random() < 0.15:
        r[rng.choice(["url", "method", "body"])] = _json_value(rng)
    if rng.random() < 0.1:
        r["body"]["max_tokens"] = rng.choice([10**9, 2**63, 1e400])  # (1e400 is written as Infinity)
    return r


def _fuzz_line(rng: random.Random, i: int) -> bytes:
    """One input line (no newline): a mutated request, a random JSON value, or bytes that are hardly JSON."""
    kind = rng.randrange(10)
    cid = f"fuzz-{i}"
    if kind <= 4:
        text = json.dumps(_mutated_request(rng, cid), ensure_ascii=rng.random() < 0.5)
    elif kind == 5:
        value = _json_value(rng)
        if isinstance(value, dict):
            value.pop("custom_id", None)  # ids stay distinct: a repeated one refuses the whole file
        text = json.dumps(value)
    elif kind == 6:
        nest = rng.choice([70, 500, 5000])
        text = json.dumps(request(cid)).replace('"Hi"', "[" * nest + '"Hi"' + "]" * nest)
    elif kind == 7:
        text = json.dumps(request(cid)).replace("2}", rng.choice(["1" * 5000 + "}", "1e999999}", "-0}", "2.0}"]))
    elif kind == 8:
        text = BOM + json.dumps(request(cid))
    else:
        data = json.dumps(request(cid)).encode()
        cut = rng.randrange(len(data))
        return data[:cut] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\r", b"\"", b"\\"]) + data[cut:]
    return text.replace("\n", " ").encode("utf-8", "surrogatepass")


def fuzz_file(path: Path) -> list[bytes]:
    rng = random.Random(FUZZ_SEED)
    lines = [_fuzz_line(rng, i) for i in range(FUZZ_CASES)]
    lines[0] = BOM.encode() + json.dumps(request("fuzz-first")).encode()  # as a Windows editor writes it
    path.write_bytes(b"\n".join(lines) + b"\n")
    return lines


def test_fuzzed_lines_each_parse_to_one_line_and_nothing_raises(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    src = tmp_path / "in.jsonl"
    raw = fuzz_file(src)
    lines = read_requests(src, tiny_tokenizer, SamplingParams(max_new_tokens=2))
    blank = {n for n, data in enumerate(raw, 1) if not data.strip()}
    assert sorted(x.number for x in lines) == sorted(set(range(1, len(raw) + 1)) - blank)
    for x in lines:
        assert (x.request is None) == bool(x.error), x
        assert x.custom_id is None or isinstance(x.custom_id, str)
    runnable = [x for x in lines if x.request]
    assert runnable and len(runnable) < len(lines)  # the fuzzer makes both kinds
    assert lines[0].custom_id == "fuzz-first" and lines[0].request is not None


def test_fuzzed_batch_answers_every_line_once(mixtral_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    raw = fuzz_file(src)
    out = tmp_path / "out.jsonl"
    assert batch(src, out, mixtral_dir, "--max-new-tokens", "2", "--context", "64") == 0
    keys: list[Any] = []
    for r in records(out):
        assert (r["response"] is None) != (r["error"] is None), r
        keys.append(r["custom_id"] if r["custom_id"] is not None else r["line"])
    assert len(keys) == len(set(keys))
    assert len(keys) == sum(1 for data in raw if data.strip())
    before = out.read_bytes()
    assert batch(src, out, mixtral_dir, "--max-new-tokens", "2", "--context", "64") == 0
    assert out.read_bytes() == before  # every line was answered: a second run has nothing to do


@pytest.fixture
def tiny_tokenizer(mixtral_dir: Path) -> Tokenizer:
    return Tokenizer.from_model(mixtral_dir)


def test_open_output_takes_a_new_or_regular_file_only(tmp_path: Path) -> None:
    from tandem.kernels.errors import OutputError
    from tandem.runtime.paths import open_output

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for bad, what in ((Path("/dev/full"), "a device"), (fifo, "a FIFO"), (tmp_path, "a folder")):
        with pytest.raises(OutputError, match=f"is {what}.*not a regular file"):
            open_output(bad, "--out")
    new = tmp_path / "new.txt"
    with open_output(new, "--out", append=False) as f:
        f.write(b"first")
    with open_output(new, "--out") as f:
        f.write(b" then more")
    assert new.read_bytes() == b"first then more"
    with open_output(new, "--out", append=False) as f:
        f.write(b"over")
    assert new.read_bytes() == b"over"


def test_a_record_is_one_line_whatever_its_text_holds() -> None:
    """U+2028, U+2029 and U+0085 (in a custom_id, or an answer's text) are line breaks to some readers (Python's
    str.splitlines, JavaScript): escaped, so every record stays one line however the file is read."""
    from tandem.app.cli.batch_file import _record_line

    record = {"custom_id": "a\u2028b\u2029c\u0085d\né", "text": "x\u2028y"}
    line = _record_line(record).decode("utf-8")
    assert line.endswith("\n") and len(line.splitlines()) == 1 and json.loads(line) == record
    assert "é" in line  # (the rest stays readable)
