"""One typed configuration: flags over the profile over the defaults, resolved once by a pure function, printed by
--show-config; a load opens the checkpoint once and probes the machine once."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from tandem.app.cli.main import main
from tandem.autotune import configure as configure_module
from tandem.autotune.configure import configure, profile_request
from tandem.kernels.errors import SettingsError
from tandem.runtime import loader, memory
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.dispatch import Strategy
from tandem.runtime.expert_cache import CachePolicy
from tandem.runtime.options import Machine, Options, Request, resolve
from tandem.runtime.tokenizer import Tokenizer

GIB = 1024**3
MACHINE = Machine(cpu_flags=frozenset({"avx2", "avx512f", "avx512_bf16"}), cpu_threads=8,
                  isas=("base", "avx2", "avx512"), available_ram=64 * GIB, cuda=False)
PROFILE = Request(threads=4, crossover=12, kernel_isa="avx2", strategy=Strategy.FETCH, cache_ways=2,
                  cache_policy=CachePolicy.LFU, static=((0, 1),))


def test_flags_win_over_the_profile_and_the_profile_over_the_defaults(mixtral_dir: Path) -> None:
    ckpt = open_checkpoint(mixtral_dir)
    plain = resolve(Request(model=mixtral_dir), None, ckpt, MACHINE)
    assert (plain.cpu.threads, plain.cpu.crossover, plain.offload.strategy, plain.offload.cache_policy) == (
        None, None, Strategy.FIDDLER, CachePolicy.LRU)
    assert plain.source("threads") == "default" and plain.source("dtype") == "machine" and plain.dtype == "bf16"

    tuned = resolve(Request(model=mixtral_dir), PROFILE, ckpt, MACHINE)
    assert (tuned.cpu.threads, tuned.cpu.crossover, tuned.cpu.isa, tuned.offload.strategy) == (
        4, 12, "avx2", Strategy.FETCH)
    assert (tuned.offload.cache_ways, tuned.offload.cache_policy, tuned.offload.static) == (
        2, CachePolicy.LFU, ((0, 1),))
    assert {tuned.source(n) for n in ("threads", "crossover", "kernel_isa", "strategy", "static")} == {"profile"}

    given = resolve(Request(model=mixtral_dir, threads=2, kernel_isa="base", strategy=Strategy.CPU,
                            static=((1, 0),), dtype="fp32"), PROFILE, ckpt, MACHINE)
    assert (given.cpu.threads, given.cpu.isa, given.offload.strategy, given.offload.static, given.dtype) == (
        2, "base", Strategy.CPU, ((1, 0),), "fp32")
    assert given.source("threads") == "given" and given.source("crossover") == "profile"


def test_an_accelerator_the_machine_chose_comes_with_the_options_of_the_cpu_alone(mixtral_dir: Path) -> None:
    """The loader's way out when a GPU nobody asked for cannot hold the model is resolved beside the rest (the same
    request with --accelerator none), not made by changing the options afterwards."""
    ckpt = open_checkpoint(mixtral_dir)
    with_gpu = dataclasses.replace(MACHINE, cuda=True, gpu_capabilities=((9, 0),))
    chosen = resolve(Request(model=mixtral_dir), None, ckpt, with_gpu)
    assert chosen.accelerator == "cuda" and chosen.source("accelerator") == "machine"
    assert chosen.cpu_only == resolve(Request(model=mixtral_dir, accelerator="none"), None, ckpt, with_gpu)
    assert chosen.cpu_only.accelerator == "none" and chosen.cpu_only.cpu_only is None  # type: ignore[union-attr]
    asked = resolve(Request(model=mixtral_dir, accelerator="cuda"), None, ckpt, with_gpu)
    assert asked.cpu_only is None  # asked for by name: no way out, an error
    assert resolve(Request(model=mixtral_dir), None, ckpt, MACHINE).cpu_only is None  # no GPU: the CPU already


def test_what_this_machine_cannot_do_is_refused_or_left_to_the_default(mixtral_dir: Path) -> None:
    ckpt = open_checkpoint(mixtral_dir)
    avx2_only = dataclasses.replace(MACHINE, isas=("base", "avx2"), cpu_flags=frozenset({"avx2"}), cpu_threads=2)
    from_profile = resolve(Request(model=mixtral_dir), dataclasses.replace(PROFILE, kernel_isa="avx512", threads=2),
                           ckpt, avx2_only)
    assert from_profile.cpu.isa is None and from_profile.dtype == "fp32"  # a variant this CPU lacks: the best it has
    with pytest.raises(SettingsError, match="--kernel-isa avx512 is not available"):
        resolve(Request(model=mixtral_dir, kernel_isa="avx512"), None, ckpt, avx2_only)
    with pytest.raises(SettingsError, match="the profile says 4; run tandem autotune again"):
        resolve(Request(model=mixtral_dir), PROFILE, ckpt, avx2_only)
    with pytest.raises(SettingsError, match="exceeds what this model supports"):
        resolve(Request(model=mixtral_dir, context=10**6), None, ckpt, MACHINE)
    with pytest.raises(SettingsError, match="int4 groups of 128 need"):
        resolve(Request(model=mixtral_dir, quant="int4", quant_group=128), None, ckpt, MACHINE)


def test_the_experts_go_into_ram_only_with_room_to_spare(mixtral_dir: Path) -> None:
    ckpt = open_checkpoint(mixtral_dir)
    roomy = resolve(Request(model=mixtral_dir), None, ckpt, MACHINE)
    tight = resolve(Request(model=mixtral_dir), None, ckpt, dataclasses.replace(MACHINE, available_ram=1024))
    asked = resolve(Request(model=mixtral_dir, resident=False), None, ckpt, MACHINE)
    assert roomy.cpu.resident and not tight.cpu.resident and not asked.cpu.resident
    assert roomy.source("resident") == "machine" and asked.source("resident") == "given"


def test_options_are_immutable_and_print_every_setting(mixtral_dir: Path) -> None:
    options = resolve(Request(model=mixtral_dir, threads=2), PROFILE, open_checkpoint(mixtral_dir), MACHINE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.context = 8  # type: ignore[misc]
    table = options.to_dict()
    assert set(table) == {f.name for f in dataclasses.fields(Request)}
    assert table["threads"] == {"value": 2, "from": "given"} and table["strategy"]["from"] == "profile"
    json.dumps(table)
    assert len(options.describe()) == len(table)


def test_a_plan_fills_the_accelerator_settings_only_when_it_used_one() -> None:
    cpu_only = {"threads": 2, "accelerator": False, "strategy": "fetch", "kernel": {"isa": "avx2", "crossover": 0},
                "cache": {"ways": 4, "policy": "lfu"}, "static": [[0, 1]]}
    assert profile_request(cpu_only) == Request(threads=2, kernel_isa="avx2")
    tuned = profile_request(cpu_only | {"accelerator": True})
    assert (tuned.strategy, tuned.cache_ways, tuned.cache_policy, tuned.static) == (
        Strategy.FETCH, 4, CachePolicy.LFU, ((0, 1),))


def test_a_load_opens_the_checkpoint_once_and_probes_once(mixtral_dir: Path, tandem_home: Path,
                                                           monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    counts = {"open": 0, "probe": 0}
    real_open, real_probe = configure_module.open_checkpoint, configure_module.probe

    def counted_open(path):
        counts["open"] += 1
        return real_open(path)

    def counted_probe(*args):
        counts["probe"] += 1
        return real_probe(*args)

    monkeypatch.setattr(configure_module, "open_checkpoint", counted_open)
    monkeypatch.setattr(loader, "open_checkpoint", counted_open)
    monkeypatch.setattr(configure_module, "probe", counted_probe)
    assert main(["generate", "--model", str(mixtral_dir), "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    assert counts == {"open": 1, "probe": 1}


def test_show_config_prints_the_settings_and_loads_nothing(mixtral_dir: Path, tandem_home: Path,
                                                            monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("loaded for --show-config"))
    assert main(["generate", "--model", str(mixtral_dir), "--threads", "1", "--show-config"]) == 0
    out = capsys.readouterr().out
    assert "threads       1  [given]" in out and "context       " in out
    assert main(["generate", "--model", str(mixtral_dir), "--show-config", "--json", "--quant", "int8"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["quant"] == {"value": "int8", "from": "given"} and table["model"]["value"] == str(mixtral_dir)


def test_every_caller_configures_the_same_way(mixtral_dir: Path) -> None:
    """The tuner and benchmarks go through `configure` too: same request, same options."""
    request = Request(model=mixtral_dir, dtype="fp32", context=64, accelerator="none")
    a = configure(request, use_profile=False).options
    b = configure(request, use_profile=False, checkpoint=open_checkpoint(mixtral_dir)).options
    assert a == b and a.context == 64 and a.accelerator == "none"


def test_a_model_of_gguf_blocks_computes_in_bf16_wherever_the_cpu_has_avx2(tmp_path: Path) -> None:
    """bf16 is the compute that takes the kernels' int8 path for GGUF blocks (on AVX2 without AVX512_BF16 too):
    a Q8_0 file, or `--quant q8_0`, defaults to it there; a float model, a file of F16 experts or a CPU without
    AVX2 stay in fp32; a given dtype wins."""
    from tests.conftest import build_hf_checkpoint
    from tests.ggufs import write_gguf

    folder = build_hf_checkpoint(tmp_path / "hf", "qwen3_moe", {"moe_intermediate_size": 64})  # (whole blocks)
    write_gguf(folder, tmp_path / "q8_0.gguf", "Q8_0")
    write_gguf(folder, tmp_path / "f16.gguf", "F16")
    avx2 = dataclasses.replace(MACHINE, cpu_flags=frozenset({"avx2", "fma"}), isas=("base", "avx2"))
    old = dataclasses.replace(MACHINE, cpu_flags=frozenset({"sse4_2"}), isas=("base",))

    def dtype(model: Path, machine: Machine, **given: object) -> str:
        return resolve(Request(model=str(model), **given), None, open_checkpoint(model), machine).dtype

    assert dtype(tmp_path / "q8_0.gguf", avx2) == "bf16" and dtype(folder, avx2, quant="q8_0") == "bf16"
    assert dtype(folder, avx2) == dtype(tmp_path / "f16.gguf", avx2) == dtype(tmp_path / "q8_0.gguf", old) == "fp32"
    assert dtype(tmp_path / "q8_0.gguf", avx2, dtype="fp32") == "fp32"


@pytest.mark.parametrize("capability, dtype", [((8, 6), "bf16"), ((9, 0), "bf16"), ((7, 5), "fp16"),
                                               ((7, 0), "fp16"), (None, "fp32")])
def test_on_a_gpu_the_dtype_comes_from_the_gpu(mixtral_dir: Path, capability, dtype: str) -> None:
    """bf16 from Ampere on, fp16 before (bf16 is emulated there), fp32 when unknown; not from the CPU's flags. An
    fp16 GPU's CPU experts compute in the CPU's own dtype."""
    from tandem.runtime.options import gpu_dtype

    assert gpu_dtype(capability) == dtype
    ckpt = open_checkpoint(mixtral_dir)
    avx2_only = dataclasses.replace(MACHINE, cpu_flags=frozenset({"avx2"}), cuda=True,
                                    gpu_capabilities=((6, 1), capability))  # the second GPU, as --gpu 1 picks
    options = resolve(Request(model=mixtral_dir, gpu=1), None, ckpt, avx2_only)
    assert (options.accelerator, options.gpu, options.dtype) == ("cuda", 1, dtype)
    assert options.source("dtype") == "machine"
    assert options.cpu_dtype == ("fp32" if dtype == "fp16" else None)  # this CPU has no bf16
    assert resolve(Request(model=mixtral_dir, gpu=1, dtype="fp32"), None, ckpt, avx2_only).dtype == "fp32"


def test_a_gpu_that_is_not_there_and_fp16_on_the_cpu_are_refused(mixtral_dir: Path) -> None:
    ckpt = open_checkpoint(mixtral_dir)
    one_gpu = dataclasses.replace(MACHINE, cuda=True, gpu_capabilities=((8, 9),))
    with pytest.raises(SettingsError, match="--gpu 1: this machine has 1 CUDA GPUs"):
        resolve(Request(model=mixtral_dir, gpu=1), None, ckpt, one_gpu)
    with pytest.raises(SettingsError, match="fp16 is a GPU's compute dtype"):
        resolve(Request(model=mixtral_dir, dtype="fp16"), None, ckpt, MACHINE)


def test_a_profile_made_on_a_gpu_brings_its_measured_costs_and_its_choice_of_the_cpu() -> None:
    from tandem.autotune.measurements import CpuFit, Measurements
    from tandem.runtime.latency import LatencyModel

    meas = Measurements(cores=8, expert_bytes=1 << 20, cpu={2: CpuFit(3.0, 0.5), 8: CpuFit(1.0, 0.25)},
                        gpu_expert_ms=0.2, copy_expert_ms=4.0, vram_for_experts=1 << 30).to_dict()
    plan = {"threads": 8, "accelerator": True, "strategy": "fiddler", "kernel": {"isa": "avx2", "crossover": 0},
            "cache": {"ways": 4, "policy": "lru"}}
    tuned = profile_request(plan, meas)
    assert tuned.cost == LatencyModel(0.75, 0.25, 0.2, 4.0)  # a + b(s - 1) as a' + b s, at the plan's threads
    assert tuned.accelerator is None  # the machine's: the GPU
    cpu_only = profile_request(plan | {"accelerator": False}, meas)
    assert cpu_only.accelerator == "none" and cpu_only.cost is None  # measured the GPU, chose the CPU alone
    assert profile_request(plan | {"accelerator": False}).accelerator is None  # nothing measured: not decided


def test_pinned_experts_this_model_lacks_are_dropped_from_a_profile_and_refused_when_given(mixtral_dir: Path
                                                                                          ) -> None:
    ckpt = open_checkpoint(mixtral_dir)
    damaged = dataclasses.replace(PROFILE, static=((0, 1), (999, 999), (0, -1)))
    assert resolve(Request(model=mixtral_dir), damaged, ckpt, MACHINE).offload.static == ((0, 1),)
    with pytest.raises(SettingsError, match=r"pins expert \(999, 0\)"):
        resolve(Request(model=mixtral_dir, static=((999, 0),)), None, ckpt, MACHINE)


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of each expensive step of a command: the checkpoint opened, the tokenizer loaded, the machine probed."""
    from tandem.app.cli import batch as batch_cmd
    from tandem.runtime import checkpoint
    from tandem.runtime.tokenizer import Tokenizer

    counts = {"open": 0, "tokenizer": 0, "probe": 0}
    real_open, real_probe, real_tokenizer = checkpoint.open_checkpoint, configure_module.probe, Tokenizer.from_model

    def counted(name, real):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return call

    opened = counted("open", real_open)
    for module in (configure_module, loader, checkpoint):
        monkeypatch.setattr(module, "open_checkpoint", opened)
    monkeypatch.setattr(configure_module, "probe", counted("probe", real_probe))
    monkeypatch.setattr(Tokenizer, "from_model", staticmethod(counted("tokenizer", real_tokenizer)))
    assert batch_cmd.Tokenizer is Tokenizer
    return counts


