"""The CPU as Linux describes it in /proc/cpuinfo (instant, unlike py-cpuinfo): brand, flags, arch, count.
Shared by runtime.options (Machine: the default dtype) and the auto-tuner's probe; None where there is no
/proc/cpuinfo."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def proc_cpuinfo() -> dict[str, Any] | None:
    """The py-cpuinfo keys Tandem uses, from the first processor's entry."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key and key not in fields:
            fields[key] = value.strip()
        if not line.strip() and fields:
            break  # the first processor is enough
    flags = (fields.get("flags") or fields.get("features") or "").split()
    return {"brand_raw": fields.get("model name") or fields.get("hardware"), "arch_string_raw": platform.machine(),
            "flags": flags, "count": os.cpu_count()}
