"""Hostile GGUF files and stores, one class of damage a test: each file is refused by name (CheckpointError), never
with another exception, a hang or a silent load of a corrupt table; a scan lists the damaged model with why and
every other model beside it."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from tandem.app.cli.main import main
from tandem.kernels.errors import CheckpointError
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.discover import Stores, discover, ollama_models
from tandem.runtime.gguf import GGUFFile
from tandem.runtime.gguf_header import ARRAY_MOST, GGUFArray, header_of
from tests.ggufs import fake_stores, gguf_layout, patched, rewrite_gguf, tiny_moe_gguf, write_gguf

V = gguf.GGUFValueType
U32, U64 = "<I", "<Q"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid qwen3moe GGUF file (float32), 8 experts a layer."""
    return tiny_moe_gguf(tmp_path_factory.mktemp("hostile"))


def refused(path: Path, *words: str) -> str:
    with pytest.raises(CheckpointError) as caught:
        open_checkpoint(path)
    message = str(caught.value)
    assert all(w in message for w in words), message
    return message


def within(seconds: float, call: Callable[[], object]) -> object:
    """call() in a thread: it must end (a FIFO or a huge count must not block or grind)."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except Exception as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "it blocked"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


def pack(fmt: str, value: int) -> bytes:
    return struct.pack(fmt, value)


def test_the_valid_file_loads(tiny: Path) -> None:
    ckpt = open_checkpoint(tiny)
    assert ckpt.config.num_experts == 8
    assert isinstance(header_of(tiny).meta["tokenizer.ggml.tokens"], GGUFArray)


def test_every_truncation_is_refused(tiny: Path, tmp_path: Path) -> None:
    layout = gguf_layout(tiny)
    last_end = max(int(t.data_offset) + int(t.n_bytes) for t in gguf.GGUFReader(str(tiny)).tensors)
    cuts = sorted({0, 3, 4, 8, 20, 24, *(v + d for v in layout.values() for d in (0, 1, 5)), last_end - 1,
                   (layout["data"] + last_end) // 2})
    assert len(cuts) > 100
    for cut in cuts:
        if cut < last_end:
            refused(patched(tiny, tmp_path / "cut.gguf", [], cut), str(tmp_path / "cut.gguf"))


ABSURD = {  # field -> (struct format, value): counts and lengths far past the file
    "tensor_count": (U64, 1 << 62), "kv_count": (U64, 1 << 40), "key:qwen3moe.block_count": (U64, 1 << 60),
    "value:tokenizer.chat_template": (U64, (1 << 64) - 1), "count:tokenizer.ggml.tokens": (U64, 1 << 50),
    "count:tokenizer.ggml.merges": (U64, 3_000_000), "ndims:blk.0.attn_q.weight": (U32, 5),
    "name:blk.0.attn_q.weight": (U64, 1 << 33), "dims:blk.0.attn_q.weight": (U64, 1 << 63),
}


@pytest.mark.parametrize("field", list(ABSURD))
def test_absurd_counts_and_lengths_are_refused_at_once(tiny: Path, tmp_path: Path, field: str) -> None:
    fmt, value = ABSURD[field]
    out = patched(tiny, tmp_path / "absurd.gguf", [(gguf_layout(tiny)[field], pack(fmt, value))])
    within(20, lambda: refused(out, "not a valid GGUF file"))


TYPE_IDS = {"type:qwen3moe.block_count": 13, "type:general.architecture": 99, "value:tokenizer.ggml.tokens": 77,
            "value:tokenizer.ggml.merges": 9, "type:blk.0.attn_q.weight": 99, "type:blk.0.attn_k.weight": 4}


@pytest.mark.parametrize("field", list(TYPE_IDS))
def test_type_ids_out_of_range_or_nested_arrays_are_refused(tiny: Path, tmp_path: Path, field: str) -> None:
    out = patched(tiny, tmp_path / "type.gguf", [(gguf_layout(tiny)[field], pack(U32, TYPE_IDS[field]))])
    refused(out, "type")


def test_nested_arrays_are_refused(tiny: Path, tmp_path: Path) -> None:
    out = rewrite_gguf(tiny, tmp_path / "nested.gguf", {"general.tags": ([[1, 2], [3]], V.ARRAY)})
    refused(out, "general.tags", "array of arrays")


WRONG_TYPES = {
    "qwen3moe.block_count": [(2.0, V.FLOAT32), (True, V.BOOL), ("2", V.STRING), ([2, 2], V.ARRAY)],
    "qwen3moe.expert_count": [(8.9, V.FLOAT64), ("8", V.STRING)],
    "qwen3moe.attention.layer_norm_rms_epsilon": [("1e-6", V.STRING), (True, V.BOOL)],
    "qwen3moe.expert_weights_norm": [("yes", V.STRING)],
    "general.architecture": [(7, V.UINT32)],
    "tokenizer.ggml.eos_token_id": [(1.5, V.FLOAT32)],
}


@pytest.mark.parametrize("key,value,kind", [(k, v, t) for k, vs in WRONG_TYPES.items() for v, t in vs])
def test_metadata_of_the_wrong_type_is_refused_by_name(tiny: Path, tmp_path: Path, key: str, value: object,
                                                       kind: gguf.GGUFValueType) -> None:
    out = rewrite_gguf(tiny, tmp_path / "typed.gguf", {key: (value, kind)})
    refused(out, key)


ABSURD_VALUES = {"qwen3moe.block_count": [10**9, 0, 3], "qwen3moe.expert_count": [0, 9, 7],
                 "qwen3moe.attention.head_count": [0, 1 << 30], "qwen3moe.expert_used_count": [0, 100]}


@pytest.mark.parametrize("key,value", [(k, v) for k, vs in ABSURD_VALUES.items() for v in vs])
def test_absurd_config_values_are_refused_at_once(tiny: Path, tmp_path: Path, key: str, value: int) -> None:
    out = rewrite_gguf(tiny, tmp_path / "value.gguf", {key: (value, V.UINT32)})
    within(20, lambda: refused(out))


def test_an_embedding_not_of_the_vocabulary_is_refused(tiny: Path, tmp_path: Path) -> None:
    out = rewrite_gguf(tiny, tmp_path / "embed.gguf", tensors={"token_embd.weight": np.zeros((65, 64), np.float32)})
    refused(out, "token embedding has 65 rows")


def test_a_tensor_of_another_shape_is_refused(tiny: Path, tmp_path: Path) -> None:
    out = rewrite_gguf(tiny, tmp_path / "shape.gguf", tensors={"blk.0.attn_q.weight": np.zeros((3, 64), np.float32)})
    refused(out, "blk.0.attn_q.weight")


def _offsets(tiny: Path) -> dict[str, Callable[[dict[str, int], list[gguf.ReaderTensor]], list[tuple[int, bytes]]]]:
    def rel(t: gguf.ReaderTensor, data: int) -> int:
        return int(t.data_offset) - data

    return {
        "wraps past 2^64": lambda lay, ts: [(lay[f"offset:{ts[1].name}"], pack(U64, (1 << 64) - 32))],
        "misaligned": lambda lay, ts: [(lay[f"offset:{ts[1].name}"], pack(U64, rel(ts[1], lay["data"]) + 4))],
        "overlapping": lambda lay, ts: [(lay[f"offset:{ts[2].name}"], pack(U64, rel(ts[1], lay["data"])))],
        "past the end": lambda lay, ts: [(lay[f"offset:{ts[-1].name}"], pack(U64, tiny.stat().st_size))],
        "type reads the neighbour's bytes": lambda lay, ts: [(lay[f"type:{ts[1].name}"],
                                                              pack(U32, int(gguf.GGMLQuantizationType.F64)))],
        "last type past the end": lambda lay, ts: [(lay[f"type:{ts[-1].name}"],
                                                    pack(U32, int(gguf.GGMLQuantizationType.F64)))],
        "one tensor too many": lambda lay, ts: [(lay["tensor_count"], pack(U64, len(ts) + 1))],
        "one tensor too few": lambda lay, ts: [(lay["tensor_count"], pack(U64, len(ts) - 1))],
        "duplicate name": lambda lay, ts: [(lay["name:blk.0.attn_q.weight"] + 8, b"blk.0.attn_k.weight")],
        "a dimension grown": lambda lay, ts: [(lay[f"dims:{ts[0].name}"], pack(U64, 128))],
    }


@pytest.mark.parametrize("case", ["wraps past 2^64", "misaligned", "overlapping", "past the end",
                                  "type reads the neighbour's bytes", "last type past the end", "one tensor too many",
                                  "one tensor too few", "duplicate name", "a dimension grown"])
def test_a_corrupt_tensor_table_is_refused(tiny: Path, tmp_path: Path, case: str) -> None:
    tensors = gguf.GGUFReader(str(tiny)).tensors
    edits = _offsets(tiny)[case](gguf_layout(tiny), tensors)
    refused(patched(tiny, tmp_path / "table.gguf", edits))


def test_a_type_that_reads_the_neighbours_bytes_is_refused(tiny: Path, tmp_path: Path) -> None:
    """F16 stored, F32 claimed: the tensor would read its own bytes and as many of the next one's."""
    f16 = tmp_path / "f16.gguf"
    write_gguf(tiny.parent / "hf", f16, "F16")
    tensors = gguf.GGUFReader(str(f16)).tensors
    victim = next(t for i, t in enumerate(tensors[:-1]) if t.tensor_type == gguf.GGMLQuantizationType.F16)
    edit = (gguf_layout(f16)[f"type:{victim.name}"], pack(U32, int(gguf.GGMLQuantizationType.F32)))
    refused(patched(f16, tmp_path / "wide.gguf", [edit]), victim.name)


