"""The batch policy (autotune/batch_plan.py): the step model's parts, the scheduler's simulation, the choice, and
`tandem plan --batch`; `tandem bench batch` end to end on a tiny model with a stand-in llama-batched-bench."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tandem.app.cli.main import main
from tandem.autotune.batch_plan import (
    JOB_MS,
    MAX_BATCH,
    BatchMachine,
    BatchShape,
    ExpertCurve,
    Workload,
    plan_batch,
    predict,
    step_cost,
)
from tandem.autotune.measurements import CpuFit, Measurements
from tandem.autotune.plan import ModelShape
from tandem.runtime.families import parse_config
from tandem.runtime.synth import tiny_config

GIB = 2**30


def olmoe_shape() -> BatchShape:
    """OLMoE's shapes, 4 layers: 64 experts of 2048 x 1024, top-8."""
    raw = tiny_config("olmoe", num_hidden_layers=4, hidden_size=2048, intermediate_size=1024, num_experts=64,
                      num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16, vocab_size=50304)
    cfg = parse_config(raw, "olmoe")[1]
    return BatchShape.from_config(cfg, ModelShape.from_config(cfg, 2), 2)


MACHINE = BatchMachine(80.0, ExpertCurve(CpuFit(0.21, 0.02), ((1, 0.21), (4, 0.45), (16, 0.76), (64, 1.43))), 450.0,
                       2)


def test_the_expert_curve_follows_its_points_and_the_slope_beyond() -> None:
    curve = MACHINE.expert
    assert curve.ms(1) == 0.21 and curve.ms(0.5) == 0.21 and curve.ms(16) == 0.76
    assert curve.ms(10) == pytest.approx(0.45 + (0.76 - 0.45) * 6 / 12)
    assert curve.ms(96) == pytest.approx(1.43 + 0.02 * 32)
    assert ExpertCurve(CpuFit(0.3, 0.1)).ms(5) == pytest.approx(0.7)  # no points: the fit


def test_the_curve_from_measurements_follows_the_executor_s_crossover() -> None:
    meas = Measurements(2, 12 << 20, {1: CpuFit(0.4, 0.06), 2: CpuFit(0.2, 0.02)},
                        cpu_samples={2: {1: 0.2, 16: 0.9}, 1: {1: 0.4, 16: 1.6}},
                        kernel={"torch_ms": {"1": 0.6, "16": 0.7}})
    assert ExpertCurve.from_measurements(meas, 2).points == ((1, 0.2), (16, 0.7))
    assert ExpertCurve.from_measurements(meas, 2, crossover=0).points == ((1, 0.6), (16, 0.7))  # torch only
    assert ExpertCurve.from_measurements(meas, 2, crossover=16).points == ((1, 0.2), (16, 0.9))  # the kernel only
    assert ExpertCurve.from_measurements(meas, 1).points == ((1, 0.4), (16, 1.6))  # torch was timed at 2 threads


def test_a_step_reads_each_chosen_expert_once_for_all_its_tokens() -> None:
    bs = olmoe_shape()
    one, many = step_cost(bs, MACHINE, 1, 1, 100), step_cost(bs, MACHINE, 64, 64, 100)
    assert one.experts_ms == pytest.approx(4 * 8 * 0.21)  # 8 experts a layer, one token each, in one layer call
    # 64 tokens touch almost every expert, each with about 8 tokens and run one by one: far less than 64 one-token
    # steps
    assert 4 * 60 * (MACHINE.expert.ms(8) + JOB_MS) < many.experts_ms < 4 * 64 * (MACHINE.expert.ms(9) + JOB_MS)
    assert many.ms < 64 * one.ms / 3
    assert many.head_ms > one.head_ms and many.attention_ms == pytest.approx(64 * one.attention_ms)


def test_the_simulation_counts_the_scheduler_s_steps() -> None:
    bs = olmoe_shape()
    w = Workload(8, 100, 10)
    # all eight rows at once, every prompt in the first step: one step of prompts, then nine of decode tokens
    assert predict(bs, MACHINE, w, batch=8, step_tokens=10_000).steps == 10
    # one row at a time, prompts in chunks of 50: two steps of prompt and nine of decode, eight times
    alone = predict(bs, MACHINE, w, batch=1, step_tokens=50)
    assert alone.steps == 8 * 11
    together = predict(bs, MACHINE, w, batch=8, step_tokens=8 + 256)
    assert together.tok_s > 2 * alone.tok_s and together.seconds < alone.seconds
    assert together.prefill_s < together.seconds and sum(together.breakdown.values()) / 1000 == pytest.approx(
        together.seconds)


