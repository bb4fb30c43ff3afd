"""CLI behaviour beyond parity: streaming text output, summary line, test-model writer, bench JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli import main


def test_generate_streams_text_and_prints_summary(mixtral_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(mixtral_dir), "--prompt", "Hello", "--chat", "--max-new-tokens", "8",
                 "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "prompt tokens" in err and "new tokens" in err and "tok/s" in err and "first token" in err


def test_json_has_the_documented_keys(mixtral_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(mixtral_dir), "--prompt", "Hello", "--max-new-tokens", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"prompt_tokens", "tokens", "text", "stats"}
    assert set(result["stats"]) >= {"ttft_s", "decode_tok_s", "prompt_tok_s", "new_tokens"}
    assert result["stats"]["new_tokens"] == len(result["tokens"])


def test_make_test_model_then_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "qwen"
    assert main(["make-test-model", "--family", "qwen2_moe", "--out", str(out)]) == 0
    assert main(["generate", "--model", str(out), "--prompt", "Hi", "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["stats"]["prompt_tokens"] > 0


def test_make_test_model_rejects_unknown_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-test-model", "--family", "gpt2", "--out", str(tmp_path / "x")]) == 2
    assert "not supported" in capsys.readouterr().err


def test_bench_decode_prints_json_with_ratio(mixtral_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "decode", "--model", str(mixtral_dir), "--new-tokens", "4", "--repeats", "1",
                 "--dtype", "fp32", "--peer", "transformers"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["decode_tok_s"]) == {"tandem", "transformers"}
    assert result["ratio"] > 0


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "generate" in capsys.readouterr().out
