"""Instruction-set features, and "as if this CPU lacked X".

`TANDEM_CPU_FEATURES` (e.g. `-amx,-avx512bf16`) removes features from what the CPU reports, so that one machine
runs every path another CPU would take. Removing a feature removes every feature built on it (AVX-512 without
AVX2, or AMX without AVX512_BF16, is no real CPU). The probe, the default dtype, the kernels' choice (and so the
default crossover), the tuner's profile key and, through `torch_isa_environment`, torch's own kernels all see
the masked CPU.
"""

from __future__ import annotations

import os

ENV = "TANDEM_CPU_FEATURES"
# Each maskable feature -> the features it needs (the kernel variants avx2, avx512, avx512bf16 and amx are named
# after the feature they use). The avx512bf16 variant uses VNNI as well (csrc/q8.c's integer sums; no CPU has
# AVX512_BF16 without it); AMX needs both, through them.
NEEDS: dict[str, tuple[str, ...]] = {
    "avx2": (), "avx512": ("avx2",), "avx512vnni": ("avx512",), "avx512bf16": ("avx512vnni",),
    "amx": ("avx512bf16",),
}
FEATURES = tuple(NEEDS)


def parse_feature_mask(text: str | None) -> frozenset[str]:
    """`-amx,-avx512bf16` -> the features removed, with everything that needs them. Empty or None: none.
    ValueError (saying what is accepted) for anything else."""
    removed: set[str] = set()
    for item in (text or "").split(","):
        item = item.strip().lower()
        if not item:
            continue
        name = item[1:] if item.startswith("-") else ""
        if name not in FEATURES:
            raise ValueError(
                f"{ENV}: cannot read {item!r}; give a comma list of features to remove, each one of "
                f"{', '.join('-' + f for f in FEATURES)} (e.g. {ENV}=-amx,-avx512bf16)")
        removed.add(name)
    grew = True
    while grew:  # what needs a removed feature goes too
        more = {f for f, needs in NEEDS.items() if f not in removed and removed.intersection(needs)}
        removed |= more
        grew = bool(more)
    return frozenset(removed)


# The CPUs one machine can play, most features first: without AMX (AMD Zen 4 and 5), without its bf16 dot products
# too (Intel Ice Lake), AVX2 only (Intel client CPUs, AMD Zen 1-3), no SIMD at all.
MASKS = ("-amx", "-amx,-avx512bf16", "-amx,-avx512bf16,-avx512vnni,-avx512", "-avx2")


def masks_to_play(flags: list[str] | tuple[str, ...]) -> list[tuple[str, frozenset[str]]]:
    """The MASKS that hide something a CPU with these (unmasked) flags has, each with what it hides; a mask that
    hides only what an earlier one did is left out."""
    have = present_features(flags)
    out: list[tuple[str, frozenset[str]]] = []
    for mask in MASKS:
        hidden = have & parse_feature_mask(mask)
        if hidden and hidden not in {h for _, h in out}:
            out.append((mask, hidden))
    return out


def masked_features() -> frozenset[str]:
    """The features `TANDEM_CPU_FEATURES` removes in this process (read here and nowhere else)."""
    return parse_feature_mask(os.environ.get(ENV))


def flag_feature(flag: str) -> str | None:
    """Which maskable feature a /proc/cpuinfo flag belongs to (every AVX-512 subset to avx512), or None."""
    flag = flag.lower()
    if flag.startswith("amx"):
        return "amx"
    if flag in ("avx512_bf16", "avx512_vnni", "avx512vnni"):
        return flag.replace("_", "")
    if flag.startswith("avx512"):
        return "avx512"
    return "avx2" if flag == "avx2" else None


def mask_flags(flags: list[str] | tuple[str, ...], removed: frozenset[str]) -> list[str]:
    """The CPU's flags without those of the removed features."""
    return [f for f in flags if flag_feature(f) not in removed]


def present_features(flags: list[str] | tuple[str, ...]) -> frozenset[str]:
    """Which of the maskable features these flags show."""
    return frozenset(feature for f in flags if (feature := flag_feature(f)) is not None)


def torch_isa_environment(removed: frozenset[str]) -> dict[str, str]:
    """The variables that cap torch's own CPU kernels (ATen's vectorised ops, oneDNN's and MKL's matrix products:
    float32 `F.linear` is MKL's) at the masked CPU; they act only when set before torch runs its first operation.
    Empty when nothing is removed."""
    if not removed:
        return {}
    if "avx2" in removed:
        return {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
    if "avx512" in removed:
        return {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    if "avx512vnni" in removed:  # no CPU has AVX512_BF16 without VNNI: the level below both
        return {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"}
    if "avx512bf16" in removed:
        return {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E1"}
    return {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3"}  # AMX alone
