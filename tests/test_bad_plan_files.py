"""Files named on the command line: placement and trace files (`.npz`), hardware descriptions and model
configs for `tandem plan`. Whatever is wrong with them ends in an `error:` naming it, never a traceback, a
nonsense plan or an endless loop."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tandem.app.cli.main import main
from tandem.autotune.simulate import synthetic_trace
from tandem.runtime.synth import tiny_config, write_test_model

LAYERS, EXPERTS, TOP_K = 2, 8, 2  # tiny_config("mixtral")
HW = {"cores": 8, "cpu_bandwidth_gbps": 60, "cpu_gflops": 400}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_model(tmp_path_factory.mktemp("m") / "mixtral", tiny_config("mixtral"))


@pytest.fixture(scope="module")
def good_trace(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("t") / "trace.npz"
    assert main(["generate", "--model", str(model), "--max-new-tokens", "4", "--record-trace", str(path), "hi"]) == 0
    return path


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    last = err.splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in last, err
    return last


def bad_npz(tmp_path: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the error says), for damaged or foreign trace files."""
    t = tmp_path
    cases: dict[str, tuple[Path, str]] = {}
    data = good.read_bytes()
    (t / "truncated.npz").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (t / "truncated.npz", "cannot read")
    (t / "cut-short.npz").write_bytes(data[:-30])  # the end of the zip's directory missing
    cases["cut-short"] = (t / "cut-short.npz", "cannot read")
    np.save(t / "plain.npy", np.zeros((LAYERS, EXPERTS)))
    cases["plain .npy"] = (t / "plain.npy", "single array")
    (t / "renamed.npz").write_bytes((t / "plain.npy").read_bytes())
    cases["renamed .npy"] = (t / "renamed.npz", "single array")
    (t / "empty.npz").write_bytes(b"")
    cases["empty"] = (t / "empty.npz", "cannot read")
    (t / "text.npz").write_text("not a trace")
    cases["text"] = (t / "text.npz", "cannot read")
    np.savez(t / "other-arrays.npz", x=np.zeros(3))
    cases["other arrays"] = (t / "other-arrays.npz", "lacks")
    np.savez(t / "rank.npz", prefill=np.zeros(EXPERTS), decode=np.zeros(EXPERTS), sequence=np.zeros((3, LAYERS)))
    cases["rank"] = (t / "rank.npz", "dimensions")
    np.savez(t / "strings.npz", prefill=np.full((LAYERS, EXPERTS), "a"), decode=np.full((LAYERS, EXPERTS), "a"),
             sequence=np.full((3, LAYERS, TOP_K), "a"))
    cases["strings"] = (t / "strings.npz", "<U1")
    np.savez(t / "objects.npz", prefill=np.array([None, 1], dtype=object), decode=np.zeros((LAYERS, EXPERTS)),
             sequence=np.array([None], dtype=object))
    cases["objects"] = (t / "objects.npz", "cannot read")
    np.savez(t / "shape.npz", prefill=np.zeros((5, 4), np.int64), decode=np.zeros((5, 4), np.int64),
             sequence=np.zeros((3, 5, 4), np.int32))
    cases["another model"] = (t / "shape.npz", "record a new one")
    import zipfile

    with zipfile.ZipFile(t / "garbage.npz", "w") as z:
        for name in ("prefill", "decode", "sequence"):
            z.writestr(f"{name}.npy", b"garbage")
    cases["garbage members"] = (t / "garbage.npz", "not an array")
    cases["folder"] = (t, "is a folder")
    cases["device"] = (Path("/dev/null"), "not a regular file")
    cases["missing"] = (t / "nope.npz", "missing")
    return cases


BAD_NPZ = ["truncated", "cut-short", "plain .npy", "renamed .npy", "empty", "text", "other arrays", "rank", "strings",
           "objects", "another model", "garbage members", "folder", "device", "missing"]


@pytest.mark.parametrize("case", BAD_NPZ + ["nan counts", "negative counts"])
def test_bad_placement_file(model: Path, good_trace: Path, tmp_path: Path, capsys, case: str) -> None:
    cases = bad_npz(tmp_path, good_trace)
    np.savez(tmp_path / "nan.npz", prefill=np.full((LAYERS, EXPERTS), np.nan), decode=np.zeros((LAYERS, EXPERTS)))
    cases["nan counts"] = (tmp_path / "nan.npz", "non-finite")
    np.savez(tmp_path / "neg.npz", prefill=np.full((LAYERS, EXPERTS), -5), decode=np.zeros((LAYERS, EXPERTS), int))
    cases["negative counts"] = (tmp_path / "neg.npz", "negative")
    path, needle = cases[case]
    refused(capsys, ["generate", "--model", str(model), "--max-new-tokens", "2", "--placement", str(path), "hi"],
            "placement profile", needle)


