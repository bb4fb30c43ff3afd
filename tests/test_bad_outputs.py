"""Output problems: a closed pipe stops quietly, a full disk is an `error:`, and output paths that could not be
written are refused before the work that would fill them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tandem.app.cli.main import main
from tandem.app.cli.output import EXIT_PIPE_CLOSED
from tandem.runtime.synth import tiny_config, write_test_model

ROOT = Path(__file__).resolve().parents[1]
NO_MODEL = "/nonexistent/tandem-model"  # were an output path checked after loading, the error would name this
UNWRITABLE = "/sys"  # a folder nobody may create files in, not even root


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_test_model(tmp_path_factory.mktemp("m") / "mixtral", tiny_config("mixtral")))


def tandem(*args: str, stdout: object = subprocess.PIPE) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tandem.app.cli.main", *args], stdout=stdout, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, cwd=ROOT)


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_closed_pipe_stops_quietly(model: str, json_flag: list[str]) -> None:
    proc = tandem("generate", "--model", model, "--max-new-tokens", "20", "--dtype", "fp32", *json_flag, "hello")
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first token (as `| head -c0`): every write hits EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == EXIT_PIPE_CLOSED
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err


def test_pipe_into_head_prints_no_traceback(model: str) -> None:
    # `head -c1` leaves after the first byte: whether the rest was already in the pipe or not, no traceback
    proc = subprocess.run(f"{sys.executable} -m app.cli generate --model {model} --max-new-tokens 30 hello | head -c1",
                          shell=True, capture_output=True, timeout=120, cwd=ROOT)
    assert b"Traceback" not in proc.stderr and b"Exception ignored" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("args", [["generate", "hello"], ["generate", "--json", "hello"], ["probe"]])
def test_full_disk_is_an_error(model: str, args: list[str]) -> None:
    if args[0] == "generate":
        args = [*args, "--model", model, "--max-new-tokens", "3"]
    with open("/dev/full", "w") as full:
        proc = tandem(*args, stdout=full)
        err = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == 2, err
    assert err.splitlines()[-1] == "error: could not write the output: No space left on device", err
    assert "Traceback" not in err and "Exception ignored" not in err


def refused_early(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert NO_MODEL not in err  # nothing was loaded before the output path was checked
    for needle in needles:
        assert needle in err, err


def bad_files(tmp_path: Path) -> list[tuple[str, str]]:
    """(path, what the error says) for every kind of file output that cannot be written."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-folder").mkdir(exist_ok=True)
    return [(str(tmp_path / "missing" / "out.json"), "does not exist"),
            (str(tmp_path / "a-file" / "out.json"), "is not a folder"),
            (str(tmp_path / "a-folder"), "is a folder"),
            (f"{UNWRITABLE}/tandem-out.json", "cannot write in")]


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("command, flag", [
    (["generate", "--model", NO_MODEL, "hi"], "--record-trace"),
    (["bench", "e2e", "--model", NO_MODEL], "--json"),
    (["bench", "e2e", "--model", NO_MODEL], "--plot"),
    (["probe"], "--record"),
])
def test_output_file_checked_before_the_work(capsys, tmp_path: Path, monkeypatch, command: list[str], flag: str,
                                             case: int) -> None:
    from tandem.autotune import probe as probe_module

    monkeypatch.setattr(probe_module, "probe", lambda *a: pytest.fail("probed before checking --record"))
    path, needle = bad_files(tmp_path)[case]
    refused_early(capsys, [*command, flag, path], flag, needle)


@pytest.mark.parametrize("command", [["make-test-model"], ["make-bench-model", "--shape", "olmoe", "--layers", "1"]])
def test_output_folder_checked_before_the_work(capsys, tmp_path: Path, command: list[str]) -> None:
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "exists").mkdir()
    for out, needle in [(tmp_path / "exists", "already exists"), (tmp_path / "a-file" / "m", "is not a folder"),
                        (Path(UNWRITABLE) / "tandem-model", "cannot write in")]:
        refused_early(capsys, [*command, "--out", str(out)], "--out", needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "exists"]  # nothing half-written left behind


