"""Prefixes kept on disk across restarts (runtime/prefix_disk.py, `--prefix-disk-gb`): a conversation written when
the program is done with it comes back from its file after a restart, answering as the whole prompt does (fp32,
greedy); a damaged, foreign or stale file is removed with a notice and never read into a cache; the folder stays
within its budget."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch

from tandem.app.chat.backend import RuntimeBackend
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.loader import LoadedModel, load_model, prefix_key
from tandem.runtime.prefix import PrefixStore
from tandem.runtime.prefix_disk import SUFFIX, DiskPrefixes, default_folder
from tandem.runtime.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
TALK = [5, 17, 99, 3, 42, 7, 81, 64, 23, 11, 58, 31, 2] * 4  # 52 tokens: past SAVE_LEAST


def restarted(loaded: LoadedModel, folder: Path, notes: list[str] | None = None) -> Engine:
    """A new engine as a restarted program has it: the KV cache holding nothing, the disk's index read again."""
    loaded.model.cache.held.forget()
    disk = DiskPrefixes(folder, 1 << 30, None if notes is None else notes.append)
    return Engine(loaded.model, (), True, PrefixStore(0, disk))


@pytest.mark.parametrize("case", ["mixtral", "mixtral-sliding", "deepseek_v3", "phimoe-longrope-nobias",
                                  "gemma4_text",  # (Gemma 4: a KV cache of two head shapes)
                                  "qwen3_next", "lfm2_moe", "granitemoehybrid"])  # (the hybrids: a recurrent state)
def test_a_conversation_comes_back_from_disk_after_a_restart(hf_checkpoints: dict[str, Path], case: str,
                                                             tmp_path: Path) -> None:
    loaded = load_model(hf_checkpoints[case], dtype="fp32")
    first = restarted(loaded, tmp_path)
    answer = list(first.generate(TALK, GREEDY))
    first.persist()
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1
    prompt = TALK + answer + [19, 4, 77]
    engine, stats = restarted(loaded, tmp_path), GenerationStats()
    got = list(engine.generate(prompt, GREEDY, stats))
    assert stats.cached_tokens == len(TALK) + len(answer) - 1  # (the answer's last token was never fed)
    assert engine.store is not None and engine.store.from_disk == stats.cached_tokens
    loaded.model.cache.held.forget()
    assert got == list(Engine(loaded.model, ()).generate(prompt, GREEDY)), case


