"""The tests marked `isa` once more under each CPU feature mask this machine can play (`make test` runs this after
the whole suite): every path the kernels' automatic choice takes on a CPU with fewer features, here.

Masks that hide nothing this CPU has, or only what an earlier mask hid, are skipped (kernels.isa.MASKS). Arguments
go to pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tandem.kernels.isa import ENV, masks_to_play
from tandem.runtime.cpuinfo import proc_cpuinfo


def main(pytest_args: list[str]) -> int:
    info = proc_cpuinfo()
    masks = masks_to_play(info["flags"] if info else [])
    if not masks:
        print(f"== {ENV}: no mask hides anything this CPU has; nothing more to run", flush=True)
    for mask, hidden in masks:
        print(f"== {ENV}={mask}: as if without {', '.join(sorted(hidden))}", flush=True)
        code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "isa", *pytest_args],
                               env={**os.environ, ENV: mask})
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
