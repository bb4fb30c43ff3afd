"""`tandem bench e2e` on a tiny checkpoint: every scenario, the peer, the JSON rows, the roofline column."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest

from tandem.app.cli import main
from tandem.autotune.bench.e2e import bench_e2e, peer_fits_beside, plot
from tandem.autotune.configure import load_model
from tandem.kernels.errors import TandemError

GRID = {"decode": [(16, 8)], "prefill": [(64, 1)], "beam": [(8, 6, 3)]}


def test_rows_for_every_scenario_with_the_peer(mixtral_dir: Path) -> None:
    loaded = load_model(mixtral_dir, dtype="fp32", context=128)
    result = bench_e2e(loaded, ["decode", "prefill", "beam"], peer="transformers", grid=GRID)
    assert set(result) >= {"machine", "plan", "rows"}
    rows = {r["scenario"]: r for r in result["rows"]}
    assert set(rows) == {"decode", "prefill", "beam"}
    for r in rows.values():
        assert {"scenario", "input", "output", "beams", "tandem_tok_s", "ttft_s", "itl_ms", "peer_tok_s",
                "ratio"} <= set(r)
        assert r["tandem_tok_s"] > 0 and r["peer_tok_s"] > 0 and r["ratio"] > 0
    assert 0 < rows["decode"]["roofline"] and rows["decode"]["bytes_per_token"] > 0
    assert rows["beam"]["beams"] == 3 and "ttft_ratio" in rows["prefill"]


def test_bytes_per_token_count_the_experts_as_stored(mixtral_dir: Path) -> None:
    # the roofline's numerator: quantized experts are read as int8 (plus scales), not in the compute dtype
    per_token, expert = {}, {}
    for quant in (None, "int8"):
        loaded = load_model(mixtral_dir, dtype="fp32", context=64, quant=quant)
        per_token[quant] = bench_e2e(loaded, ["decode"], grid={"decode": [(8, 4)]})["rows"][0]["bytes_per_token"]
        expert[quant] = next(iter(loaded.model.dispatcher.cpu_experts.values()))[0].nbytes
    cfg = loaded.model.cfg
    assert expert["int8"] < expert[None] / 3  # float32 file weights: 4 bytes each, against 1 plus a scale per row
    assert per_token[None] - per_token["int8"] == cfg.num_moe_layers * cfg.top_k * (expert[None] - expert["int8"])


def test_the_peer_runs_in_a_child_process_when_both_copies_would_not_fit(mixtral_dir: Path) -> None:
    loaded = load_model(mixtral_dir, dtype="fp32", context=128)
    same = bench_e2e(loaded, ["decode", "beam"], peer="transformers", grid=GRID, peer_process="same")
    child = bench_e2e(loaded, ["decode", "beam"], peer="transformers", grid=GRID, peer_process="child")
    assert same["peer"] == "same process, alternating" and child["peer"] == "child process, after Tandem"
    for a, b in zip(same["rows"], child["rows"], strict=True):
        assert (a["scenario"], a["input"], a["beams"]) == (b["scenario"], b["input"], b["beams"])
        assert b["peer_tok_s"] > 0 and b["ratio"] > 0
    gib = 2**30
    assert peer_fits_beside(4 * gib, 4 * gib, total_ram=24 * gib)
    assert not peer_fits_beside(14 * gib, 14 * gib, total_ram=24 * gib)  # full-depth OLMoE on a 24 GiB machine


def test_cli_writes_json(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--model", str(mixtral_dir), "--scenario", "decode", "--quick", "--dtype", "fp32",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["input"] for r in data["rows"]] == [32, 128] and "decode" in capsys.readouterr().out


def test_plot_without_matplotlib_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(TandemError, match="matplotlib"):
        plot({"rows": []}, "x.png")
