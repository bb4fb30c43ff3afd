"""Bad flag values and bad prompts end in one `error: ...` line and exit status 2, before any model loads."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.app.cli import flags
from tandem.app.cli.main import main
from tandem.app.cli.prompt_input import MAX_PROMPT_BYTES
from tandem.kernels.errors import UsageError

NO_MODEL = "/nonexistent/tandem-model"  # were a flag let through, the error would name this folder instead


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    assert "does not exist" not in err  # refused while reading the flags, not after looking for the model
    return err


GENERATE = ["generate", "--model", NO_MODEL, "--prompt", "hi"]
BAD_GENERATE = [
    ("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"), ("--temperature", "warm"),
    ("--repetition-penalty", "nan"), ("--repetition-penalty", "0"), ("--repetition-penalty", "-inf"),
    ("--top-p", "nan"), ("--top-p", "0"), ("--top-p", "1.5"), ("--top-p", "-0.1"),
    ("--top-k", "-1"), ("--top-k", "2.5"),
    ("--cost", "nan"), ("--cost", "nan,1,1,1"), ("--cost", "1,inf,1,1"), ("--cost", "1,2"), ("--cost", "1,2,3,-4"),
    ("--cost", "a,b,c,d"), ("--cost", ""),
    ("--vram-gb", "nan"), ("--vram-gb", "inf"), ("--vram-gb", "-1"), ("--vram-gb", "0"), ("--vram-gb", "1e300"),
    ("--vram-gb", "1000001"), ("--model", ""), ("--placement", ""), ("--record-trace", ""),
    ("--seed", "1" * 70), ("--seed", "-1"), ("--seed", str(2**63)), ("--seed", "x"),
    ("--beams", "-2"), ("--beams", "0"),
    ("--threads", "0"), ("--threads", "-1"), ("--threads", "5000"),
    ("--threads", str(flags.cpu_threads_available() + 1)),
    ("--cache-ways", "-1"), ("--max-inflight", "0"), ("--max-inflight", "-3"),
    ("--kernel-crossover", "-5"), ("--max-new-tokens", "-1"), ("--max-new-tokens", "1e3"),
    ("--context", "0"), ("--context", "1"), ("--context", "-5"), ("--quant-group", "7"),
]


@pytest.mark.parametrize("flag, value", BAD_GENERATE)
def test_bad_generate_flag_is_refused(capsys, flag: str, value: str) -> None:
    refused(capsys, [*GENERATE, flag, value], f"argument {flag}", "tandem generate --help")


def test_thread_limit_is_stated(capsys) -> None:
    limit = flags.cpu_threads_available()
    refused(capsys, [*GENERATE, "--threads", "5000"], f"between 1 and {limit}", "CPU threads this machine has")


@pytest.mark.parametrize("argv, flag", [
    (["chat", NO_MODEL, "--context", "0"], "--context"),
    (["chat", NO_MODEL, "--threads", "-1"], "--threads"),
    (["bench", "decode", "--model", NO_MODEL, "--prompt-tokens", "0"], "--prompt-tokens"),
    (["bench", "decode", "--model", NO_MODEL, "--new-tokens", "-1"], "--new-tokens"),
    (["bench", "decode", "--model", NO_MODEL, "--repeats", "0"], "--repeats"),
    (["bench", "decode", "--model", NO_MODEL, "--vram-gb", "nan"], "--vram-gb"),
    (["bench", "offload", "--model", NO_MODEL, "--expert-fraction", "nan"], "--expert-fraction"),
    (["bench", "offload", "--model", NO_MODEL, "--expert-fraction", "2"], "--expert-fraction"),
    (["bench", "offload", "--model", NO_MODEL, "--new-tokens", "0"], "--new-tokens"),
    (["bench", "e2e", "--model", NO_MODEL, "--context", "0"], "--context"),
    (["bench", "e2e", "--model", NO_MODEL, "--max-inflight", "0"], "--max-inflight"),
    (["bench", "plan", "--model", NO_MODEL, "--tokens", "0"], "--tokens"),
    (["bench", "plan", "--model", NO_MODEL, "--expert-fraction", "-0.5"], "--expert-fraction"),
    (["bench", "quant", "--model", NO_MODEL, "--new-tokens", "0"], "--new-tokens"),
    (["bench", "numerics", "--model", NO_MODEL, "--tokens", "0"], "--tokens"),
    (["bench", "kernels", "--threads", "0"], "--threads"),
    (["bench", "kernels", "--threads", "5000"], "--threads"),
    (["make-bench-model", "--shape", "olmoe", "--out", NO_MODEL, "--layers", "0"], "--layers"),
    (["make-test-model", "--out", NO_MODEL, "--seed", "9" * 70], "--seed"),
    (["chat", "", "--context", "8"], "model"),
    (["autotune", "--model", ""], "--model"),
    (["plan", "--model", "", "--hardware", "hw.json"], "--model"),
    (["plan", "--model", NO_MODEL, "--hardware", ""], "--hardware"),
    (["plan", "--model", NO_MODEL, "--hardware", "hw.json", "--trace", ""], "--trace"),
    (["probe", "--from", ""], "--from"),
    (["bench", "decode", "--model", ""], "--model"),
    (["bench", "offload", "--model", ""], "--model"),
    (["bench", "e2e", "--model", ""], "--model"),
    (["bench", "plan", "--model", ""], "--model"),
    (["bench", "quant", "--model", ""], "--model"),
    (["bench", "numerics", "--model", ""], "--model"),
])
def test_bad_numbers_in_other_commands_are_refused(capsys, argv: list[str], flag: str) -> None:
    refused(capsys, argv, f"argument {flag}")


@pytest.mark.parametrize("flag, value, needles", [
    ("--dtypes", "fp64", ("'fp64'", "bf16, fp16, fp32, int8, int4")),
    ("--dtypes", "bf16,", ("''",)),
    ("--shapes", "llama", ("'llama'", "mixtral")),
    ("--tokens", "1,x", ("'x'",)),
    ("--tokens", "0", ("from 1 to",)),
    ("--tokens", "-4", ("from 1 to",)),
    ("--tokens", "100000", ("from 1 to",)),
])
def test_bench_kernels_lists_are_checked_before_benchmarking(capsys, monkeypatch, flag: str, value: str,
                                                             needles: tuple[str, ...]) -> None:
    from tandem.autotune.bench import kernels as bench_kernels

    def never(*args, **kwargs):
        raise AssertionError("benchmarked despite a bad list")

    monkeypatch.setattr(bench_kernels, "bench_kernels", never)
    refused(capsys, ["bench", "kernels", flag, value], f"argument {flag}", *needles)


@pytest.mark.parametrize("argv", [["nosuch"], ["generate", "--no-such-flag"], ["plan", "--model", "x"],
                                  ["generate", "--dtype", "fp64", "hi"]])
def test_argparse_mistakes_are_one_error_line(capsys, argv: list[str]) -> None:
    refused(capsys, argv, "--help")


def test_good_values_still_pass() -> None:
    parser = main.__globals__["build_parser"]()
    args = parser.parse_args(["generate", "hi", "--temperature", "0.7", "--top-p", "1", "--seed", str(2**63 - 1),
                              "--cost", "2,0.5,0.2,4", "--vram-gb", "0.001", "--cache-ways", "0",
                              "--kernel-crossover", "0", "--threads", "1", "--max-new-tokens", "0"])
    assert args.seed == 2**63 - 1 and args.cost.transfer_ms == 4.0 and args.cache_ways == 0 and args.threads == 1
    assert parser.parse_args(["generate", "hi", "--vram-gb", "1e6"]).vram_gb == 1e6


# --- prompts -------------------------------------------------------------------------------------------------


def test_non_utf8_prompt_from_stdin_is_refused(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 \xff"), encoding="utf-8"))
    refused(capsys, ["generate", "--model", NO_MODEL, "-"], "not UTF-8", "byte 0xe9 at offset 3", "iconv")


def test_stdin_prompt_is_bounded(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a" * (MAX_PROMPT_BYTES + 1)), encoding="utf-8"))
    refused(capsys, ["generate", "--model", NO_MODEL, "--prompt", "-"], "longer than 4 MiB")
    monkeypatch.setattr(sys, "stdin", io.StringIO("a" * (MAX_PROMPT_BYTES + 1)))  # a text stream without bytes
    refused(capsys, ["generate", "--model", NO_MODEL, "-"], "longer than 4 MiB")


def test_byte_order_mark_is_not_part_of_the_prompt(monkeypatch) -> None:
    from tandem.app.cli.prompt_input import read_stdin

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xef\xbb\xbfhello"), encoding="utf-8"))
    assert read_stdin() == "hello"
    monkeypatch.setattr(sys, "stdin", io.StringIO("\ufeffhello"))  # a text stream without bytes beneath
    assert read_stdin() == "hello"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xef\xbb\xbfa\xff"), encoding="utf-8"))
    with pytest.raises(UsageError, match="byte 0xff at offset 4"):  # offsets still count the mark's bytes
        read_stdin()


def test_argv_prompt_with_undecodable_bytes_is_refused(capsys) -> None:
    text = os.fsdecode(b"hi \xff\xfe")  # what Python makes of such bytes in sys.argv
    refused(capsys, ["generate", "--model", NO_MODEL, text], "not UTF-8", "byte 0xff at character 3")
    refused(capsys, ["generate", "--model", NO_MODEL, "--prompt", text], "not UTF-8")


def run_cli(*args: str | bytes, stdin: object = subprocess.DEVNULL) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "tandem.app.cli.main", *args], stdin=stdin, capture_output=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])


def test_real_process_non_utf8_argv_and_endless_stdin(tmp_path: Path) -> None:
    proc = run_cli("generate", "--model", NO_MODEL, b"\xff\xfe")
    assert proc.returncode == 2 and proc.stderr.startswith(b"error: ") and b"not UTF-8" in proc.stderr
    with open("/dev/zero", "rb") as zero:  # read up to the bound, then refused: no hang, no memory blow-up
        proc = run_cli("generate", "--model", NO_MODEL, "-", stdin=zero)
    assert proc.returncode == 2 and proc.stderr.startswith(b"error: ") and b"longer than 4 MiB" in proc.stderr
    proc = run_cli("generate", "--model", NO_MODEL, "--temperature", "nan", "hi")
    assert proc.returncode == 2 and proc.stderr.startswith(b"error: argument --temperature")
    assert b"usage" not in proc.stderr and b"Traceback" not in proc.stderr


@pytest.mark.parametrize("command, needle", [
    (f"generate --model {NO_MODEL} hi >&-", b"error: standard output is closed"),
    ("probe >&-", b"error: standard output is closed"),
    (f"generate --model {NO_MODEL} - <&-", b"error: standard input is closed"),
    (f"generate --model {NO_MODEL} --prompt - <&-", b"error: standard input is closed"),
])
def test_closed_standard_streams(command: str, needle: bytes) -> None:
    proc = subprocess.run(f"{sys.executable} -m tandem.app.cli.main {command}", shell=True, capture_output=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(needle) and proc.stderr.count(b"\n") == 1, proc.stderr