PREFILL = {  # a counts member beside a good sequence: checked as --placement checks it
    "prefill shape": (np.zeros((LAYERS + 1, EXPERTS), np.int64), "record a new one"),
    "prefill rank": (np.zeros(EXPERTS, np.int64), "dimensions"),
    "prefill negative": (np.full((LAYERS, EXPERTS), -3), "negative"),
    "prefill nan": (np.full((LAYERS, EXPERTS), np.nan), "non-finite"),
    "prefill strings": (np.full((LAYERS, EXPERTS), "a"), "<U1"),
    "prefill objects": (np.array([None, 1], dtype=object), "cannot read"),
    "decode negative": (np.full((LAYERS, EXPERTS), -3), "negative"),
}


@pytest.mark.parametrize("case", list(PREFILL))
def test_plan_trace_counts_are_checked_too(model: Path, tmp_path: Path, capsys, case: str) -> None:
    counts, needle = PREFILL[case]
    name = case.split()[0]
    np.savez(tmp_path / "t.npz", sequence=np.zeros((3, LAYERS, TOP_K), np.int32), **{name: counts})
    (tmp_path / "hw.json").write_text(json.dumps(HW))
    refused(capsys, ["plan", "--hardware", str(tmp_path / "hw.json"), "--model", str(model), "--trace",
                     str(tmp_path / "t.npz")], "trace", name, needle)


@pytest.mark.parametrize("case", BAD_NPZ + ["float ids", "ids out of range", "no steps"])
def test_bad_plan_trace_file(model: Path, good_trace: Path, tmp_path: Path, capsys, case: str) -> None:
    cases = bad_npz(tmp_path, good_trace)
    np.savez(tmp_path / "float.npz", sequence=np.full((3, LAYERS, TOP_K), 0.5))
    cases["float ids"] = (tmp_path / "float.npz", "not whole numbers")
    np.savez(tmp_path / "big.npz", sequence=np.full((3, LAYERS, TOP_K), 99))
    cases["ids out of range"] = (tmp_path / "big.npz", "outside -1..7")
    np.savez(tmp_path / "none.npz", sequence=np.zeros((0, LAYERS, TOP_K), np.int32))
    cases["no steps"] = (tmp_path / "none.npz", "no decode steps")
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps(HW))
    path, needle = cases[case]
    refused(capsys, ["plan", "--hardware", str(hw), "--model", str(model), "--trace", str(path)], "trace", needle)


def strict_json(text: str) -> object:
    """JSON as the standard has it: NaN and Infinity are not JSON (other programs' parsers refuse them)."""
    def refuse(name: str) -> object:
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_good_files_still_work(model: Path, good_trace: Path, tmp_path: Path, capsys) -> None:
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps(HW))
    assert main(["plan", "--hardware", str(hw), "--model", str(model), "--trace", str(good_trace), "--json"]) == 0
    assert strict_json(capsys.readouterr().out)["predicted_tok_s"] > 0
    assert main(["generate", "--model", str(model), "--max-new-tokens", "2", "--placement", str(good_trace),
                 "--accelerator", "emulated", "--vram-gb", "0.008", "hi"]) == 0  # 8 MiB: a prompt's activations


@pytest.mark.parametrize("hw", [
    {"cores": 24, "cpu_bandwidth_gbps": 1e5, "cpu_gflops": 1e7},  # the largest numbers taken
    {"cores": 1, "cpu_bandwidth_gbps": 1e-3, "cpu_gflops": 1e-3},  # the smallest
    {"cores": 24, "cpu_threads": {"24": {"expert_ms": 1e-6}, "1": {"expert_ms": 1e7, "per_token_ms": 1e7}},
     "token_overhead_ms": 1e7, "gpu": {"expert_ms": 1e-6, "copy_ms": 1e-6, "vram_bytes_for_experts": 2**40}},
])
def test_extreme_but_plausible_hardware_plans_in_standard_json(model: Path, tmp_path: Path, capsys, hw) -> None:
    (tmp_path / "hw.json").write_text(json.dumps(hw))
    assert main(["plan", "--hardware", str(tmp_path / "hw.json"), "--model", str(model), "--json"]) == 0
    strict_json(capsys.readouterr().out)