def test_a_split_model_naming_a_tensor_twice_is_refused(tiny: Path, tmp_path: Path) -> None:
    for part in (1, 2):
        shutil.copy(tiny, tmp_path / f"m-0000{part}-of-00002.gguf")
    with pytest.raises(CheckpointError, match="more than one part"):
        GGUFFile(tmp_path / "m-00001-of-00002.gguf")


def test_unneeded_arrays_are_skipped_and_bounded(tiny: Path, tmp_path: Path) -> None:
    out = rewrite_gguf(tiny, tmp_path / "big.gguf", {"general.junk": ([f"s{i}" for i in range(50_000)], V.ARRAY)})
    assert header_of(out).meta["general.junk"] == GGUFArray(int(V.STRING), 50_000)  # walked, not built
    open_checkpoint(out)
    count = gguf_layout(out)["count:general.junk"]
    refused(patched(out, tmp_path / "huge.gguf", [(count, pack(U64, ARRAY_MOST + 1))]), "general.junk")


def test_what_is_not_a_regular_file_is_refused_without_blocking(tiny: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    within(20, lambda: refused(fifo))  # (open_checkpoint: "is a file"; the reader itself, below)
    (tmp_path / "a.gguf").symlink_to(tmp_path / "b.gguf")
    (tmp_path / "b.gguf").symlink_to(tmp_path / "a.gguf")
    refused(tmp_path / "a.gguf")
    (tmp_path / "folder.gguf").mkdir()
    refused(tmp_path / "folder.gguf")
    for path in (fifo, tmp_path / "folder.gguf"):
        with pytest.raises(CheckpointError, match="not a regular file"):
            within(20, lambda p=path: GGUFFile(p))  # type: ignore[misc]
    with pytest.raises(CheckpointError, match="cannot open"):
        GGUFFile(tmp_path / "a.gguf")


def test_a_huge_sparse_file_is_refused_at_once(tmp_path: Path) -> None:
    sparse = tmp_path / "sparse.gguf"
    with sparse.open("wb") as f:
        f.write(b"GGUF" + pack(U32, 3) + pack(U64, 1 << 40) + pack(U64, 1 << 40))
        try:
            f.truncate(200 << 30)
        except OSError:
            pytest.skip("this filesystem holds no 200 GB sparse file")
    within(20, lambda: refused(sparse, "metadata keys"))


# ---- scans ----------------------------------------------------------------------------------------------------


def damaged_store(home: Path, tiny: Path) -> None:
    """Beside fake_stores' good models: a damaged GGUF file and a FIFO named *.gguf in LM Studio's folder, settings
    and manifests that are damaged, nested 10^5 deep, of the wrong types or pointing outside the store."""
    lms = home / ".lmstudio" / "models" / "someone" / "Broken-GGUF"
    lms.mkdir(parents=True)
    patched(tiny, lms / "broken.gguf", [(gguf_layout(tiny)["tensor_count"], pack(U64, 1 << 62))])
    os.mkfifo(lms / "fifo.gguf")
    (home / ".lmstudio" / "settings.json").write_text("[" * 100_000 + "]" * 100_000)
    store = home / ".ollama" / "models"
    outside = home / "outside.gguf"
    shutil.copy(tiny, outside)
    deep = "[" * 100_000 + "]" * 100_000
    bad = {"deep": deep, "layers-int": json.dumps({"layers": 5}), "layers-str": json.dumps({"layers": "abc"}),
           "digest-up": json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:../../../outside.gguf"}]}),
           "digest-int": json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": 5}]}),
           "link-out": json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                               "digest": "sha256:" + "a" * 64}]}),
           "truncated": json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:" + "b" * 64}]})}
    for name, text in bad.items():
        manifest = store / "manifests" / "registry.ollama.ai" / "library" / name / "latest"
        manifest.parent.mkdir(parents=True)
        manifest.write_text(text)
    (store / "blobs" / f"sha256-{'a' * 64}").symlink_to(outside)
    (store / "blobs" / f"sha256-{'b' * 64}").write_bytes(tiny.read_bytes()[:5000])