def test_good_output_paths_still_work(model: str, tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.npz"
    assert main(["generate", "--model", model, "--max-new-tokens", "2", "--record-trace", str(trace), "hi"]) == 0
    assert trace.exists()
    out = tmp_path / "new" / "deeper" / "m"  # missing parents of a new model folder are created
    assert main(["make-test-model", "--out", str(out)]) == 0 and (out / "config.json").exists()


def test_trace_is_written_to_exactly_the_path_given(model: str, tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t_noext"
    assert main(["generate", "--model", model, "--max-new-tokens", "2", "--record-trace", str(trace), "hi"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t_noext"]  # not t_noext.npz
    assert main(["generate", "--model", model, "--max-new-tokens", "1", "--placement", str(trace),
                 "--accelerator", "emulated", "--vram-gb", "0.008", "hi"]) == 0  # 8 MiB: a prompt's activations


def test_a_trace_can_be_thrown_away(model: str, capsys) -> None:
    # /dev/null: a device, on which a zip written in place fails its seeks
    assert main(["generate", "--model", model, "--max-new-tokens", "2", "--record-trace", "/dev/null", "hi"]) == 0


@pytest.mark.parametrize("args", [["probe", "--record", "/dev/full"], ["probe", "--json", "--record", "/dev/full"]])
def test_full_disk_for_a_file_output_is_an_error(capsys, args: list[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "--record /dev/full" in err, err
    assert "No space left on device" in err


def test_full_disk_for_a_recorded_trace_is_an_error(model: str, capsys) -> None:
    assert main(["generate", "--model", model, "--max-new-tokens", "2", "--record-trace", "/dev/full", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: --record-trace /dev/full") and "No space left" in err, err
    assert "Traceback" not in err


def test_plan_to_a_full_disk_is_an_error(model: str, tmp_path: Path) -> None:
    (tmp_path / "hw.json").write_text('{"cores": 8, "cpu_bandwidth_gbps": 60, "cpu_gflops": 400}')
    for json_flag in ([], ["--json"]):
        with open("/dev/full", "w") as full:
            proc = tandem("plan", "--hardware", str(tmp_path / "hw.json"), "--model", model, *json_flag, stdout=full)
            err = proc.communicate(timeout=120)[1].decode()
        assert proc.returncode == 2 and err == "error: could not write the output: No space left on device\n", err


# --- saved state ---------------------------------------------------------------------------------------------


def test_tandem_home_that_is_a_file(model: str, tmp_path: Path, monkeypatch, capsys) -> None:
    home = tmp_path / "home"
    home.write_text("not a folder")
    monkeypatch.setenv("TANDEM_HOME", str(home))
    from tandem.autotune import run as run_module

    monkeypatch.setattr(run_module, "microbench", lambda *a, **k: pytest.fail("measured before checking"))
    assert main(["autotune", "--quick", "--model", model]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: TANDEM_HOME {home} is a file; point it to a folder") and err.count("\n") == 1, err
    # generating from a model folder saves nothing: it still works
    assert main(["generate", "--model", model, "--max-new-tokens", "2", "hi"]) == 0
    capsys.readouterr()
    assert main(["generate", "--max-new-tokens", "2", "hi"]) == 2  # the built-in model must be built and saved
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(f"error: TANDEM_HOME {home} is a file") and "Traceback" not in err, err
    from tandem.app.chat.settings import Settings, save_settings
    from tandem.kernels.errors import StoreError

    with pytest.raises(StoreError, match="is a file; point it to a folder"):
        save_settings(Settings())


@pytest.mark.parametrize("command", [["make-test-model"], ["make-bench-model", "--shape", "olmoe", "--layers", "1"]])
def test_a_checkpoint_that_does_not_fit_the_disk_is_an_error_and_leaves_no_half_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: list[str],
) -> None:
    """safetensors reports a full disk as its own error, not an OSError: it must still be `error: ...`, exit 2, and
    the half-written folder (this command made it) is removed."""
    from safetensors import SafetensorError

    def full_disk(*args: object, **kwargs: object) -> None:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("tandem.runtime.synth.save_file", full_disk)
    out = tmp_path / "ckpt"
    assert main([*command, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out}: could not write it") and "No space left" in err, err
    assert "Traceback" not in err and not out.exists()
