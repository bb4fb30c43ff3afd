"""`tandem selftest`: on the emulated device here every check passes, and each fails on code broken the way it
guards against; on a real GPU when there is one (marked `cuda`, skipped without)."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tandem.app.cli.main import main
from tandem.runtime import selftest as module
from tandem.runtime.accelerator import EmulatedAccelerator, cuda_usable
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.dispatch import Dispatcher
from tandem.runtime.selftest import selftest
from tandem.runtime.synth import tiny_config, write_test_model

CHECKS = 13


def test_every_check_passes_on_the_emulated_device(tmp_path: Path) -> None:
    checks = selftest("emulated", tmp_path)
    assert [(c.name, c.detail) for c in checks if not c.ok] == []
    assert len(checks) == CHECKS and all(c.figures for c in checks if "number" not in c.name)


@pytest.fixture
def device(tmp_path: Path) -> module._Device:
    folder = write_test_model(tmp_path / "m", tiny_config("mixtral", num_hidden_layers=3), seed=3)
    return module._Device("emulated", 0, open_checkpoint(folder))


@pytest.fixture
def shaped(tmp_path: Path) -> module._Shaped:
    return module._Shaped("emulated", tmp_path)


def test_a_copy_that_does_not_wait_for_the_kernel_is_caught(device: module._Device,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.runtime.accelerator import _Arrival

    def no_fence(self: EmulatedAccelerator) -> _Arrival:
        passed = _Arrival()
        passed.set()  # "the stream is past everything queued": a copy overwrites a slot at once
        return passed

    monkeypatch.setattr(EmulatedAccelerator, "_fence", no_fence)
    check = module._fence(device)
    assert not check.ok and check.figures["read"] == 2.0


def _bf16_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The accelerator's dense product as it was: bf16 results, then widened."""
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype)).to(out_dtype or x.dtype)


def _bf16_sum(out: Future[torch.Tensor], experts: list, x: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
    """The experts' weighted sum in a bf16 accumulator, as it was."""
    acc = out.result()
    for i, expert in enumerate(experts):
        acc.copy_((acc.to(torch.bfloat16) + expert(x) * share[i][:, None].to(torch.bfloat16)).float())
    return acc


def _bf16_one(out: Future[torch.Tensor], expert: Callable, x: torch.Tensor, weights: torch.Tensor,
              tok: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    acc = out.result()
    y = expert(x[tok]) * weights[tok, slot].unsqueeze(-1).to(torch.bfloat16)
    return acc.copy_(acc.to(torch.bfloat16).index_add_(0, tok, y).float())


@pytest.mark.parametrize("broken", ["logits rounded to bf16", "experts summed in bf16"])
def test_device_numbers_that_drift_from_the_cpus_are_caught(device: module._Device, shaped: module._Shaped,
                                                            monkeypatch: pytest.MonkeyPatch, broken: str) -> None:
    if broken == "logits rounded to bf16":
        monkeypatch.setattr("tandem.kernels.dense.torch_linear", _bf16_linear)
    else:
        monkeypatch.setattr(Dispatcher, "_device_group", staticmethod(_bf16_sum))
        monkeypatch.setattr(Dispatcher, "_device_expert", staticmethod(_bf16_one))
    check = module._numerics(device, shaped, torch.bfloat16)
    assert not check.ok, check.detail
    if broken == "experts summed in bf16":  # caught at the layer, whatever the logits show on this CPU
        assert check.figures["moe_layer_roundoffs"] > module.LAYER_ROUNDOFFS, check.detail


def test_slots_allocated_one_tensor_at_a_time_are_caught(device: module._Device, shaped: module._Shaped,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.runtime.accelerator import Accelerator
    from tandem.runtime.moe import ExpertWeights

    def one_by_one(self: Dispatcher, accel: Accelerator, count: int, what: str, group: int = 1) -> list:
        return [ExpertWeights(*(accel.empty(s, self.dtype, what) for s in self._expert_shapes()))
                for _ in range(count)]

    monkeypatch.setattr(Dispatcher, "_new_buffers", one_by_one)
    check = module._slot_memory(device, shaped)
    assert not check.ok and check.figures["slot_allocations"] > 3 * check.figures["slots"]  # type: ignore[operator]


def test_an_extra_host_read_a_layer_is_caught(device: module._Device, shaped: module._Shaped, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    start = Dispatcher.start

    def reading_twice(self: Dispatcher, layer: int, x: torch.Tensor):  # noqa: ANN202
        if self.accel is not None:
            self.accel.to_host(x)  # a host read too many, as a hidden synchronisation would be on a GPU
        return start(self, layer, x)

    monkeypatch.setattr(Dispatcher, "start", reading_twice)
    for check in (module._synchronisations(device), module._synchronisations_by_kind(device, shaped, tmp_path),
                  module._batched_synchronisations(device, shaped)):
        assert not check.ok, check.name


def test_the_command_reports_each_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert main(["selftest"]) == 0
    out = capsys.readouterr().out
    assert out.count("ok ") == CHECKS and "emulated" in out
    assert main(["selftest", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and len(report["checks"]) == CHECKS and report["device"] == "the emulated device"
    assert {"name", "ok", "detail", "figures"} <= set(report["checks"][0])


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
