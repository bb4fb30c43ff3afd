"""CLI behaviour beyond parity: streaming text output, summary line, test-model writer, bench JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.app.cli.main import main


def test_generate_streams_text_and_prints_summary(mixtral_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(mixtral_dir), "--prompt", "Hello", "--chat", "--max-new-tokens", "8",
                 "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "prompt tokens" in err and "new tokens" in err and "tok/s" in err and "first token" in err


def test_json_has_the_documented_keys(mixtral_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(mixtral_dir), "--prompt", "Hello", "--max-new-tokens", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"prompt_tokens", "tokens", "text", "stats"}
    assert set(result["stats"]) >= {"ttft_s", "decode_tok_s", "prompt_tok_s", "new_tokens"}
    assert result["stats"]["new_tokens"] == len(result["tokens"])


def test_make_test_model_then_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "qwen"
    assert main(["make-test-model", "--family", "qwen2_moe", "--out", str(out)]) == 0
    assert main(["generate", "--model", str(out), "--prompt", "Hi", "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["stats"]["prompt_tokens"] > 0


def test_make_test_model_rejects_unknown_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-test-model", "--family", "gpt2", "--out", str(tmp_path / "x")]) == 2
    assert "not supported" in capsys.readouterr().err


def test_bench_decode_prints_json_with_ratio(mixtral_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "decode", "--model", str(mixtral_dir), "--new-tokens", "4", "--repeats", "1",
                 "--dtype", "fp32", "--peer", "transformers"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["decode_tok_s"]) == {"tandem", "transformers"}
    assert result["ratio"] > 0
    assert set(result["prefill_tok_s"]) == {"tandem", "transformers"} and min(result["prefill_tok_s"].values()) > 0


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "generate" in capsys.readouterr().out


def test_the_bf16_peak_is_float32s_where_the_kernels_have_no_bf16_arithmetic(monkeypatch) -> None:
    """Without AVX512_BF16 the kernels compute bf16 weights in float32: the bf16 peak is float32's, and oneDNN's bf16
    product (a reference loop there, seconds a call) is not timed; with it, all three products are."""
    from tandem.autotune import microbench

    timed: list[object] = []
    monkeypatch.setattr(microbench, "time_per_call", lambda f, count, min_time: timed.append(f) or 2.0 + len(timed))
    monkeypatch.setattr(microbench, "library", lambda: object())  # (built or not: the choice is the rule's)
    monkeypatch.setattr(microbench, "available_isas", lambda: ["base", "avx2", "avx512"])
    peak = microbench.compute_peak()
    assert len(timed) == 2 and peak["bf16"] == peak["fp32"] and peak["int8"] != peak["fp32"]
    timed.clear()
    monkeypatch.setattr(microbench, "available_isas", lambda: ["base", "avx2", "avx512", "avx512bf16"])
    peak = microbench.compute_peak()
    assert len(timed) == 3 and len(set(peak.values())) == 3


def test_bench_kernels_rows_have_the_documented_keys() -> None:
    from tandem.autotune.bench.kernels import bench_kernels
    from tandem.kernels.experts import CpuExecutor

    most = CpuExecutor(2048, 768, torch.bfloat16).crossover  # the most tokens a layer call takes on this CPU
    rows = bench_kernels(["qwen3"], threads=2, dtypes=("bf16", "int8", "int4"), tokens=(1, most), min_time=0.0,
                         working_set=32 * 1024**2)
    keys = {"shape", "dtype", "tokens", "threads", "impl", "latency_ms", "gbps", "bw_gbps", "ratio", "gflops",
            "peak_gflops", "of_peak"}
    assert rows and all(set(r) == keys for r in rows)
    for r in rows:  # the products of a token: 3 x 2·h·i multiply-adds, against the peak its dtype computes at
        assert r["gflops"] == pytest.approx(6 * 2048 * 768 * r["tokens"] / r["latency_ms"] / 1e6, rel=0.01)
        assert r["of_peak"] == pytest.approx(r["gflops"] / r["peak_gflops"], rel=0.01, abs=1e-3)
    peaks = {r["dtype"]: r["peak_gflops"] for r in rows}
    assert peaks["int8"] == peaks["int4"] and peaks["int8"] != peaks["bf16"]
    assert {(r["dtype"], r["impl"]) for r in rows} >= {("bf16", "tandem"), ("bf16", "torch"), ("int8", "torch"),
                                                      ("int4", "tandem")}
    from tandem.kernels.library import library

    if library() is not None:  # the experts a MoE layer runs together, in one kernel call
        assert {(r["dtype"], r["tokens"]) for r in rows if r["impl"] == "layer"} >= {("bf16", 1), ("bf16", most)}


def test_bench_quant_reports_drift_and_agreement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.runtime.synth import tiny_config, write_test_model

    folder = write_test_model(tmp_path / "m", tiny_config("mixtral"))
    assert main(["bench", "quant", "--model", str(folder), "--new-tokens", "6"]) == 2  # 96 wide: not groups of 64
    assert "--quant-group 32" in capsys.readouterr().err
    assert main(["bench", "quant", "--model", str(folder), "--new-tokens", "6", "--quant-group", "32"]) == 0
    result = json.loads(capsys.readouterr().out)
    for name in ("int8", "int4", "mxfp4"):  # MXFP4: 64 and 96 are whole blocks of 32
        v = result["variants"][name]
        assert 0 <= v["greedy_agreement"] <= 1 and v["max_abs_logit_drift"] > 0
    assert result["variants"]["int8"]["relative_drift"] < result["variants"]["int4"]["relative_drift"]
    assert result["variants"]["int8"]["relative_drift"] < result["variants"]["mxfp4"]["relative_drift"]


def test_progress_in_a_log_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.app.cli.from_flags import progress as _progress

    for fraction in (0.25, 0.5, 1.0):  # stderr is not a terminal here
        _progress("reading the experts into RAM", fraction)
    assert capsys.readouterr().err == "  reading the experts into RAM: done\n"
