"""Hardware probing: recorded machines parse to the right facts; unknowns stay unknown; no GPU never crashes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.app.cli.main import main
from tandem.autotune.probe import GpuUnavailable, HardwareInfo, LiveSources, RecordedSources, describe, probe, record

FIXTURES = Path(__file__).parent / "fixtures" / "hardware"


def recorded(name: str) -> HardwareInfo:
    return probe(RecordedSources.load(FIXTURES / f"{name}.json"))


def test_this_kind_of_machine() -> None:
    hw = recorded("dev_xeon_amx")
    assert hw.cpu.physical_cores == 2 and hw.cpu.arch == "x86_64"
    assert hw.cpu.isa == {"avx2": True, "avx512": True, "avx512_bf16": True, "avx512_vnni": True, "amx": True,
                          "neon": False, "sve": False}
    assert hw.ram_total and hw.ram_total > 20 * 2**30 and hw.numa_nodes == 1
    assert hw.gpus == () and "NVML" in hw.gpu_status


def test_cpu_only_laptop_with_avx2_only() -> None:
    hw = recorded("laptop_avx2")
    isa = hw.cpu.isa
    assert isa["avx2"] and not isa["avx512"] and not isa["avx512_bf16"] and not isa["amx"]
    assert (hw.cpu.physical_cores, hw.cpu.logical_cores) == (4, 8)
    assert hw.gpus == () and hw.gpu_status.startswith("no GPU")


def test_rtx4090_on_pcie4_x16_with_threadripper() -> None:
    hw = recorded("desktop_rtx4090_threadripper")
    assert hw.cpu.physical_cores == 24 and hw.cpu.isa["avx512_bf16"] and not hw.cpu.isa["amx"]
    (gpu,) = hw.gpus
    assert gpu.name == "NVIDIA GeForce RTX 4090" and gpu.capability == (8, 9)
    assert gpu.memory_total == 25757220864 and gpu.pcie_gbps == pytest.approx(31.5, rel=1e-3)
    assert hw.gpu_status == "ok"


def test_quadro_rtx6000_on_pcie3() -> None:
    hw = recorded("workstation_quadro_rtx6000")
    (gpu,) = hw.gpus
    assert gpu.pcie_gen_max == 3 and gpu.pcie_gbps == pytest.approx(15.76, rel=1e-3)
    assert gpu.capability == (7, 5) and hw.numa_nodes == 2
    assert hw.cpu.isa["avx512_vnni"] and not hw.cpu.isa["avx512_bf16"]


def test_unknown_values_are_none_and_shown_as_unknown() -> None:
    hw = recorded("arm_partial")
    assert hw.cpu.brand is None and hw.cpu.physical_cores is None and hw.ram_available is None
    assert hw.cpu.isa["neon"] and hw.cpu.isa["sve"] and not hw.cpu.isa["avx2"]
    assert hw.gpus[0].pcie_gbps is None and hw.gpus[0].capability is None
    text = "\n".join(describe(hw))
    assert "unknown" in text and "None" not in text


def test_no_flags_means_unknown_isa_not_no() -> None:
    hw = probe(RecordedSources({"cpu": {}, "cores": [None, None], "memory": [None, None]}))
    assert set(hw.cpu.isa.values()) == {None}
    assert hw.gpus == () and hw.gpu_status.startswith("no GPU")


def test_round_trip_and_fingerprint() -> None:
    for path in FIXTURES.glob("*.json"):
        hw = probe(RecordedSources.load(path))
        assert HardwareInfo.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
        assert set(hw.fingerprint()) == {"cpu", "cores", "threads", "ram_gib", "gpus", "vram", "driver"}


def test_live_probe_on_this_machine_does_not_crash() -> None:
    hw = probe(LiveSources())
    assert hw.cpu.logical_cores and hw.ram_total
    raw = record(LiveSources())
    assert probe(RecordedSources(json.loads(json.dumps(raw)))).cpu == hw.cpu


class BrokenNvml(RecordedSources):
    def gpus(self) -> list:
        raise GpuUnavailable("driver/library version mismatch")


def test_gpu_errors_become_no_gpu() -> None:
    hw = probe(BrokenNvml(json.loads((FIXTURES / "desktop_rtx4090_threadripper.json").read_text())))
    assert hw.gpus == () and "version mismatch" in hw.gpu_status


def test_probe_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["probe"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "RAM: " in out and "GPU" in out
    assert main(["probe", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cpu"]["logical_cores"] and "gpu_status" in data
    assert main(["probe", "--record", str(tmp_path / "hw.json")]) == 0
    capsys.readouterr()
    assert main(["probe", "--from", str(tmp_path / "hw.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cpu"] == data["cpu"]


def probe_from(tmp_path: Path, capsys: pytest.CaptureFixture[str], readings: dict, *flags: str) -> tuple[int, str, str]:
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(readings))  # json writes NaN and Infinity, as a hand-edited file may hold them
    code = main(["probe", "--from", str(path), *flags])
    out, err = capsys.readouterr()
    return code, out, err


BASE = {"cpu": {"brand_raw": "Some CPU", "arch_string_raw": "x86_64", "flags": ["avx2"]}, "cores": [8, 16],
        "memory": [2**34, 2**33], "numa_nodes": 1, "gpus": None, "gpu_error": "no GPU"}
GPU = {"name": "Some GPU", "memory_total": 2**34, "memory_free": 2**33, "pcie_gen": 4, "pcie_gen_max": 4,
       "pcie_width": 16, "pcie_width_max": 16, "driver": "550", "capability": [8, 9]}


@pytest.mark.parametrize("readings", [
    {"memory": ["a", "b"]}, {"cores": ["x", 2]}, {"numa_nodes": "one"}, {"memory": [[1], {}]},
    {"gpus": [{**GPU, "name": 5, "memory_total": "x"}]}, {"gpus": [{**GPU, "pcie_gen": [4]}]},
    {"gpus": [{**GPU, "capability": "8.9"}]}, {"gpus": [{**GPU, "driver": 550}]}, {"gpus": ["rtx"]},
    {"gpus": {"name": "x"}}, {"cores": 8}, {"cpu": {**BASE["cpu"], "brand_raw": 5}},
])
@pytest.mark.parametrize("as_json", [[], ["--json"]])
def test_readings_of_the_wrong_type_are_an_error(tmp_path: Path, capsys, readings: dict, as_json: list[str]) -> None:
    code, out, err = probe_from(tmp_path, capsys, BASE | readings, *as_json)
    assert code == 2 and err.startswith("error: recorded hardware") and "wrong type" in err, err
    assert err.count("\n") == 1 and out == ""


@pytest.mark.parametrize("readings, unknown", [
    ({"cores": [float("inf"), -1]}, "CPU: Some CPU (x86_64), unknown cores / unknown threads"),
    ({"cores": [0, 2.5]}, "unknown cores / unknown threads"),
    ({"cores": [1e300, float("nan")]}, "unknown cores / unknown threads"),
    ({"memory": [float("nan"), -5]}, "RAM: unknown total, unknown available"),
    ({"memory": [float("inf"), 0]}, "RAM: unknown total, unknown available"),
    ({"numa_nodes": -1}, "NUMA nodes: unknown"),
    ({"numa_nodes": float("nan")}, "NUMA nodes: unknown"),
    ({"gpus": [{**GPU, "memory_total": -1, "memory_free": float("inf")}]}, "unknown (unknown free)"),
    ({"gpus": [{**GPU, "pcie_gen": float("inf"), "pcie_gen_max": -4, "pcie_width": float("nan"),
                "pcie_width_max": 0}]}, "PCIe gen unknown/unknown xunknown/unknown (max link unknown)"),
])
def test_impossible_readings_are_unknown(tmp_path: Path, capsys, readings: dict, unknown: str) -> None:
    code, out, err = probe_from(tmp_path, capsys, BASE | readings)
    assert code == 0 and unknown in out, out + err
    code, out, err = probe_from(tmp_path, capsys, BASE | readings, "--json")
    assert code == 0, err

    def refuse(name: str) -> object:
        raise AssertionError(f"non-standard JSON constant {name}")

    found = json.loads(out, parse_constant=refuse)
    numbers = [found["cpu"]["physical_cores"], found["cpu"]["logical_cores"], found["ram_total"],
               found["ram_available"], found["numa_nodes"]]
    numbers += [g[k] for g in found["gpus"] for k in ("memory_total", "memory_free", "pcie_gen", "pcie_width")]
    assert all(n is None or (isinstance(n, int) and n > 0) for n in numbers), found


def test_record_keeps_plausible_readings(tmp_path: Path, capsys) -> None:
    code, out, _ = probe_from(tmp_path, capsys, BASE | {"gpus": [GPU]}, "--json")
    found = json.loads(out)
    assert code == 0 and found["cpu"]["physical_cores"] == 8 and found["ram_total"] == 2**34
    assert found["gpus"][0]["memory_total"] == 2**34 and found["gpus"][0]["capability"] == [8, 9]


def test_a_gpus_capability_is_matched_to_torch_by_bus_not_by_index(monkeypatch) -> None:
    from tandem.autotune import probe as probe_module
    from tandem.runtime import accelerator
    from tandem.runtime.accelerator import CudaDevice

    seen = [CudaDevice(0, (0, 0x41, 0), (8, 9)), CudaDevice(1, (0, 0x01, 0), (7, 5))]
    monkeypatch.setattr(accelerator, "cuda_devices", lambda: sorted(seen, key=lambda d: d.pci))
    assert probe_module._torch_capability("00000000:01:00.0") == [7, 5]  # NVML's GPU 0 is torch's device 1
    assert probe_module._torch_capability("00000000:41:00.0") == [8, 9]
    assert probe_module._torch_capability("00000000:02:00.0") is None and probe_module._torch_capability(None) is None


def test_gpu_numbers_are_the_ones_pytorch_can_use_by_pci_bus(monkeypatch) -> None:
    """NVML lists every GPU; `--gpu N` counts those this PyTorch sees, by PCI bus (CUDA_VISIBLE_DEVICES hid the
    first here): the probe says which `--gpu` each is, and the planner's GPU is `--gpu 0`'s, not NVML's first."""
    from tandem.autotune import probe as probe_module
    from tandem.runtime import accelerator
    from tandem.runtime.accelerator import CudaDevice

    monkeypatch.setattr(accelerator, "cuda_devices", lambda: [CudaDevice(0, (0, 0x41, 0), (8, 9))])
    assert probe_module._torch_index("00000000:01:00.0") is None  # hidden from PyTorch
    assert probe_module._torch_index("00000000:41:00.0") == 0
    gpus = [GPU | {"name": "hidden", "pci_bus_id": "00000000:01:00.0", "torch_index": None},
            GPU | {"name": "visible", "pci_bus_id": "00000000:41:00.0", "torch_index": 0}]
    hw = probe(RecordedSources(BASE | {"gpus": gpus}))
    assert hw.gpu(0) is not None and hw.gpu(0).name == "visible" and hw.gpu(1) is None
    text = "\n".join(describe(hw))
    assert "GPU 0: hidden" in text and "(--gpu unknown)" in text and "GPU 1: visible" in text and "(--gpu 0)" in text
    old = probe(RecordedSources(BASE | {"gpus": [GPU]}))  # recorded before PyTorch's numbers were kept
    assert old.gpu(0) is old.gpus[0] and "(--gpu unknown)" in "\n".join(describe(old))


def test_a_pytorch_that_cannot_use_the_gpu_is_said_so(monkeypatch) -> None:
    from tandem.autotune import probe as probe_module

    hw = probe(RecordedSources(BASE | {"gpus": [GPU], "torch_problem": "this PyTorch (2.13.0+cpu) is a CPU build"}))
    assert hw.gpu(0) is hw.gpus[0] and hw.torch_problem
    text = "\n".join(describe(hw))
    assert "PyTorch: this PyTorch (2.13.0+cpu) is a CPU build" in text and "(PyTorch here cannot use it)" in text
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU build" in (probe_module.torch_cuda_problem() or "") and "README" in probe_module.torch_cuda_problem()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "hides every GPU" in (probe_module.torch_cuda_problem() or "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert "driver" in (probe_module.torch_cuda_problem() or "")
