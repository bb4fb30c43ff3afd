"""`tandem batch`: OpenAI batch lines in and out, error records for bad lines, per-request settings, and a second run
that answers only what an interrupted one left."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tandem.app.cli import batch as batch_cmd
from tandem.app.cli.main import main
from tandem.runtime.loader import load_model
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.tokenizer import Tokenizer

FLAGS = ["--dtype", "fp32", "--threads", "1", "--no-profile"]


def chat(cid: str, text: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "any", "messages": [{"role": "user", "content": text}], **body}}


def completion(cid: str, prompt: str | list[int], **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_out(path: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for raw in path.read_text().splitlines():
        record = json.loads(raw)
        key = record["custom_id"] if record["custom_id"] is not None else f"#line {record['line']}"
        assert key not in out, f"{key} answered twice"
        out[key] = record
    return out


def text_of(record: dict[str, Any]) -> str:
    choice = record["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


REQUESTS = [chat("greet", "Hello there", max_tokens=6),
            completion("story", "Once upon", max_tokens=9),
            chat("sampled", "Tell me", max_tokens=7, temperature=0.9, top_p=0.9, seed=5),
            completion("ids", [5, 6, 7, 8], max_completion_tokens=4, top_k=3, temperature=1.1, seed=2,
                       repetition_penalty=1.2),
            chat("long", "Go on", max_tokens=12),
            completion("short", "A", max_tokens=1)]


def alone_text(model: Path, record: dict[str, Any]) -> tuple[str, int]:
    """The request run alone through Engine.generate (greedy or seeded as its body says): its text and tokens."""
    loaded = load_model(model, dtype="fp32", context=64, threads=1)
    tok = Tokenizer.from_model(model)
    body = record["body"]
    ids = tok.encode_chat(body["messages"]) if "messages" in body else \
        body["prompt"] if isinstance(body["prompt"], list) else tok.encode(body["prompt"])
    params = SamplingParams(max_new_tokens=body.get("max_tokens", body.get("max_completion_tokens")),
                            temperature=body.get("temperature", 0.0), top_k=body.get("top_k", 0),
                            top_p=body.get("top_p", 1.0), repetition_penalty=body.get("repetition_penalty", 1.0),
                            seed=body.get("seed"))
    tokens = list(loaded.engine.generate(ids, params))
    return tok.decode(tokens), len(tokens)


def test_every_answer_is_the_request_run_alone_with_its_own_settings(mixtral_dir: Path, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", REQUESTS)
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(src), "--out", str(out), "--model", str(mixtral_dir), "--batch-size", "3",
                 "--step-tokens", "8", *FLAGS]) == 0
    got = read_out(out)
    assert set(got) == {r["custom_id"] for r in REQUESTS}
    for r in REQUESTS:
        record = got[r["custom_id"]]
        assert record["error"] is None and record["response"]["status_code"] == 200
        body = record["response"]["body"]
        assert body["object"] == ("chat.completion" if "messages" in r["body"] else "text_completion")
        text, n = alone_text(mixtral_dir, r)
        assert text_of(record) == text, r["custom_id"]
        usage = body["usage"]
        assert usage["completion_tokens"] == n and usage["total_tokens"] == usage["prompt_tokens"] + n
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert got["ids"]["response"]["body"]["usage"]["prompt_tokens"] == 4


def test_bad_lines_get_error_records_and_the_batch_goes_on(mixtral_dir: Path, tmp_path: Path) -> None:
    lines = ["{not json", "[1, 2]", {"body": {"prompt": "no id"}}, completion("ok", "Hi", max_tokens=3),
             {"custom_id": "nobody"}, completion("ok2", "again", max_tokens=2), chat("temp", "x", temperature=-1),
             chat("n", "x", n=3), completion("url", "x") | {"url": "/v1/embeddings"},
             completion("prompts", ["a", "b"]), chat("parts", "x") | {"body": {"messages": [{"role": "user"}]}},
             completion("stop", "x", stop=["a", "b", "c", "d", "e"]), "", completion("too-long", "word " * 200)]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(src), "--out", str(out), "--model", str(mixtral_dir), "--context", "64",
                 *FLAGS]) == 0
    got = read_out(out)
    assert got["ok"]["error"] is None and got["ok"]["line"] == 4
    errors = {k: v["error"]["message"] for k, v in got.items() if v["error"] is not None}
    assert "not JSON" in errors["#line 1"] and "not a JSON object" in errors["#line 2"]
    assert "custom_id" in errors["#line 3"] and "body" in errors["nobody"]
    assert got["ok2"]["error"] is None  # (a repeated custom_id refuses the whole file: tests/test_batch_hostile.py)
    assert "temperature" in errors["temp"] and "more than one choice" in errors["n"]
    assert "/v1/embeddings" in errors["url"] and "one prompt a request" in errors["prompts"]
    assert "content must be text" in errors["parts"] and "up to 4" in errors["stop"]
    assert "context holds 64" in errors["too-long"] and got["too-long"]["error"]["code"] == "generation_failed"
    assert len(got) == 13  # the blank line is no request


def test_a_stop_sequence_ends_the_answer_before_it(mixtral_dir: Path, tmp_path: Path) -> None:
    free = write_lines(tmp_path / "free.jsonl", [completion("x", "Once upon", max_tokens=12)])
    main(["batch", str(free), "--out", str(tmp_path / "free-out.jsonl"), "--model", str(mixtral_dir), *FLAGS])
    text = text_of(read_out(tmp_path / "free-out.jsonl")["x"])
    cut = text[len(text) // 2 :].strip()[:2]
    assert cut, f"the random model's answer is too short to cut: {text!r}"
    src = write_lines(tmp_path / "in.jsonl", [completion("x", "Once upon", max_tokens=12, stop=[cut])])
    main(["batch", str(src), "--out", str(tmp_path / "out.jsonl"), "--model", str(mixtral_dir), *FLAGS])
    record = read_out(tmp_path / "out.jsonl")["x"]
    assert text_of(record) == text[: text.index(cut)]
    assert record["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    assert record["response"]["body"]["usage"]["completion_tokens"] < 12


def test_an_interrupted_run_resumes_and_nothing_is_lost_or_redone(mixtral_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_lines(tmp_path / "in.jsonl", REQUESTS + ["oops"])
    whole = tmp_path / "whole.jsonl"
    assert main(["batch", str(src), "--out", str(whole), "--model", str(mixtral_dir), "--batch-size", "2",
                 *FLAGS]) == 0
    out = tmp_path / "out.jsonl"
    finished = batch_cmd.BatchProgress.finished
    calls = []

    def interrupt_after_two(self: batch_cmd.BatchProgress) -> None:
        finished(self)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(batch_cmd.BatchProgress, "finished", interrupt_after_two)
    assert main(["batch", str(src), "--out", str(out), "--model", str(mixtral_dir), "--batch-size", "2",
                 *FLAGS]) == 130
    first = read_out(out)
    assert len(first) == 3  # the bad line's error record, then two answers
    with out.open("a") as f:  # a line cut off as a kill would leave it: dropped, its request run again
        f.write('{"id": "batch_req_9", "custom_id": "lo')
    monkeypatch.setattr(batch_cmd.BatchProgress, "finished", finished)
    assert main(["batch", str(src), "--out", str(out), "--model", str(mixtral_dir), "--batch-size", "2",
                 *FLAGS]) == 0
    resumed, reference = read_out(out), read_out(whole)
    assert set(resumed) == set(reference)
    for key, record in reference.items():
        if record["error"] is None:
            assert text_of(resumed[key]) == text_of(record), key
    assert main(["batch", str(src), "--out", str(out), "--model", str(mixtral_dir), *FLAGS]) == 0  # all done
    assert read_out(out) == resumed


def test_an_output_file_that_is_not_batch_results_is_refused(mixtral_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    src = write_lines(tmp_path / "in.jsonl", [completion("x", "Hi", max_tokens=2)])
    out = tmp_path / "notes.jsonl"
    out.write_text("my notes\n")
    assert main(["batch", str(src), "--out", str(out), "--model", str(mixtral_dir), *FLAGS]) == 2
    assert "not a batch result" in capsys.readouterr().err and out.read_text() == "my notes\n"
    assert main(["batch", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o.jsonl"), "--model",
                 str(mixtral_dir), *FLAGS]) == 2
    assert "missing" in capsys.readouterr().err


def test_on_the_emulated_accelerator_the_steps_are_pipelined_and_the_answers_unchanged(
        mixtral_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_lines(tmp_path / "in.jsonl", REQUESTS)
    cpu = tmp_path / "cpu.jsonl"
    assert main(["batch", str(src), "--out", str(cpu), "--model", str(mixtral_dir), *FLAGS]) == 0
    want = {k: text_of(v) for k, v in read_out(cpu).items()}
    # the KV cache of 3 rows of 512 tokens fits beside the weights (attention there); of 6, only in RAM (attention
    # on the CPU, steps in two micro-batches)
    for size, where in (("3", "attention on the accelerator (asked"),
                        ("6", "attention on the CPU in 2 pipelined micro-batches")):
        out = tmp_path / f"accel{size}.jsonl"
        assert main(["batch", str(src), "--out", str(out), "--model", str(mixtral_dir), "--accelerator", "emulated",
                     "--vram-gb", "0.008", "--context", "512", "--batch-size", size, *FLAGS]) == 0
        assert where in capsys.readouterr().err
        assert {k: text_of(v) for k, v in read_out(out).items()} == want