def test_one_damaged_model_hides_no_other(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = Path.home()  # the tests' HOME: an empty folder of their own
    names = fake_stores(home, tiny)
    damaged_store(home, tiny)
    models = tmp_path / "models"
    models.mkdir()
    patched(tiny, models / "cut.gguf", [], 1000)
    os.mkfifo(models / "pipe.gguf")
    assert within(60, lambda: main(["models", "--models-dir", str(models), "--json"])) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    for key in ("LM Studio", "Ollama", "Ollama other", "HF cache"):
        assert rows[names[key]]["runs"] and rows[names[key]]["problem"] is None
    damaged = {n: r for n, r in rows.items() if r["problem"]}
    ggufs = {"cut", "someone/Broken-GGUF/broken.gguf", "truncated:latest"}
    manifests = {"deep": "cannot be read as JSON", "layers-int": "has no list of layers",
                 "layers-str": "has no list of layers", "digest-up": "not sha256:<64 hex digits>",
                 "digest-int": "the model blob 5, not sha256", "link-out": "leads outside the store (not followed)",
                 "gone": "is missing", "broken": "cannot be read as JSON"}
    assert set(damaged) == ggufs | {f"{n}:latest" for n in manifests}
    assert all(not r["runs"] for r in damaged.values())
    assert all("not a valid GGUF file" in damaged[n]["problem"] for n in ggufs)
    for name, why in manifests.items():
        assert why in damaged[f"{name}:latest"]["problem"], name
    store = (Path.home() / ".ollama" / "models").resolve()
    assert all(Path(r["path"]).resolve().is_relative_to(store) for r in rows.values() if r["source"] == "Ollama")
    assert not any("fifo" in n or "pipe" in n for n in rows)  # (not files: nothing to list)
    assert within(60, lambda: main(["models", "--models-dir", str(models)])) == 0
    shown = capsys.readouterr().out
    assert "cut: " in shown and "runs past the end of the file" in shown


def test_links_out_of_a_store_are_not_followed_and_splits_are_checked(tiny: Path, tmp_path: Path) -> None:
    """A manifest that is a link out of the store is not read, a blobs folder that is a link out of it holds no blob
    Tandem reads; a split file numbered past its count, or whose first part is missing, is listed as damaged; an
    LM Studio folder setting too long to look at leaves the defaults."""
    home = Path.home()
    store = home / ".ollama" / "models"
    outside = tmp_path / "outside"
    (outside / "blobs").mkdir(parents=True)
    shutil.copy(tiny, outside / "blobs" / f"sha256-{'d' * 64}")
    manifest = store / "manifests" / "registry.ollama.ai" / "library"
    (manifest / "out").mkdir(parents=True)
    (manifest / "out" / "latest").write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                                   "digest": "sha256:" + "d" * 64}]}))
    (store / "blobs").symlink_to(outside / "blobs")  # the whole blobs folder, a link out
    (outside / "m.json").write_text(json.dumps({"layers": []}))
    (manifest / "linked").mkdir()
    (manifest / "linked" / "latest").symlink_to(outside / "m.json")
    entries = {e.name: e for e in within(60, lambda: discover([], None, Stores(None, [], [store])))}
    assert not entries["out:latest"].runs and "leads outside the store" in (entries["out:latest"].problem or "")
    assert "is a link that leads outside the store (not read)" in (entries["linked:latest"].problem or "")
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny, models / "a-00001-of-00000.gguf")
    shutil.copy(tiny, models / "b-00002-of-00002.gguf")
    listed = {e.path and Path(e.path).name: e for e in discover([models], None, Stores(None, [], []))}
    assert "not a split model's part" in (listed["a-00001-of-00000.gguf"].problem or "")
    assert "b-00001-of-00002.gguf" in (listed["b-00002-of-00002.gguf"].problem or "")