BAD_HARDWARE: list[tuple[object, str]] = [
    ({**HW, "cores": "eight"}, "cores"),
    ({**HW, "cores": "8"}, "cores"),
    ({**HW, "cores": 0}, "cores"),
    ({**HW, "cores": -4}, "cores"),
    ({**HW, "cores": 2.5}, "cores"),
    ({**HW, "cores": True}, "cores"),
    ({**HW, "cores": 10**12}, "cores"),
    ({k: v for k, v in HW.items() if k != "cores"}, "cores"),
    ({**HW, "cpu_bandwidth_gbps": "fast"}, "cpu_bandwidth_gbps"),
    ({**HW, "cpu_bandwidth_gbps": float("nan")}, "cpu_bandwidth_gbps"),
    ({**HW, "cpu_bandwidth_gbps": float("inf")}, "cpu_bandwidth_gbps"),
    ({**HW, "cpu_bandwidth_gbps": 0}, "cpu_bandwidth_gbps"),
    ({**HW, "cpu_gflops": -400}, "cpu_gflops"),
    ({"cores": 8}, "cpu_bandwidth_gbps"),
    ({"cores": 8, "cpu_threads": {"-3": {"expert_ms": 1e-6}}}, "cpu_threads key"),
    ({"cores": 8, "cpu_threads": {"x": {"expert_ms": 1}}}, "cpu_threads key"),
    ({"cores": 8, "cpu_threads": {"4": {"expert_ms": 0}}}, "cpu_threads.4.expert_ms"),
    ({"cores": 8, "cpu_threads": {"4": {"expert_ms": "NaN"}}}, "cpu_threads.4.expert_ms"),
    ({"cores": 8, "cpu_threads": {"4": {"expert_ms": 1, "per_token_ms": -1}}}, "cpu_threads.4.per_token_ms"),
    ({"cores": 8, "cpu_threads": {"4": 3}}, "cpu_threads.4"),
    ({"cores": 8, "cpu_threads": [1, 2]}, "cpu_threads"),
    ({**HW, "gpu": {"expert_ms": "x", "copy_ms": 14, "vram_bytes_for_experts": 2**34}}, "gpu.expert_ms"),
    ({**HW, "gpu": {"expert_ms": -0.3, "copy_ms": 14, "vram_bytes_for_experts": 2**34}}, "gpu.expert_ms"),
    ({**HW, "gpu": {"expert_ms": 0.3, "copy_ms": float("inf"), "vram_bytes_for_experts": 2**34}}, "gpu.copy_ms"),
    ({**HW, "gpu": {"bandwidth_gbps": 0, "h2d_gbps": 25, "vram_bytes_for_experts": 2**34}}, "gpu.bandwidth_gbps"),
    ({**HW, "gpu": {"expert_ms": 0.3, "h2d_gbps": -25, "vram_bytes_for_experts": 2**34}}, "gpu.h2d_gbps"),
    ({**HW, "gpu": {"expert_ms": 0.3, "copy_ms": 14, "vram_bytes_for_experts": -1}}, "gpu.vram_bytes_for_experts"),
    ({**HW, "gpu": {"expert_ms": 0.3, "copy_ms": 14, "vram_bytes_for_experts": "16G"}}, "gpu.vram_bytes_for_experts"),
    ({**HW, "gpu": "rtx"}, "gpu"),
    ({"cores": 24, "cpu_threads": {"12": {"expert_ms": 10**400}}}, "cpu_threads.12.expert_ms"),
    ({"cores": 24, "cpu_threads": {"12": {"expert_ms": 1, "per_token_ms": 10**400}}}, "cpu_threads.12.per_token_ms"),
    ({"cores": 24, "cpu_threads": {"12": {"expert_ms": 1e-300}}}, "cpu_threads.12.expert_ms"),
    ({"cores": 24, "cpu_threads": {"1000": {"expert_ms": 1}}}, "cpu_threads key"),
    ({"cores": 24, "cpu_threads": {"25": {"expert_ms": 1}}}, "cpu_threads key"),
    ({"cores": 8, "cpu_bandwidth_gbps": 5e-324, "cpu_gflops": 5e-324}, "cpu_bandwidth_gbps"),
    ({**HW, "cpu_gflops": 5e-324}, "cpu_gflops"),
    ({**HW, "cpu_bandwidth_gbps": 1e308}, "cpu_bandwidth_gbps"),
    ({**HW, "cpu_bandwidth_gbps": 10**400}, "cpu_bandwidth_gbps"),
    ({**HW, "cpu_gflops": 1e300}, "cpu_gflops"),
    ({**HW, "cores": 10**400}, "cores"),
    ({**HW, "gpu": {"bandwidth_gbps": 1e308, "h2d_gbps": 25, "vram_bytes_for_experts": 2**34}}, "gpu.bandwidth_gbps"),
    ({**HW, "gpu": {"expert_ms": 0.3, "h2d_gbps": 5e-324, "vram_bytes_for_experts": 2**34}}, "gpu.h2d_gbps"),
    ({**HW, "gpu": {"expert_ms": 1e-300, "copy_ms": 14, "vram_bytes_for_experts": 2**34}}, "gpu.expert_ms"),
    ({**HW, "gpu": {"expert_ms": 0.3, "copy_ms": 10**400, "vram_bytes_for_experts": 2**34}}, "gpu.copy_ms"),
    ({**HW, "gpu": {"expert_ms": 0.3, "copy_ms": 14, "vram_bytes_for_experts": 10**400}}, "gpu.vram_bytes_for_experts"),
    ({**HW, "token_overhead_ms": 10**400}, "token_overhead_ms"),
    ({**HW, "token_overhead_ms": float("nan")}, "token_overhead_ms"),
    ({**HW, "token_overhead_ms": -2}, "token_overhead_ms"),
    ([1, 2], "JSON object"),
    ("cores", "JSON object"),
]


