"""Layering: the core packages never import the UI toolkit (checked in a clean interpreter)."""

from __future__ import annotations

import subprocess
import sys


def test_core_packages_do_not_import_textual() -> None:
    code = (
        "import sys, runtime, kernels, autotune\n"
        "import runtime.loader, runtime.engine, runtime.synth, runtime.tokenizer\n"
        "assert not [m for m in sys.modules if m == 'textual' or m.startswith('textual.')], 'textual imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_importing_packages_has_no_side_effects() -> None:
    code = "import app, runtime, kernels, autotune, sys\nassert 'torch' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
