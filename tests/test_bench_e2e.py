"""`tandem bench e2e` on a tiny checkpoint: every scenario, the peer, the JSON rows, the roofline column."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest

from tandem.app.cli.main import main
from tandem.autotune.bench.e2e import bench_e2e, peer_fits_beside, plot
from tandem.kernels.errors import TandemError
from tandem.runtime.loader import load_model

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
    # the prompt's products against the fp32 peak: prompt tokens/s x flops a token / peak
    from tandem.autotune.bench.e2e import flops_per_token

    cfg = loaded.model.cfg
    assert result["peak_gflops"] > 0 and "compute" not in rows["decode"]
    assert rows["prefill"]["compute"] == pytest.approx(
        rows["prefill"]["tandem_tok_s"] * flops_per_token(cfg) / 1e9 / result["peak_gflops"], rel=0.01)


def test_flops_per_token_count_the_routed_experts_not_all_of_them() -> None:
    from tandem.autotune.bench.e2e import flops_per_token
    from tandem.autotune.bench.models import bench_config
    from tandem.runtime.families import parse_config

    cfg = parse_config(bench_config("mixtral"), "mixtral")[1]
    # Mixtral 8x7B: 32 layers of attention (4096 x (4096 + 2 x 1024) + 4096 x 4096), router 8 x 4096, and two
    # experts of 3 x 4096 x 14336: about 12.9 G multiply-adds, 25.8 GFLOP a token (its "12.9B active" less lm_head
    # and the embedding)
    per_layer = 4096 * 6144 + 4096 * 4096 + 8 * 4096 + 2 * 3 * 4096 * 14336
    assert flops_per_token(cfg) == 2.0 * 32 * per_layer


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


FAKE_LLAMA_BENCH = """#!{python}
import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
assert args["-o"] == "json" and args["-m"].endswith(".gguf")
rows = [{{"n_prompt": int(p), "n_gen": 0, "avg_ts": 1000.0 + int(p)}} for p in args["-p"].split(",") if p != "0"]
rows += [{{"n_prompt": 0, "n_gen": int(n), "avg_ts": 50.0}} for n in args["-n"].split(",") if n != "0"]
print(json.dumps(rows))
"""


def test_llama_cpp_is_the_peer_given_its_llama_bench_and_a_gguf_file(mixtral_dir: Path, tmp_path: Path,
                                                                     capsys, monkeypatch) -> None:
    """llama-bench's pp rows beside the prefill rows and its tg rows beside the decode rows (a stand-in binary that
    answers as llama-bench does); beams have none. Without the binary, or for a folder, skipped with the reason.
    Where the file would not fit in RAM beside Tandem's copies, Tandem lets its experts go first."""
    import sys

    from tests.ggufs import write_gguf

    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    write_gguf(mixtral_dir, gguf, "F32")
    loaded = load_model(gguf, dtype="fp32", context=128)
    result = bench_e2e(loaded, ["decode", "prefill", "beam"], peer="llama.cpp", grid=GRID, llama_bench=fake)
    rows = {r["scenario"]: r for r in result["rows"]}
    assert rows["prefill"]["peer_tok_s"] == 1064.0 and rows["decode"]["peer_tok_s"] == 50.0
    # generation alone against tg: 1 / ITL, not the end-to-end rate with the prompt in it
    assert rows["decode"]["ratio"] == pytest.approx(1000 / rows["decode"]["itl_ms"] / 50.0, rel=1e-2)
    assert rows["prefill"]["ratio"] == pytest.approx(rows["prefill"]["tandem_tok_s"] / 1064.0, rel=1e-3)
    assert "peer_tok_s" not in rows["beam"] and result["peer"].startswith("llama.cpp (llama-bench")
    assert "skipped" in bench_e2e(loaded, ["decode"], peer="llama.cpp", grid=GRID)["peer"]
    folder = load_model(mixtral_dir, dtype="fp32", context=128)
    assert "GGUF" in bench_e2e(folder, ["decode"], peer="llama.cpp", grid=GRID, llama_bench=fake)["peer"]
    assert loaded.model.dispatcher.cpu_experts  # both fit: Tandem's experts stay
    from tandem.autotune.bench import e2e

    monkeypatch.setattr(e2e, "peer_fits_beside", lambda *_: False)  # they do not
    again = load_model(gguf, dtype="fp32", context=128)
    assert bench_e2e(again, ["decode"], peer="llama.cpp", grid=GRID, llama_bench=fake)["rows"][0]["peer_tok_s"] == 50.0
    assert not again.model.dispatcher.cpu_experts
    monkeypatch.undo()
    fake.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    with pytest.raises(TandemError, match="llama-bench failed .*failed to load model"):
        bench_e2e(loaded, ["decode"], peer="llama.cpp", grid=GRID, llama_bench=fake)