def test_manifests_lead_nowhere_outside_the_store(tiny: Path) -> None:
    home = Path.home()
    fake_stores(home, tiny)
    damaged_store(home, tiny)
    store = home / ".ollama" / "models"
    found = within(60, lambda: ollama_models(store))
    blobs = (store / "blobs").resolve()
    readable = {m.name: m.blob for m in found if m.blob is not None}
    assert all(blob.resolve().is_relative_to(blobs) for blob in readable.values())
    assert set(readable) == {"qwen3:30b-a3b", "someone/tiny:latest", "truncated:latest"}
    entries = within(60, lambda: discover([], None, Stores(None, [], [store])))
    assert {e.name for e in entries if e.runs} == {"qwen3:30b-a3b", "someone/tiny:latest"}
    assert all(Path(e.path).resolve().is_relative_to(store.resolve()) for e in entries if e.path)
    assert str(home / "outside.gguf") not in " ".join(e.problem or "" for e in entries)  # (links not followed)


def test_damaged_settings_leave_the_default_folders(tmp_path: Path) -> None:
    for text in ("[" * 100_000 + "]" * 100_000, json.dumps({"downloadsFolder": 5}),
                 json.dumps({"downloadsFolder": "a\u0000b"}), "\xff\xfe", json.dumps({"downloadsFolder": ""}),
                 json.dumps({"downloadsFolder": "~no-such-user-here/models"}),
                 json.dumps({"downloadsFolder": "/" + "a" * 5000}), json.dumps({"downloadsFolder": "relative/models"})):
        (tmp_path / ".lmstudio").mkdir(exist_ok=True)
        (tmp_path / ".lmstudio" / "settings.json").write_text(text, errors="surrogateescape")
        stores = Stores.default(tmp_path, {})
        assert stores.lmstudio == [tmp_path / ".lmstudio" / "models", tmp_path / ".cache" / "lm-studio" / "models"]