def test_the_policy_takes_the_largest_batch_worth_it_within_the_memory() -> None:
    bs = olmoe_shape()
    w = Workload(64, 128, 64)
    free = plan_batch(bs, MACHINE, w, kv_budget=1 << 50, context=192)
    assert free.batch == 64 and free.limit == "requests" and free.attention == "cpu"
    assert free.step_tokens > free.batch and free.predicted.tok_s > 0
    row = bs.kv_bytes_per_token * 192
    tight = plan_batch(bs, MACHINE, w, kv_budget=20 * row, context=192)
    assert tight.batch == 20 and tight.limit == "memory" and tight.kv_bytes == 20 * row
    assert tight.predicted.tok_s < free.predicted.tok_s
    many = plan_batch(bs, MACHINE, Workload(5000, 16, 16), kv_budget=1 << 50, context=32)
    assert many.batch <= MAX_BATCH
    assert free.micro_batches == 1 and free.accelerator_weights == "none"  # no accelerator: nothing to pipeline
    on_device = plan_batch(bs, MACHINE, w, kv_budget=1 << 50, context=192, vram_free=2 * GIB)
    assert on_device.attention == "accelerator" and on_device.accelerator_weights == "dense"
    assert on_device.micro_batches == 1  # attention on the device: nothing for the CPU to overlap
    full = plan_batch(bs, MACHINE, w, kv_budget=1 << 50, context=192, vram_free=64 * row)
    assert full.attention == "cpu"  # the batch's KV cache would take more than its share beside the weights
    assert full.micro_batches == 2  # the CPU's attention beside the device's experts
    mla = plan_batch(bs, MACHINE, w, kv_budget=1 << 50, context=192, vram_free=64 * row, host_attention=False)
    assert mla.attention == "accelerator"


HARDWARE = {"cores": 2, "cpu_bandwidth_gbps": 80, "cpu_gflops": 450, "ram_free_gb": 8,
            "cpu_threads": {"2": {"expert_ms": 0.21, "per_token_ms": 0.02}}}


