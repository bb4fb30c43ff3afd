"""The tokenizer files are read only if they are regular files of a bounded size (a FIFO would block, a link to
/dev/zero would fill memory), and odd values in them are ignored or refused with a CheckpointError, never a
traceback. A bad chat template matters only when a chat is rendered."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tandem.kernels.errors import CheckpointError
from tandem.runtime.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.fixture
def folder(mixtral_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(mixtral_dir, tmp_path / "m"))


def write_config(folder: Path, **changes: object) -> None:
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("value", [{"content": 5}, {"content": ["a"]}, {"content": None}, 7, ["</s>"], {}],
                         ids=repr)
def test_special_tokens_that_are_not_text_are_ignored(folder: Path, value: object) -> None:
    write_config(folder, eos_token=value, bos_token=value)
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token is None and tok.bos_token is None and tok.eos_token_id is None


@pytest.mark.parametrize("value", [
    [{"name": ["x"], "template": "hi"}], [{"name": "default", "template": ["hi"]}], [{"name": "default"}],
    ["default"], [{"name": {}, "template": {}}]], ids=repr)
def test_malformed_named_templates_matter_only_when_used(folder: Path, value: object) -> None:
    write_config(folder, chat_template=value)
    tok = Tokenizer.from_folder(folder)
    assert tok.encode("hi")
    with pytest.raises(CheckpointError, match="chat_template"):
        tok.render_chat(CHAT)


def test_named_templates_pick_the_default(folder: Path) -> None:
    write_config(folder, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert Tokenizer.from_folder(folder).render_chat(CHAT) == "D"


def test_deeply_nested_tokenizer_config(folder: Path) -> None:
    (folder / "tokenizer_config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_folder(folder)


def make_odd(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "too big":
        with path.open("wb") as f:
            f.truncate(1 << 30)  # sparse: no disk used
    else:
        path.symlink_to(kind)


ODD = ["fifo", "folder", "too big", "/dev/zero", "/dev/urandom"]


@pytest.mark.parametrize("kind", ODD)
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_odd_tokenizer_files_are_refused(folder: Path, name: str, kind: str) -> None:
    make_odd(folder / name, kind)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=name):
        Tokenizer.from_folder(folder)
    assert time.monotonic() - start < 20  # refused, not read: a FIFO or /dev/zero read would never end


@pytest.mark.parametrize("kind", ODD)
def test_an_odd_template_file_matters_only_with_chat(folder: Path, kind: str) -> None:
    make_odd(folder / "chat_template.jinja", kind)
    tok = Tokenizer.from_folder(folder)
    assert tok.encode("hi")
    with pytest.raises(CheckpointError, match="chat_template.jinja"):
        tok.render_chat(CHAT)