def test_a_zero_dimension_does_not_let_the_others_grow(tiny: Path, tmp_path: Path) -> None:
    """The last tensor (no neighbour's offset to betray it) made [2^60, 0, ...]: no bytes, and still refused, not a
    numpy error while it is mapped."""
    last = gguf.GGUFReader(str(tiny)).tensors[-1]
    assert len(last.shape) >= 2
    at = gguf_layout(tiny)[f"dims:{last.name}"]
    dims = pack(U64, 1 << 60) + pack(U64, 0) * (len(last.shape) - 1)
    out = patched(tiny, tmp_path / "empty.gguf", [(at, dims)])
    refused(out, last.name, "dimensions")


def test_the_tokenizer_reads_only_a_checked_file(tiny: Path, tmp_path: Path) -> None:
    """transformers' GGUF reader, which the tokenizer uses, trusts the file's counts: the header is checked first."""
    from tandem.runtime.tokenizer import Tokenizer

    data = tiny.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: gguf_layout(tiny)["data"] // 2])
    with pytest.raises(CheckpointError):
        Tokenizer.from_model(cut)


@pytest.mark.parametrize("key, value, words", [
    ("tokenizer.ggml.merges", ([1, 2], V.ARRAY), "tokenizer.ggml.merges"),
    ("tokenizer.ggml.token_type", ([1, 1, 1], V.ARRAY), "tokenizer.ggml.token_type"),
    ("tokenizer.ggml.pre", (7, V.UINT32), "tokenizer.ggml.pre is not a text"),
    ("tokenizer.ggml.add_bos_token", ("yes", V.STRING), "add_bos_token is not true or false"),
    ("tokenizer.ggml.eos_token_id", (10**6, V.UINT32), "eos_token_id is 1000000"),
    ("tokenizer.ggml.model", None, "tokenizer.ggml.model is missing"),
])
def test_damaged_tokenizer_metadata_is_refused_by_name(tiny: Path, tmp_path: Path, key: str, value: object,
                                                       words: str) -> None:
    """The tokenizer's metadata is checked before transformers reads it: a list of the wrong type or length, a
    text that is a number, a flag that is a text, a special id past the vocabulary."""
    from tandem.runtime.tokenizer import Tokenizer

    out = rewrite_gguf(tiny, tmp_path / "tok.gguf", {key: value})  # type: ignore[dict-item]
    with pytest.raises(CheckpointError, match="tokenizer") as caught:
        Tokenizer.from_gguf(out)
    assert words in str(caught.value)


def test_a_vocabulary_the_tokenizer_library_refuses_is_an_error_not_a_traceback(tiny: Path, tmp_path: Path) -> None:
    from tandem.runtime.tokenizer import Tokenizer

    count = len(gguf.GGUFReader(str(tiny)).fields["tokenizer.ggml.tokens"].data)
    out = rewrite_gguf(tiny, tmp_path / "same.gguf", {"tokenizer.ggml.tokens": (["a"] * count, V.ARRAY)})
    with pytest.raises(CheckpointError, match="cannot read the tokenizer"):
        Tokenizer.from_gguf(out)
