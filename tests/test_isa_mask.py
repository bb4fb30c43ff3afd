"""TANDEM_CPU_FEATURES: one machine plays a CPU without some of its features, and everything sees the same CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.autotune.probe import RecordedSources, describe, probe
from tandem.kernels import choice, experts, library
from tandem.kernels.experts import CpuOptions
from tandem.kernels.isa import (
    MASKS,
    flag_feature,
    mask_flags,
    masks_to_play,
    parse_feature_mask,
    present_features,
    torch_isa_environment,
)
from tandem.runtime.cpuinfo import proc_cpuinfo
from tandem.runtime.options import Machine, default_dtype

pytestmark = pytest.mark.isa
FIXTURES = Path(__file__).parent / "fixtures" / "hardware"


def proc_flags() -> list[str]:
    info = proc_cpuinfo()
    return info["flags"] if info else []


def test_removing_a_feature_removes_what_needs_it() -> None:
    assert parse_feature_mask("") == parse_feature_mask(None) == frozenset()
    assert parse_feature_mask("-amx") == {"amx"}
    assert parse_feature_mask(" -AVX512BF16 ") == {"avx512bf16", "amx"}
    assert parse_feature_mask("-avx512vnni") == {"avx512vnni", "avx512bf16", "amx"}  # its int8 sums use VNNI
    assert parse_feature_mask("-amx,-avx512bf16,-avx512vnni,-avx512") == parse_feature_mask("-avx512") == {
        "avx512", "avx512bf16", "avx512vnni", "amx"}
    assert parse_feature_mask("-avx2") == {"avx2", "avx512", "avx512bf16", "avx512vnni", "amx"}


@pytest.mark.parametrize("text", ["amx", "-avx3", "-amx;-avx2", "+amx", "-"])
def test_a_mask_that_cannot_be_read_says_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match="-avx512bf16.*e.g. TANDEM_CPU_FEATURES=-amx"):
        parse_feature_mask(text)


def test_flags_of_every_avx512_subset_go_with_avx512() -> None:
    flags = ["fma", "avx2", "avx512f", "avx512bw", "avx512_bitalg", "avx512bitalg", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_bf16"]
    assert present_features(flags) == {"avx2", "avx512", "avx512vnni", "avx512bf16", "amx"}
    assert mask_flags(flags, parse_feature_mask("-amx")) == flags[:-2]
    assert mask_flags(flags, parse_feature_mask("-avx512bf16")) == [f for f in flags[:-2] if "bf16" not in f]
    assert mask_flags(flags, parse_feature_mask("-avx512")) == ["fma", "avx2"]
    assert mask_flags(flags, parse_feature_mask("-avx2")) == ["fma"]


def test_the_masks_a_cpu_can_play() -> None:
    xeon = ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert [m for m, _ in masks_to_play(xeon)] == list(MASKS)
    zen4 = xeon[:4]  # -amx hides nothing there
    assert masks_to_play(zen4) == [("-amx,-avx512bf16", {"avx512bf16"}),
                                   (MASKS[2], {"avx512", "avx512vnni", "avx512bf16"}),
                                   ("-avx2", {"avx2", "avx512", "avx512vnni", "avx512bf16"})]
    assert masks_to_play(["avx2", "fma"]) == [("-avx2", {"avx2"})] and masks_to_play([]) == []


def test_torch_is_capped_at_the_masked_cpu() -> None:
    assert torch_isa_environment(frozenset()) == {}
    assert torch_isa_environment(parse_feature_mask("-amx")) == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                                                                 "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3"}
    assert torch_isa_environment(parse_feature_mask("-avx512bf16")) == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
                                                                        "MKL_ENABLE_INSTRUCTIONS": "AVX512_E1"}
    assert torch_isa_environment(parse_feature_mask("-avx512vnni")) == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
                                                                        "MKL_ENABLE_INSTRUCTIONS": "AVX512"}
    # float32 products are MKL's: without its variable they ran AVX-512 under the AVX2 mask
    assert torch_isa_environment(parse_feature_mask("-avx512")) == {"ATEN_CPU_CAPABILITY": "avx2",
                                                                    "ONEDNN_MAX_CPU_ISA": "AVX2",
                                                                    "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert torch_isa_environment(parse_feature_mask("-avx2")) == {"ATEN_CPU_CAPABILITY": "default",
                                                                  "ONEDNN_MAX_CPU_ISA": "SSE41",
                                                                  "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}


def test_the_probe_and_the_profile_key_see_the_masked_cpu() -> None:
    sources = RecordedSources.load(FIXTURES / "dev_xeon_amx.json")
    whole = probe(sources, removed=frozenset())
    no_amx = probe(sources, removed=parse_feature_mask("-amx"))
    no_bf16 = probe(sources, removed=parse_feature_mask("-avx512bf16"))
    assert whole.cpu.isa["amx"] and not no_amx.cpu.isa["amx"] and no_amx.cpu.isa["avx512_bf16"]
    assert not no_bf16.cpu.isa["avx512_bf16"] and no_bf16.cpu.isa["avx512_vnni"] and no_bf16.cpu.isa["avx512"]
    assert no_amx.cpu.masked == ("amx",) and whole.cpu.masked == ()
    keys = [json.dumps(hw.fingerprint(), sort_keys=True) for hw in (whole, no_amx, no_bf16)]
    assert len(set(keys)) == 3  # a profile tuned on the masked CPU is another machine's
    assert "as if without amx" in "\n".join(describe(no_amx))
    assert default_dtype(set(no_bf16.cpu.flags)) == "fp32" and default_dtype(set(no_amx.cpu.flags)) == "bf16"
    # masking what the CPU does not have changes nothing, the profile key included
    laptop = RecordedSources.load(FIXTURES / "laptop_avx2.json")
    assert probe(laptop, removed=parse_feature_mask("-amx")).fingerprint() == probe(laptop, removed=frozenset()
                                                                                      ).fingerprint()


def test_the_live_probe_plays_the_mask_a_recorded_machine_stays_as_recorded(cpu_features) -> None:
    cpu_features("-avx2")
    live = probe()
    assert not any(flag_feature(f) for f in live.cpu.flags)  # no AVX2, AVX-512 or AMX flag left
    assert set(live.cpu.masked) == present_features(proc_flags()) if proc_flags() else live.cpu.masked == ()
    recorded = probe(RecordedSources.load(FIXTURES / "dev_xeon_amx.json"))
    assert recorded.cpu.isa["amx"] and recorded.cpu.masked == ()


def test_the_kernels_default_dtype_and_crossover_follow_the_mask(cpu_features) -> None:
    have = library.available_isas()
    cpu_features("-avx512")
    assert library.available_isas() == [i for i in have if i in ("base", "avx2")]
    ex = experts.CpuExecutor(64, 64, torch.bfloat16)
    assert ex.crossover == choice.DEFAULT_CROSSOVER and "avx512" not in ex.isas
    with pytest.raises(ValueError, match="not available"):
        experts.CpuExecutor(64, 64, torch.bfloat16, CpuOptions(isa="avx512"))
    flags = Machine.here().cpu_flags
    assert flags is None or not any(f.startswith("avx512") or f.startswith("amx") for f in flags)
    cpu_features("-avx2")
    assert library.available_isas() == ["base"]


def test_a_bad_mask_is_an_error_on_the_command_line(tmp_path: Path) -> None:
    env = {"TANDEM_CPU_FEATURES": "-avx3", "TANDEM_HOME": str(tmp_path), "PATH": ""}
    proc = subprocess.run([sys.executable, "-m", "tandem.app.cli.main", "probe"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=Path(__file__).parents[1])
    assert proc.returncode == 2 and proc.stderr.startswith("error: TANDEM_CPU_FEATURES: cannot read '-avx3'")
    assert "Traceback" not in proc.stderr


def test_the_command_line_probe_shows_the_mask(tmp_path: Path) -> None:
    env = {"TANDEM_CPU_FEATURES": "-avx2", "TANDEM_HOME": str(tmp_path), "PATH": ""}
    proc = subprocess.run([sys.executable, "-m", "tandem.app.cli.main", "probe", "--json"], capture_output=True,
                          text=True, env=env, timeout=120, cwd=Path(__file__).parents[1])
    cpu_info = json.loads(proc.stdout)["cpu"]
    assert proc.returncode == 0 and not any(f.startswith(("avx2", "avx512", "amx")) for f in cpu_info["flags"])
    assert "avx2" in cpu_info["masked"] or not cpu_info["flags"]  # (a CPU without AVX2 has nothing to hide)
