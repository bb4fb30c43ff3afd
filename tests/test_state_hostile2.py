"""This machine's tuning profiles and the quantized-experts cache against hostile files: a FIFO, a link to a device,
a link loop, a folder in a file's place, absurd or garbage values, another safetensors file, a damaged one, a cache
folder that cannot be written. A profile that cannot be used is set aside with a notice and the run goes on with
the defaults; a cache file that is not this load's is set aside and made again; a cache that cannot be written is
an `error:` saying how to fix it. Nothing blocks, fills the memory or ends in a traceback (the cases that could run
in a bounded child process)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.app.cli.main import main
from tandem.autotune.measurements import CpuFit, Measurements
from tandem.autotune.profile import SCHEMA, Profile, find_profile, model_fingerprint, profile_path, save_profile
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.quant_cache import cache_path
from tandem.runtime.synth import tiny_config, write_test_model
from tests.test_gguf_hostile import within  # (a call that must end: bounded, in a thread)

ROOT = Path(__file__).resolve().parent.parent
CHILD_MEMORY = 4 * 2**30  # a regression that reads /dev/zero fails in the child instead of filling the machine
CHILD_TIMEOUT_S = 120  # a child that takes this long blocked (it takes seconds, most of them importing torch)
LOAD_TIMEOUT_S = 120  # a tiny model's load takes about a second: one that takes this long blocked

MACHINE = {"cpu": "x", "cores": 2}
MODEL = {"model_type": "qwen3_moe", "config_sha256": "a", "dtype": "fp32"}
MEASURED = Measurements(cores=2, expert_bytes=4096, cpu={1: CpuFit(0.5, 0.01), 2: CpuFit(0.3, 0.01)},
                        dram_gbps=20.0, cpu_samples={1: {1: 0.5, 4: 0.6}}, kernel={"isa": None, "crossover": 16,
                                                                                  "torch_ms": {"1": 0.4}}).to_dict()


def profile(**overrides: Any) -> Profile:
    return Profile(**({"machine": MACHINE, "model": MODEL, "measurements": MEASURED, "plan": {"threads": 2},
                       "predicted": {}} | overrides))


def rewrite(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def set_aside_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.bad-*"))


# --- profiles ---------------------------------------------------------------------------------------------------

CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
from tandem.autotune.profile import find_profile
found = find_profile(json.loads(sys.argv[1]), json.loads(sys.argv[2]))
print(json.dumps({{"found": found.profile is not None, "notice": found.notice}}))
"""


def find_in_child(machine: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """`find_profile` in a child bounded in memory and time: a regression fails, never hangs or fills the RAM."""
    code = CHILD.format(memory=CHILD_MEMORY)
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(machine), json.dumps(model)],
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=ROOT, env=os.environ)
    except subprocess.TimeoutExpired:
        pytest.fail("finding the profile blocked on the file")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
def test_a_profile_that_is_a_fifo_or_a_device_is_set_aside_without_blocking(kind: str) -> None:
    path = profile_path(MACHINE, MODEL)
    path.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    got = find_in_child(MACHINE, MODEL)
    assert not got["found"] and "set aside" in got["notice"] and "autotune" in got["notice"]
    assert not os.path.lexists(path) and len(set_aside_files(path.parent)) == 1
    if kind != "fifo":  # the link itself was moved, never what it points to
        assert set_aside_files(path.parent)[0].is_symlink() and Path("/dev/zero").exists()


@pytest.mark.parametrize("target", ["loop", "/nonexistent/profile.json"])
def test_a_profile_that_is_a_link_loop_or_a_dangling_link_is_set_aside(target: str) -> None:
    path = profile_path(MACHINE, MODEL)
    path.parent.mkdir(parents=True)
    path.symlink_to(path.name if target == "loop" else target)
    found = find_profile(MACHINE, MODEL)
    assert found.profile is None and "set aside" in found.notice
    assert not os.path.lexists(path) and len(set_aside_files(path.parent)) == 1


@pytest.mark.parametrize("threads", [10**9, 2**63, 10**400])
def test_a_profile_with_an_absurd_thread_count_is_set_aside(threads: int) -> None:
    path = save_profile(profile())
    rewrite(path, lambda d: d["plan"].update(threads=threads))
    found = find_profile(MACHINE, MODEL)
    assert found.profile is None and "set aside" in found.notice and "threads" in found.notice
    assert not path.exists()


def test_a_profile_with_more_threads_than_this_machine_has_is_set_aside() -> None:
    machine = MACHINE | {"threads": 2}  # as a probe's fingerprint says it
    path = save_profile(profile(machine=machine, plan={"threads": 3}))
    found = find_profile(machine, MODEL)
    assert found.profile is None and "more than the 2 this machine has" in found.notice and not path.exists()
    save_profile(profile(machine=machine, plan={"threads": 2}))  # as many as it has: used
    assert find_profile(machine, MODEL).profile is not None


