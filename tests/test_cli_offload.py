"""`tandem generate` with the accelerator tier: flags, statistics in --json, traces and placement files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tandem.app.cli.main import main

BASE = ["--prompt", "The quick brown fox", "--max-new-tokens", "12", "--dtype", "fp32", "--json", "--context", "64"]


def run(capsys: pytest.CaptureFixture[str], folder: Path, *extra: str) -> dict:
    assert main(["generate", "--model", str(folder), *BASE, *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "trace"])
def test_emulated_accelerator_matches_cpu_only_and_reports_stats(mixtral_dir: Path, capsys, policy: str) -> None:
    cpu = run(capsys, mixtral_dir, "--accelerator", "none")
    emu = run(capsys, mixtral_dir, "--accelerator", "emulated", "--vram-gb", "0.00079", "--cache-policy", policy)
    assert emu["tokens"] == cpu["tokens"]
    s = emu["stats"]
    assert set(s) >= {"experts", "cache", "bytes_h2d", "bytes_d2h", "per_layer"}
    total = sum(s["experts"].values())
    assert total == s["cache"]["hits"] + s["cache"]["misses"] == sum(cpu["stats"]["experts"].values())
    assert s["experts"]["gpu"] > 0 and s["experts"]["cpu"] > 0  # a partial cache: some of each
    assert 0 < s["cache"]["hit_rate"] < 1
    assert s["bytes_d2h"] > 0 and s["bytes_h2d"] > 0
    assert emu["plan"]["accelerator"] == "emulated" and emu["plan"]["cache"]["policy"] == policy
    assert sum(v["gpu"] + v["cpu"] + v["fetched"] for v in s["per_layer"].values()) == total


def test_fetch_strategy_never_runs_experts_on_the_cpu(mixtral_dir: Path, capsys) -> None:
    out = run(capsys, mixtral_dir, "--accelerator", "emulated", "--vram-gb", "0.00079", "--strategy", "fetch")
    assert out["stats"]["experts"]["cpu"] == 0 and out["stats"]["experts"]["fetched"] > 0


def test_record_trace_then_placement(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace.npz"
    first = run(capsys, mixtral_dir, "--record-trace", str(trace))
    data = np.load(trace)
    assert data["prefill"].shape == (2, 8) and data["sequence"].shape == (len(first["tokens"]) - 1, 2, 2)
    placed = run(capsys, mixtral_dir, "--accelerator", "emulated", "--vram-gb", "0.00079",
                 "--placement", str(trace), "--strategy", "cpu")
    assert placed["tokens"] == first["tokens"]
    assert placed["plan"]["static_experts"] > 0 and placed["plan"]["cache"]["ways"] == 0
    assert placed["stats"]["experts"]["gpu"] > 0


def test_beams_via_cli(mixtral_dir: Path, capsys) -> None:
    # 2 MiB: the weights, three rows of KV cache and the activations of three sequences' prefill, then slots
    out = run(capsys, mixtral_dir, "--beams", "3", "--accelerator", "emulated", "--vram-gb", "0.002")
    assert 0 < len(out["tokens"]) <= 12


@pytest.mark.parametrize("args, needle", [
    (["--accelerator", "emulated"], "--vram-gb"),
    (["--accelerator", "cuda"], "no usable CUDA device"),
    (["--accelerator", "emulated", "--vram-gb", "0.00001"], "budget"),
    (["--cost", "1,2"], "four numbers"),
])
def test_bad_accelerator_settings_are_explained(mixtral_dir: Path, capsys, args: list[str], needle: str) -> None:
    assert main(["generate", "--model", str(mixtral_dir), *BASE, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err


def test_placement_file_for_another_model_is_refused(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "other.npz"
    np.savez(bad, prefill=np.zeros((5, 4)), decode=np.zeros((5, 4)), sequence=np.zeros((0, 5, 2)))
    assert main(["generate", "--model", str(mixtral_dir), *BASE, "--placement", str(bad)]) == 2
    assert "record a new one" in capsys.readouterr().err