def test_a_damaged_foreign_or_unreadable_file_is_removed_with_a_notice(hf_checkpoints: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    loaded = load_model(hf_checkpoints["mixtral"], dtype="fp32")
    prompt = TALK + [8, 9]
    want = list(Engine(loaded.model, ()).generate(prompt, GREEDY))

    def saved() -> Path:
        engine = restarted(loaded, tmp_path)
        list(engine.generate(TALK, GREEDY))
        engine.persist()
        (path,) = tmp_path.glob(f"*{SUFFIX}")
        return path

    def reopened() -> tuple[list[int], int, list[str]]:
        notes: list[str] = []
        stats = GenerationStats()
        got = list(restarted(loaded, tmp_path, notes).generate(prompt, GREEDY, stats))
        return got, stats.cached_tokens, notes

    # a bit flipped in the tensors' bytes: the checksum sees it
    path = saved()
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    path.write_bytes(bytes(data))
    got, cached, notes = reopened()
    assert got == want and cached == 0 and not path.exists()
    assert any("checksum" in n for n in notes), notes
    # another model's cache (its shapes): not read into this one
    path = saved()
    data = path.read_bytes()
    length = int.from_bytes(data[8:16], "little")  # (then the header's CRC-32, then the header)
    header = json.loads(data[20 : 20 + length])
    header["parts"][0]["shape"][-1] += 1
    text = json.dumps(header).encode()
    assert len(text) <= length
    foreign = data[:8] + len(text).to_bytes(8, "little") + zlib.crc32(text).to_bytes(4, "little") + text
    path.write_bytes(foreign + data[len(foreign) :])
    got, cached, notes = reopened()
    assert got == want and cached == 0 and not path.exists() and any("not what this model" in n for n in notes)
    # a header damaged in place: its own checksum sees it
    path = saved()
    data = bytearray(path.read_bytes())
    data[30] ^= 0x01
    path.write_bytes(bytes(data))
    got, cached, notes = reopened()
    assert got == want and cached == 0 and not path.exists() and any("header is damaged" in n for n in notes)
    # not a cache at all, and a cut-off one
    path = saved()
    path.write_bytes(path.read_bytes()[:200])
    (tmp_path / f"junk{SUFFIX}").write_bytes(b"not a cache")
    got, cached, notes = reopened()
    assert got == want and cached == 0 and list(tmp_path.glob(f"*{SUFFIX}")) == []
    assert len(notes) == 2 and all("removed" in n for n in notes), notes
    assert any("not a Tandem conversation cache" in n for n in notes) and any("damaged" in n for n in notes)


def test_the_folder_keeps_the_recently_used_within_its_budget(tmp_path: Path) -> None:
    parts = (torch.randn(2, 2, 40, 4), torch.randn(2, 2, 40, 4))  # [layers, Hkv, n, D] as KVCache.snapshot
    disk = DiskPrefixes(tmp_path, 1 << 30)
    a, b = torch.arange(40), torch.arange(100, 140)
    disk.write(a[:30], False, tuple(p[:, :, :30] for p in parts))
    disk.write(a, False, parts)  # (the shorter one, a prefix of it, is useless now)
    assert [len(e.tokens) for e in disk.entries] == [40]
    size = disk.entries[0].nbytes
    assert size == (tmp_path / disk.entries[0].path.name).stat().st_size
    disk.write(b, False, parts)
    disk.write(a, False, parts)  # (held already: nothing written)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2
    entry, n = disk.best(torch.cat([a, torch.tensor([7])]), False)
    assert entry is not None and n == 40 and disk.best(a, True) == (None, 0)
    disk.touch(entry)  # a is the most recently used now: b goes first
    assert [int(e.tokens[0]) for e in disk.entries] == [100, 0]
    for e, when in zip(disk.entries, (1, 2), strict=True):  # (as touch leaves them, on any clock's resolution)
        os.utime(e.path, ns=(when * 10**9, when * 10**9))
    small = DiskPrefixes(tmp_path, 2 * size)
    small.write(torch.arange(200, 240), False, parts)
    left = sorted(int(e.tokens[0]) for e in DiskPrefixes(tmp_path, 2 * size).entries)
    assert left == [0, 200]
    read = small.read(small.best(torch.cat([a, torch.tensor([7])]), False)[0], (parts[0][:, :, :1],) * 2)
    assert read is not None and torch.equal(read[0], parts[0]) and torch.equal(read[1], parts[1])


def test_the_key_follows_the_weights_and_the_settings(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(hf_checkpoints["mixtral"], folder)
    fp32, bf16 = load_model(folder, dtype="fp32"), load_model(folder, dtype="bf16")
    assert prefix_key(fp32.checkpoint, fp32.options) != prefix_key(bf16.checkpoint, bf16.options)
    before = prefix_key(fp32.checkpoint, fp32.options)
    shard = next(folder.glob("*.safetensors"))
    os.utime(shard, ns=(0, 0))  # (rewritten: another modification time)
    assert prefix_key(fp32.checkpoint, fp32.options) != before


def test_the_chat_app_keeps_its_conversation_when_it_closes(hf_checkpoints: dict[str, Path]) -> None:
    loaded = load_model(hf_checkpoints["mixtral"], dtype="fp32", prefix_disk_gb=1.0)
    assert loaded.options.prefix_disk == 1 << 30 and loaded.engine.store is not None
    folder = default_folder(prefix_key(loaded.checkpoint, loaded.options))
    list(loaded.engine.generate(TALK, GREEDY))
    RuntimeBackend(loaded).close()
    assert len(list(folder.glob(f"*{SUFFIX}"))) == 1
    off = load_model(hf_checkpoints["mixtral"], dtype="fp32")
    assert off.options.prefix_disk == 0 and (off.engine.store is None or off.engine.store.disk is None)


def test_bench_reopen_measures_the_reopened_and_the_dropped(hf_checkpoints: dict[str, Path], tmp_path: Path,
                                                            tandem_home: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    from tandem.app.cli.main import main

    out = tmp_path / "reopen.json"
    assert main(["bench", "chat", "--reopen", "64", "--model", str(hf_checkpoints["mixtral"]), "--dtype", "fp32",
                 "--repeats", "1", "--no-profile", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cached_tokens"] == 64 and result["conversation_tokens"] == 64  # (the whole conversation reused)
    assert len(result["ttft_reopened_s"]) == len(result["ttft_dropped_s"]) == 1 and result["file_bytes"] > 0
    assert not list(tandem_home.rglob(f"*{SUFFIX}"))  # (its folder was a temporary one, not the user's cache)
    assert main(["bench", "chat", "--reopen", "64", "--context", "100", "--model", str(hf_checkpoints["mixtral"]),
                 "--no-profile"]) == 2
    assert "needs --context of at least 128" in capsys.readouterr().err


def test_a_file_taken_for_a_prompt_serves_it_even_when_saving_the_row_makes_room_by_removing_it(
        hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Room for one conversation: the row's (B) is saved as A's file is read back, and A's file goes for B's room;
    A's prompt still gets A's cache (mapped before the save), and answers as the whole prompt does."""
    loaded = load_model(hf_checkpoints["mixtral"], dtype="fp32")
    engine = restarted(loaded, tmp_path)
    list(engine.generate(TALK, GREEDY))
    engine.persist()
    (first,) = tmp_path.glob(f"*{SUFFIX}")
    room = first.stat().st_size + first.stat().st_size // 2
    loaded.model.cache.held.forget()
    notes: list[str] = []
    engine = Engine(loaded.model, (), True, PrefixStore(0, DiskPrefixes(tmp_path, room, notes.append)))
    other = [t + 1 for t in TALK]
    list(engine.generate(other, GREEDY))  # (the row holds B now)
    stats = GenerationStats()
    got = list(engine.generate(TALK + [8], GREEDY, stats))
    assert stats.cached_tokens == len(TALK) and not notes, notes
    assert not first.exists() and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1  # (B's, in A's room)
    loaded.model.cache.held.forget()
    assert got == list(Engine(loaded.model, ()).generate(TALK + [8], GREEDY))