@pytest.mark.parametrize("hw, field", BAD_HARDWARE)
def test_bad_hardware_file_names_the_field(model: Path, tmp_path: Path, capsys, hw: object, field: str) -> None:
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(hw))  # json writes NaN and Infinity, as a hand-edited file may hold them
    last = refused(capsys, ["plan", "--hardware", str(path), "--model", str(model)], str(path), field, "README")
    assert "tok/s" not in last


@pytest.mark.parametrize("content, needle", [(None, "is a folder"), (b"\xff\xfe{", "cannot read"),
                                             (b"{not json", "cannot read"), ("/dev/zero", "not a regular file")])
def test_unreadable_hardware_file(model: Path, tmp_path: Path, capsys, content: bytes | str | None,
                                  needle: str) -> None:
    path = tmp_path if content is None else Path(content) if isinstance(content, str) else tmp_path / "hw.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    refused(capsys, ["plan", "--hardware", str(path), "--model", str(model)], "hardware file", needle)


@pytest.mark.parametrize("changes, needle", [
    ({"num_experts_per_tok": 9}, "top-k"),  # more than the 8 experts: a synthetic trace could never draw them
    ({"num_local_experts": 1e9}, "number of experts"),
    ({"num_local_experts": 10**9}, "number of experts"),
    ({"num_local_experts": 0}, "number of experts"),
    ({"num_experts_per_tok": 0}, "top-k"),
])
def test_plan_on_impossible_model_sizes_is_refused(model: Path, tmp_path: Path, capsys, changes: dict[str, object],
                                                   needle: str) -> None:
    config = json.loads((model / "config.json").read_text()) | changes
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "hw.json").write_text(json.dumps(HW))
    refused(capsys, ["plan", "--hardware", str(tmp_path / "hw.json"), "--model", str(tmp_path / "config.json")],
            needle)


def test_synthetic_trace_refuses_more_picks_than_experts() -> None:
    with pytest.raises(ValueError, match="top_k"):
        synthetic_trace(4, 2, experts=3, top_k=4)
    assert synthetic_trace(4, 2, experts=3, top_k=3).shape == (4, 2, 3)  # all of them: still possible


@pytest.mark.parametrize("content, needle", [
    ("[1, 2]", "not a JSON object"), ('{"cores": "x", "cpu": 3}', "wrong type"), ("/dev/zero", "not a regular file"),
    ("{", "cannot read")])
def test_bad_recorded_hardware_for_probe(tmp_path: Path, capsys, content: str, needle: str) -> None:
    path = Path(content) if content.startswith("/dev/") else tmp_path / "rec.json"
    if path.parent == tmp_path:
        path.write_text(content)
    refused(capsys, ["probe", "--from", str(path)], "recorded hardware", needle)


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("which, kind", [
    (which, kind) for which in ("probe --from", "plan --hardware", "plan --model")
    for kind in ("deep", "fifo", "link to /dev/zero", "link to a folder")
    if (which, kind) != ("plan --model", "link to a folder")])  # plan --model takes a model folder, linked or not
def test_json_files_that_cannot_be_read(model: Path, tmp_path: Path, capsys, which: str, kind: str) -> None:
    import os

    bad = tmp_path / "config.json"
    if kind == "deep":
        bad.write_text(DEEP)
    elif kind == "fifo":
        os.mkfifo(bad)  # opening it would wait for a writer forever
    else:
        bad.symlink_to("/dev/zero" if kind == "link to /dev/zero" else tmp_path)
    (tmp_path / "hw.json").write_text(json.dumps(HW))
    argv = {"probe --from": ["probe", "--from", str(bad)],
            "plan --hardware": ["plan", "--hardware", str(bad), "--model", str(model)],
            "plan --model": ["plan", "--hardware", str(tmp_path / "hw.json"), "--model", str(bad)]}[which]
    needle = {"deep": "nested too deeply", "fifo": "not a regular file", "link to /dev/zero": "not a regular file",
              "link to a folder": "folder"}[kind]
    refused(capsys, argv, str(bad), needle)
