"""A seeded, bounded fuzzer over GGUF headers (metadata and tensor table) and Ollama manifests: every mutated file
either loads, with a tensor table the gguf package's reference reader agrees is sound, or is refused by name
(CheckpointError, or UnsupportedModelError for an architecture renamed); a scan lists it, damaged or not, and never
follows a manifest outside its store. Never another exception, never a hang.

The default run is a few hundred cases; a longer one: `TANDEM_FUZZ_CASES=100000 .venv/bin/python -m pytest
tests/test_gguf_fuzz.py` (`TANDEM_FUZZ_SEED` picks another sequence)."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path

import gguf
import pytest

from tandem.kernels.errors import CheckpointError, UnsupportedModelError
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.discover import Stores, describe_gguf, discover, ollama_models
from tandem.runtime.gguf_header import header_of
from tests.ggufs import gguf_layout, tiny_moe_gguf

CASES = int(os.environ.get("TANDEM_FUZZ_CASES", "300"))
SEED = int(os.environ.get("TANDEM_FUZZ_SEED", "1128"))
INTERESTING = [0, 1, 2, 3, 7, 31, 32, 33, 63, 64, 65, 255, 4096, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40,
               1 << 62, 1 << 63, (1 << 64) - 1, (1 << 64) - 32]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe_gguf(tmp_path_factory.mktemp("fuzz"))


def mutate(rng: random.Random, data: bytes, layout: dict[str, int]) -> tuple[bytes, list[str]]:
    """1 to 3 mutations of a valid file, each named (for the failure message)."""
    out = bytearray(data)
    done: list[str] = []
    header_end = layout["data"]
    u64s = [k for k in layout if k.split(":")[0] in ("key", "count", "name", "dims", "offset")] + \
        ["tensor_count", "kv_count"]
    u32s = [k for k in layout if k.split(":")[0] in ("type", "ndims")]
    offsets = [k for k in layout if k.startswith("offset:")]
    names = [k for k in layout if k.startswith("name:")]
    cut: int | None = None
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["truncate", "flip", "u64", "u32", "offset", "duplicate", "flip"])
        if kind == "truncate":
            cut = rng.choice([rng.randrange(header_end), rng.randrange(len(out))])
            done.append(f"cut at {cut}")
        elif kind == "flip":
            at = rng.randrange(header_end)
            out[at] = rng.randrange(256)
            done.append(f"byte {at} = {out[at]}")
        elif kind == "u64":
            key = rng.choice(u64s)
            old = struct.unpack_from("<Q", out, layout[key])[0]
            value = rng.choice([*INTERESTING, old + 1, max(old - 1, 0), old * 2, rng.getrandbits(64)])
            struct.pack_into("<Q", out, layout[key], value % (1 << 64))
            done.append(f"{key} = {value}")
        elif kind == "u32":
            key = rng.choice(u32s)
            value = rng.choice([rng.randrange(45), 9, 13, 99, (1 << 32) - 1, 0, 5])
            struct.pack_into("<I", out, layout[key], value)
            done.append(f"{key} = {value}")
        elif kind == "offset":
            key, other = rng.choice(offsets), rng.choice(offsets)
            old = struct.unpack_from("<Q", out, layout[key])[0]
            value = rng.choice([struct.unpack_from("<Q", out, layout[other])[0], old + 32, old - 32, old + 1,
                                old + 4, 0])
            struct.pack_into("<Q", out, layout[key], value % (1 << 64))
            done.append(f"{key} = {value} (from {old})")
        else:  # a name given twice: another tensor's name of the same length written over one
            a, b = rng.sample(names, 2)
            la, lb = (struct.unpack_from("<Q", out, layout[k])[0] for k in (a, b))
            if la == lb:
                out[layout[a] + 8 : layout[a] + 8 + la] = out[layout[b] + 8 : layout[b] + 8 + lb]
                done.append(f"{a} renamed as {b}")
    return bytes(out[:cut] if cut is not None else out), done


def check_sound(path: Path) -> None:
    """A file Tandem loaded: the reference reader parses the same table, and it is sound (unique names, each
    tensor aligned, inside the file, none overlapping another)."""
    reader = gguf.GGUFReader(str(path))
    ours = header_of(path)
    theirs = [(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset)) for t in reader.tensors]
    assert theirs == [(t.name, t.type_id, t.dims, t.offset) for t in ours.tensors]
    assert len({t.name for t in ours.tensors}) == len(ours.tensors)
    end = 0
    for t in sorted(ours.tensors, key=lambda t: t.offset):
        assert (t.offset - ours.data_start) % ours.alignment == 0 and t.offset >= end
        end = t.offset + t.nbytes
    assert end <= path.stat().st_size


def test_mutated_headers_load_soundly_or_are_refused(tiny: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    data, layout = tiny.read_bytes(), gguf_layout(tiny)
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(CASES):
        raw, done = mutate(rng, data, layout)
        path = tmp_path / "case.gguf"
        path.write_bytes(raw)
        try:
            open_checkpoint(path)
        except (CheckpointError, UnsupportedModelError):
            outcomes["refused"] += 1
        except Exception as e:  # noqa: BLE001 - the failure names the case
            pytest.fail(f"case {case} (seed {SEED}: {'; '.join(done)}) raised {e!r}")
        else:
            outcomes["loaded"] += 1
            check_sound(path)
        entry = describe_gguf(path, "folder")  # a scan lists it (damaged or not), never raises
        assert entry is not None and (entry.problem is None or not entry.runs), done
    assert outcomes["refused"] > CASES // 2  # the mutations reach the checks


DIGESTS = ["sha256:" + "c" * 64, "sha256-" + "c" * 64, "sha256:../../../outside.gguf", "sha256:" + "c" * 63,
           "sha256:" + "C" * 64, "/etc/passwd", "sha256:" + "c" * 64 + "/../x", "sha256:\u0000" + "c" * 63, "", 5,
           None, ["x"], "sha512:" + "c" * 64, "sha256:" + "c" * 10_000]


def manifest(rng: random.Random) -> str:
    """A manifest, valid or not: its digest, layers and structure varied, sometimes cut, flipped or nested deeply."""
    layer: object = {"mediaType": "application/vnd.ollama.image.model", "digest": rng.choice(DIGESTS)}
    layers = rng.choice([[layer], layer, "layers", 7, [None, layer], [], None])
    text = json.dumps(rng.choice([{"schemaVersion": 2, "layers": layers}, [layers], layers]))
    change = rng.randrange(5)
    if change == 0:
        text = text[: rng.randrange(len(text) + 1)]
    elif change == 1 and text:
        at = rng.randrange(len(text))
        text = text[:at] + chr(rng.randrange(32, 127)) + text[at + 1 :]
    elif change == 2:
        depth = rng.choice([10, 1000, 100_000])
        text = "[" * depth + text + "]" * depth
    return text


def test_mutated_manifests_list_only_blobs_inside_the_store(tiny: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    store = tmp_path / "ollama"
    (store / "blobs").mkdir(parents=True)
    shutil.copy(tiny, store / "blobs" / f"sha256-{'c' * 64}")
    shutil.copy(tiny, tmp_path / "outside.gguf")
    blobs = (store / "blobs").resolve()
    for case in range(max(CASES // 10, 10)):
        shutil.rmtree(store / "manifests", ignore_errors=True)
        texts = [manifest(rng) for _ in range(3)]
        for i, text in enumerate(texts):
            path = store / "manifests" / "registry.ollama.ai" / "library" / f"m{i}" / "latest"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, errors="surrogateescape")
        try:
            found = ollama_models(store)
            entries = discover([], None, Stores(None, [], [store]))
        except Exception as e:  # noqa: BLE001 - the failure names the case
            pytest.fail(f"case {case} (seed {SEED}: manifests {[t[:200] for t in texts]}) raised {e!r}")
        assert all(m.blob.resolve().is_relative_to(blobs) for m in found if m.blob is not None), texts
        assert len(entries) == len(found)
        assert all(e.runs == (m.blob is not None) for e, m in zip(entries, found, strict=True)), texts
        assert all(e.problem for e in entries if not e.runs), texts
