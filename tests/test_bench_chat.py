"""`tandem bench chat`: the chat app driven headless against the bare stream on one model, alternating; the same
tokens either way, and figures for each round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.app.cli.main import main


def test_the_app_and_the_bare_stream_decode_the_same_answer(mixtral_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chat.json"
    assert main(["bench", "chat", "--model", str(mixtral_dir), "--new-tokens", "12", "--repeats", "2",
                 "--dtype", "fp32", "--json", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == result
    assert len(result["rounds"]) == 2 and result["generate_decode_tok_s"] > 0 and result["chat_decode_tok_s"] > 0
    ratios = [r["chat"]["decode_tok_s"] / r["generate"]["decode_tok_s"] for r in result["rounds"]]
    assert result["ratios"] == [round(r, 3) for r in ratios]
    assert result["chat_over_generate"] == round((ratios[0] + ratios[1]) / 2, 3)  # (the median of two)
    for row in result["rounds"]:  # greedy, one token bound: the same answer either way
        assert row["chat"]["tokens"] == row["generate"]["tokens"] == 12


def test_it_never_touches_the_users_conversations(mixtral_dir: Path, tandem_home: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(p.relative_to(tandem_home) for p in tandem_home.rglob("*"))
    assert main(["bench", "chat", "--model", str(mixtral_dir), "--new-tokens", "4", "--repeats", "1",
                 "--dtype", "fp32"]) == 0
    capsys.readouterr()
    assert sorted(p.relative_to(tandem_home) for p in tandem_home.rglob("*")) == before


def test_a_conversation_typed_into_the_app_reuses_each_turns_history(mixtral_dir: Path, tandem_home: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(p.relative_to(tandem_home) for p in tandem_home.rglob("*"))
    assert main(["bench", "chat", "--turns", "3", "--app", "--words", "6", "--new-tokens", "4", "--model",
                 str(mixtral_dir), "--dtype", "fp32"]) == 0
    result = json.loads(capsys.readouterr().out)
    turns = result["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and turns[0]["cached"] == 0
    for earlier, later in zip(turns, turns[1:], strict=False):  # each turn's prompt holds the one before it
        assert later["prompt_tokens"] > earlier["prompt_tokens"] and later["cached"] >= earlier["prompt_tokens"]
    assert "last_over_second" in result
    assert sorted(p.relative_to(tandem_home) for p in tandem_home.rglob("*")) == before
    assert main(["bench", "chat", "--app", "--model", str(mixtral_dir)]) == 2
    assert "give --turns N too" in capsys.readouterr().err