def test_plan_batch_prints_the_policy_for_a_described_machine(mixtral_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps(HARDWARE))
    config = str(mixtral_dir / "config.json")
    assert main(["plan", "--batch", "--model", config, "--hardware", str(hw), "--requests", "16", "--in", "40",
                 "--out", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("batch 16 sequences") and "tok/s predicted" in out and "16 requests of 40 + 8" in out
    assert main(["plan", "--batch", "--model", config, "--hardware", str(hw), "--json"]) == 0
    policy = json.loads(capsys.readouterr().out)
    assert policy["workload"] == {"requests": 64, "in": 128, "out": 64} and policy["predicted"]["tok_s"] > 0
    assert main(["plan", "--batch", "--model", config]) == 0  # this machine, probed
    assert "this machine" in capsys.readouterr().err
    assert main(["plan", "--model", config]) == 2
    assert "required: --hardware" in capsys.readouterr().err
    hw.write_text(json.dumps(HARDWARE | {"ram_free_gb": -1}))
    assert main(["plan", "--batch", "--model", config, "--hardware", str(hw)]) == 2
    assert "ram_free_gb" in capsys.readouterr().err


FAKE_BATCHED_BENCH = """#!{python}
import sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
assert args["-m"].endswith(".gguf")
pp, tg, pl = int(args["-npp"]), int(args["-ntg"]), int(args["-npl"])
print("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |")
print("|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|")
print(f"| {{pp}} | {{tg}} | {{pl}} | {{pl * (pp + tg)}} | 1.000 | 500.00 | 2.000 | 100.00 | 4.000 | 300.00 |")
"""


def test_bench_batch_measures_predicts_and_compares(mixtral_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from tests.ggufs import write_gguf

    fake = tmp_path / "llama-batched-bench"
    fake.write_text(FAKE_BATCHED_BENCH.format(python=sys.executable))
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    write_gguf(mixtral_dir, gguf, "F32")
    out = tmp_path / "b.json"
    assert main(["bench", "batch", "--model", str(gguf), "--requests", "6", "--in", "9", "--out", "5",
                 "--batch-sizes", "2", "--dtype", "fp32", "--peer", "llama.cpp", "--llama-batched-bench", str(fake),
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result == json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert [r["policy"] for r in rows].count(True) == 1 and 2 in [r["batch"] for r in rows]
    for r in rows:
        assert r["tok_s"] > 0 and r["predicted_tok_s"] > 0
        assert r["prediction_error"] == pytest.approx(r["predicted_tok_s"] / r["tok_s"] - 1, abs=2e-3)
    assert result["speedup_vs_single"] == pytest.approx(max(r["tok_s"] for r in rows) / result["single_decode_tok_s"],
                                                        rel=1e-2)
    peer = result["peer"]
    assert peer["tok_s"] == pytest.approx(6 * 5 / 4.0) and peer["decode_tok_s"] == 100.0
    assert peer["ratio"] == pytest.approx(max(r["tok_s"] for r in rows) / peer["tok_s"], rel=1e-2)
    assert main(["bench", "batch", "--model", str(mixtral_dir), "--requests", "2", "--in", "4", "--out", "2",
                 "--dtype", "fp32", "--peer", "llama.cpp", "--llama-batched-bench", str(fake)]) == 0
    assert "GGUF" in json.loads(capsys.readouterr().out)["peer"]["skipped"]


def test_bench_batch_on_the_accelerator_measures_the_pipeline_s_overlap(mixtral_dir: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "batch", "--model", str(mixtral_dir), "--requests", "4", "--in", "6", "--out", "4",
                 "--dtype", "fp32", "--accelerator", "emulated", "--vram-gb", "0.004"]) == 0
    rows = json.loads(capsys.readouterr().out)["pipeline"]
    assert [r["micro_batches"] for r in rows] == [1, 2]
    for r in rows:
        assert r["tok_s"] > 0 and r["device_experts_s"] > 0 and r["attention_s"] > 0
        assert 0 <= r["overlap_s"] <= min(r["device_experts_s"], r["attention_s"])
    assert rows[0]["overlap_s"] == 0  # one micro-batch: attention and the device's experts take turns


def test_the_timeline_sums_and_overlaps_spans() -> None:
    from tandem.runtime.timeline import Timeline

    t = Timeline()
    t.spans = {"a": [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)], "b": [(1.5, 3.5)]}
    assert t.total("a") == 3.0 and t.total("b") == 2.0 and t.total("c") == 0.0
    assert t.overlap("a", "b") == pytest.approx(1.0) == t.overlap("b", "a")
    assert t.wrap("c", lambda: 7)() == 7 and len(t.spans["c"]) == 1


def test_a_layers_overlap_counts_only_the_layers_that_ran_both_tiers() -> None:
    from tandem.runtime.timeline import Timeline, layer_overlap

    t = Timeline()
    # layer 1: device 1 s and CPU 2 s side by side in 2.5 s; layer 2: one after the other, 1 + 1 in 2 s; layer 3:
    # the device alone (not counted)
    t.spans = {"moe": [(0.0, 2.5), (3.0, 5.0), (6.0, 7.0)],
               "experts": [(0.1, 1.1), (3.0, 4.0), (6.0, 7.0)],
               "cpu_experts": [(0.2, 2.2), (4.0, 5.0)]}
    got = layer_overlap(t)
    assert got["layers"] == 2
    assert got["layer_s"] == pytest.approx(4.5) and got["longer_s"] == pytest.approx(3.0)
    assert got["one_after_the_other_s"] == pytest.approx(5.0) and got["layer_over_longer"] == pytest.approx(1.5)
    assert layer_overlap(Timeline())["layer_over_longer"] == 0.0


def test_bench_offload_reports_how_a_layer_runs_its_two_tiers_side_by_side(mixtral_dir: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offload", "--model", str(mixtral_dir), "--prompt-tokens", "8", "--new-tokens", "6",
                 "--dtype", "fp32"]) == 0
    overlap = json.loads(capsys.readouterr().out)["overlap"]
    assert overlap["layers"] > 0 and overlap["cpu_threads"] >= 1
    assert overlap["layer_s"] >= overlap["longer_s"] > 0
    assert overlap["one_after_the_other_s"] >= overlap["longer_s"]
    assert overlap["layer_over_longer"] == pytest.approx(overlap["layer_s"] / overlap["longer_s"], rel=1e-2)