def _batch_file(folder: Path, requests: int, max_tokens: int) -> Path:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"request {i} says", "max_tokens": max_tokens}} for i in range(requests)]
    path = folder / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_batch_opens_the_checkpoint_loads_the_tokenizer_and_probes_once(
        mixtral_dir: Path, tandem_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _counting(monkeypatch)
    src = _batch_file(tmp_path, 3, 3)
    assert main(["batch", str(src), "--out", str(tmp_path / "out.jsonl"), "--model", str(mixtral_dir),
                 "--dtype", "fp32", "--threads", "1"]) == 0
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3
    assert counts == {"open": 1, "tokenizer": 1, "probe": 1}


def _shown(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, dict[str, str]]:
    """--show-config's lines (`name  value  [where from]`; not every command has --json) as a table of strings."""
    assert main([*argv, "--show-config"]) == 0
    lines = [re.fullmatch(r"(\S+) +(.*)  \[(.+)\]", line) for line in capsys.readouterr().out.splitlines()]
    assert all(lines)
    return {m[1]: {"value": m[2], "from": m[3]} for m in lines if m}


def _as_shown(options: Options) -> dict[str, dict[str, str]]:
    return {m[1]: {"value": m[2], "from": m[3]}
            for m in (re.fullmatch(r"(\S+) +(.*)  \[(.+)\]", line) for line in options.describe()) if m}


@pytest.fixture
def steady_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's available RAM held still: settings it sizes (the prefix store, serving's batch) are read once
    for --show-config and again for the run, and on a busy machine they moved between the two."""
    monkeypatch.setattr(memory, "available_ram", lambda: 16 * 2**30)


@pytest.mark.usefixtures("steady_ram")
def test_show_config_tells_what_serve_runs(mixtral_dir: Path, tandem_home: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """serve runs ragged passes of --batch-size sequences, or as many as serving fits; --show-config says so, and
    the server is loaded with exactly those settings."""
    from tandem.app.serve import command as serve_cmd
    from tandem.runtime.options import SERVE_MOST_BATCH

    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("loaded for --show-config"))
    base = ["serve", "--model", str(mixtral_dir), "--dtype", "fp32", "--no-profile"]
    shown = _shown(capsys, base)
    assert shown["ragged"] == {"value": "True", "from": "given"}
    assert shown["batch"] == {"value": str(SERVE_MOST_BATCH), "from": "machine"}  # (a tiny model's rows are small)
    assert _shown(capsys, [*base, "--batch-size", "3"])["batch"] == {"value": "3", "from": "given"}

    loaded_with = []

    def load(configured, tokenizer=None, notify=None, shown=None):
        loaded_with.append(configured.options)
        raise KeyboardInterrupt  # (enough: what it was loaded with is known)

    monkeypatch.setattr(serve_cmd, "load_configured", load)
    assert main([*base, "--batch-size", "3", "--port", "0"]) == 130  # (the CLI's status for an interruption)
    shown = _shown(capsys, [*base, "--batch-size", "3"])
    assert _as_shown(loaded_with[0]) == shown


@pytest.mark.usefixtures("steady_ram")
def test_show_config_tells_what_batch_runs(mixtral_dir: Path, tandem_home: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    """batch runs ragged passes of its policy's batch, with the context its longest request needs; --show-config
    says so without loading or writing anything, and the run loads exactly those settings."""
    from tandem.app.cli import batch as batch_cmd
    src = _batch_file(tmp_path, 5, 7)
    out = tmp_path / "out.jsonl"
    base = ["batch", str(src), "--out", str(out), "--model", str(mixtral_dir), "--dtype", "fp32", "--threads", "1",
            "--no-profile", "--batch-size", "4"]
    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("loaded for --show-config"))
    shown = _shown(capsys, base)
    assert not out.exists()
    assert shown["ragged"]["value"] == "True" and shown["batch"]["value"] == "4"
    prompt = max(len(Tokenizer.from_model(mixtral_dir).encode(f"request {i} says")) for i in range(5))
    assert shown["context"] == {"value": str(prompt + 7), "from": "given"}
    loaded_with = []

    def load(configured, tokenizer=None, notify=None, shown=None):
        loaded_with.append(configured.options)
        raise KeyboardInterrupt

    monkeypatch.setattr(batch_cmd, "load_configured", load)
    assert main(base) == 130
    assert _as_shown(loaded_with[0]) == shown


@pytest.mark.parametrize("argv", [
    ["generate", "--beams", "3"],
    ["bench", "batch", "--requests", "5", "--in", "20", "--out", "4"],
    ["bench", "serve", "--requests", "3", "--concurrency", "2", "--in", "20", "--out", "4"],
    ["bench", "chat", "--turns", "2", "--words", "5", "--new-tokens", "4"],
    ["bench", "chat", "--reopen", "100"],
], ids=lambda argv: " ".join(argv[:3]))
def test_show_config_tells_what_each_command_runs(argv: list[str], mixtral_dir: Path, tandem_home: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Each command's --show-config is the settings its own load resolves: the sequences it runs, ragged or not,
    the context its workload needs, prefix reuse off where a benchmark must prefill every prompt."""
    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("loaded for --show-config"))
    shown = _shown(capsys, [*argv, "--model", str(mixtral_dir), "--dtype", "fp32", "--no-profile"])
    value = {k: v["value"] for k, v in shown.items()}
    expected = {
        "generate": {"batch": "3", "ragged": "False"},
        "bench batch": {"batch": "5", "ragged": "True", "context": "24"},
        "bench serve": {"batch": "2", "ragged": "True", "context": "24", "prefix_reuse": "False",
                        "prefix_store_gb": "0.0"},
        "bench chat --turns": {"batch": "1", "ragged": "True", "context": str(2 * (4 * 5 + 8 * 4 + 16) + 64)},
        "bench chat --reopen": {"batch": "1", "ragged": "False", "context": "356"},
    }[argv[0] if argv[0] != "bench" else " ".join(argv[:2]) + (f" {argv[2]}" if argv[1] == "chat" else "")]
    assert {k: value[k] for k in expected} == expected