BAD_MEASUREMENTS: dict[str, Callable[[dict[str, Any]], None]] = {
    "unknown fields only": lambda m: (m.clear(), m.update(x=1)),
    "no cores": lambda m: m.pop("cores"),
    "cores absurd": lambda m: m.update(cores=10**12),
    "cores a text": lambda m: m.update(cores="2"),
    "expert bytes too large for a float": lambda m: m.update(expert_bytes=10**400),
    "cpu empty": lambda m: m.update(cpu={}),
    "cpu key not a count": lambda m: m.update(cpu={"a": {"a_ms": 1, "b_ms": 1}}),
    "cpu key a superscript digit": lambda m: m.update(cpu={"²": {"a_ms": 1, "b_ms": 1}}),
    "cpu key of 5000 digits": lambda m: m.update(cpu={"9" * 5000: {"a_ms": 1, "b_ms": 1}}),
    "cpu fit not numbers": lambda m: m.update(cpu={"1": {"a_ms": "fast", "b_ms": 1}}),
    "cpu a_ms zero": lambda m: m.update(cpu={"1": {"a_ms": 0, "b_ms": 1}}),
    "cpu a_ms NaN": lambda m: m.update(cpu={"1": {"a_ms": float("nan"), "b_ms": 1}}),
    "cpu_samples not an object": lambda m: m.update(cpu_samples=[1, 2]),
    "kernel torch_ms garbage": lambda m: m.update(kernel={"torch_ms": {"x": "y"}}),
    "dram_gbps infinite": lambda m: m.update(dram_gbps=float("inf")),
    "copy ms negative": lambda m: m.update(copy_expert_ms=-1),
    "vram a text": lambda m: m.update(vram_for_experts="lots"),
    "shared_device a number": lambda m: m.update(shared_device=3),
}


@pytest.mark.parametrize("change", BAD_MEASUREMENTS.values(), ids=BAD_MEASUREMENTS.keys())
def test_a_profile_with_bad_measurements_is_set_aside(change: Callable[[dict[str, Any]], None]) -> None:
    path = save_profile(profile())
    rewrite(path, lambda d: change(d["measurements"]))
    found = find_profile(MACHINE, MODEL)
    assert found.profile is None and "set aside" in found.notice and "measurements" in found.notice
    assert not path.exists()


@pytest.mark.parametrize("measurements", [MEASURED, {}, MEASURED | {"a later field": 1}],
                         ids=["measured", "none", "with a field a later Tandem adds"])
def test_good_measurements_are_read(measurements: dict[str, Any]) -> None:
    save_profile(profile(measurements=measurements))
    found = find_profile(MACHINE, MODEL)
    assert found.notice is None and found.profile is not None and found.profile.measurements == measurements


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose widths are whole Q8_0 blocks (32 values), so that `--quant q8_0` takes it."""
    config = tiny_config("qwen3_moe", moe_intermediate_size=64)
    return write_test_model(tmp_path_factory.mktemp("tiny") / "tiny", config)


def this_machines_profile_path(model: Path) -> Path:
    """Where `generate --dtype fp32` looks for this machine's profile of `model`."""
    from tandem.autotune.probe import probe

    raw = json.loads((model / "config.json").read_text())
    return profile_path(probe().fingerprint(), model_fingerprint(raw, "fp32"))


@pytest.mark.parametrize("damage", ["threads", "measurements"])
def test_generate_sets_a_damaged_profile_aside_and_runs_with_the_defaults(
        tiny: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = this_machines_profile_path(tiny)
    plan = {"threads": 10**9 if damage == "threads" else 1}
    measurements = {"cores": 2, "cpu": "garbage"} if damage == "measurements" else {}
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": SCHEMA, "machine": {}, "model": {}, "measurements": measurements,
                                "plan": plan, "predicted": {}}))
    assert main(["generate", "--model", str(tiny), "--prompt", "hi", "--max-new-tokens", "2", "--dtype", "fp32"]) == 0
    err = capsys.readouterr().err
    assert "note: the profile" in err and "set aside" in err and "Traceback" not in err
    assert not path.exists() and len(set_aside_files(path.parent)) == 1


# --- the quantized-experts cache --------------------------------------------------------------------------------

def loaded_cache(model: Path) -> tuple[Path, bytes]:
    """The cache file of `model` at q8_0, made by a load, and its bytes."""
    from tandem.runtime.loader import load_model

    load_model(model, dtype="fp32", quant="q8_0")
    path = cache_path(open_checkpoint(model), "q8_0")
    return path, path.read_bytes()


def foreign_safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(4, dtype=torch.uint8)}, str(path))


