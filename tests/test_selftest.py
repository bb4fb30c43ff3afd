"""`tandem selftest`: on the emulated device here (every check passes, and a broken fence is caught), on a real GPU
when there is one (marked `cuda`, skipped without)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.app.cli import main
from tandem.runtime.accelerator import EmulatedAccelerator, cuda_usable
from tandem.runtime.selftest import selftest


def test_every_check_passes_on_the_emulated_device(tmp_path: Path) -> None:
    checks = selftest("emulated", tmp_path)
    assert [c.name for c in checks if not c.ok] == []
    assert len(checks) == 7


def test_a_copy_that_does_not_wait_for_the_kernel_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    def no_fence(self: EmulatedAccelerator) -> threading.Event:
        passed = threading.Event()
        passed.set()  # "the stream is past everything queued": a copy overwrites a slot at once
        return passed

    monkeypatch.setattr(EmulatedAccelerator, "_fence", no_fence)
    from tandem.runtime import selftest as module
    from tandem.runtime.checkpoint import open_checkpoint
    from tandem.runtime.synth import tiny_config, write_test_model

    folder = write_test_model(tmp_path / "m", tiny_config("mixtral", num_hidden_layers=3), seed=3)
    check = module._fence(module._Device("emulated", 0, open_checkpoint(folder)))
    assert not check.ok and "largest change" in check.detail


def test_the_command_reports_each_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert main(["selftest"]) == 0
    out = capsys.readouterr().out
    assert out.count("ok ") == 7 and "emulated" in out


def test_asking_for_a_gpu_where_there_is_none_is_an_error(capsys) -> None:
    if cuda_usable():
        pytest.skip("this machine has a GPU")
    assert main(["selftest", "--gpu"]) == 2
    assert "error: " in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_usable(), reason="no CUDA GPU here")
def test_every_check_passes_on_the_gpu(tmp_path: Path) -> None:  # pragma: no cover - no GPU on test machines
    checks = selftest("cuda", tmp_path)
    assert [(c.name, c.detail) for c in checks if not c.ok] == []