def renamed_tensor(path: Path, good: bytes) -> None:
    """The same file with one header byte flipped: a tensor name no longer this layout's."""
    n = struct.unpack("<Q", good[:8])[0]
    at = good.index(b'"0.0.gate"', 8, 8 + n) + 8
    path.write_bytes(good[:at] + b"f" + good[at + 1:])


def write_hostile(kind: str, path: Path, good: bytes) -> None:
    if kind == "folder":
        path.mkdir()
        (path / "inside").write_text("kept")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "link loop":
        path.symlink_to(path.name)
    elif kind == "dangling link":
        path.symlink_to("/nonexistent/cache.safetensors")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "garbage header":
        path.write_bytes(good[:8] + b"\xff" * 16 + good[24:])
    elif kind == "header length past the end":
        path.write_bytes(struct.pack("<Q", 2**63 - 1) + good[8:])
    elif kind == "bytes after the data":
        path.write_bytes(good + b"\0" * 64)
    elif kind == "a tensor renamed":
        renamed_tensor(path, good)
    else:
        assert kind == "another safetensors file"
        foreign_safetensors(path)


HOSTILE_CACHES = ["folder", "another safetensors file", "fifo", "link to /dev/zero", "link loop", "dangling link",
                  "empty", "truncated", "garbage header", "header length past the end", "bytes after the data",
                  "a tensor renamed"]


@pytest.mark.parametrize("kind", HOSTILE_CACHES)
def test_a_cache_file_that_is_not_this_loads_is_set_aside_and_made_again(tiny: Path, kind: str) -> None:
    from tandem.runtime.loader import load_model

    path, good = loaded_cache(tiny)
    path.unlink()
    write_hostile(kind, path, good)
    steps: list[str] = []
    within(LOAD_TIMEOUT_S, lambda: load_model(tiny, dtype="fp32", quant="q8_0", progress=lambda m, f: steps.append(m)))
    assert any("setting aside the quantized experts' cache file" in s for s in steps), steps
    assert any("quantizing the experts" in s for s in steps)
    assert path.is_file() and not path.is_symlink() and path.read_bytes() == good  # made again, as before
    aside = set_aside_files(path.parent)
    assert len(aside) == 1 and (kind != "folder" or (aside[0] / "inside").read_text() == "kept")
    assert os.path.exists("/dev/zero")


def test_a_cache_file_that_is_this_loads_is_used_without_a_notice(tiny: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    import tandem.runtime.quant_cache as quant_cache
    from tandem.runtime.loader import load_model

    path, good = loaded_cache(tiny)
    monkeypatch.setattr(quant_cache, "quantize", lambda *a: pytest.fail("quantized again"))
    steps: list[str] = []
    load_model(tiny, dtype="fp32", quant="q8_0", progress=lambda m, f: steps.append(m))
    assert not any("setting aside" in s or "quantizing" in s for s in steps)
    assert path.read_bytes() == good and not set_aside_files(path.parent)


@pytest.mark.parametrize("failure", ["no permission", "no space"])
def test_a_cache_that_cannot_be_written_is_an_error_saying_how_to_fix_it(
        tiny: Path, failure: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import tandem.runtime.paths as paths
    import tandem.runtime.quant_cache as quant_cache

    if failure == "no permission":  # (a read-only folder: the tests may run as root, whom no mode stops)
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise PermissionError(errno.EACCES, "Permission denied")

        monkeypatch.setattr(paths.tempfile, "mkstemp", refuse)
    else:  # the disk fills while the blocks are written
        def full(*args: Any) -> Any:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(quant_cache, "quantize", full)
    assert main(["generate", "--model", str(tiny), "--prompt", "hi", "--max-new-tokens", "2", "--dtype", "fp32",
                 "--quant", "q8_0"]) == 2
    err = capsys.readouterr().err
    assert "error: cannot write the quantized experts' cache" in err and "TANDEM_HOME" in err
    assert ("Permission denied" if failure == "no permission" else "No space left") in err
    folder = cache_path(open_checkpoint(tiny), "q8_0").parent
    assert not folder.exists() or not list(folder.iterdir())  # no partial file left


@pytest.mark.parametrize("kind", ["file", "link loop"])
def test_a_cache_folder_that_cannot_be_made_is_an_error_saying_how_to_fix_it(
        tiny: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    folder = cache_path(open_checkpoint(tiny), "q8_0").parent
    folder.parent.mkdir(parents=True, exist_ok=True)
    if kind == "file":
        folder.write_text("in the way")
    else:
        folder.symlink_to(folder.name)
    assert main(["generate", "--model", str(tiny), "--prompt", "hi", "--max-new-tokens", "2", "--dtype", "fp32",
                 "--quant", "q8_0"]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot create the folder {folder}" in err and "Traceback" not in err
    if kind == "file":
        assert folder.read_text() == "in the way"  # not ours to move: the message says what to do
    shutil.rmtree(folder, ignore_errors=True)
