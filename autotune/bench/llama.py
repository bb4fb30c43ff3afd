"""llama.cpp as `bench e2e`'s peer: its own `llama-bench` on the same GGUF file, at the same thread count.

llama-bench measures prompt processing ("pp N": N prompt tokens, tokens/s) and text generation ("tg N": N tokens
after an empty prompt, tokens/s) apart; a prefill row compares with pp of its prompt length, a decode row with tg of
its output length. Beams have no counterpart. Build llama-bench outside the project (README, Benchmarks).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tandem.kernels.errors import TandemError

TIMEOUT_S = 3600  # one llama-bench run, every size: generous, but never a hang


def run_tool(binary: Path, tool: str, args: list[str]) -> str:
    """One run of llama.cpp's `tool` (its binary given as --TOOL PATH): its standard output, or a TandemError with
    the last line it printed on failure."""
    if not binary.is_file():
        raise TandemError(f"--{tool} {binary}: no such file (build {tool} from llama.cpp's source)")
    try:
        done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except OSError as e:
        raise TandemError(f"--{tool} {binary} could not run: {e}") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise TandemError(f"{tool} failed (status {done.returncode}): {tail}")
    return done.stdout


def run_llama_bench(binary: Path, model: Path, threads: int, prompts: list[int], gens: list[int],
                    repeats: int = 2) -> dict[tuple[str, int], float]:
    """{("pp", n) or ("tg", n): tokens/s} from one `llama-bench -o json` run over every size asked."""
    out = run_tool(binary, "llama-bench", ["-m", str(model), "-t", str(threads), "-r", str(repeats), "-o", "json",
                                           "-p", ",".join(map(str, prompts)) or "0",
                                           "-n", ",".join(map(str, gens)) or "0"])
    try:
        entries: list[dict[str, Any]] = json.loads(out)
    except json.JSONDecodeError:
        raise TandemError("llama-bench printed no JSON; is it llama.cpp's llama-bench?") from None
    results: dict[tuple[str, int], float] = {}
    for e in entries:
        prompt, gen = int(e.get("n_prompt", 0)), int(e.get("n_gen", 0))
        if prompt and not gen:
            results[("pp", prompt)] = float(e["avg_ts"])
        elif gen and not prompt:
            results[("tg", gen)] = float(e["avg_ts"])
    return results


def llama_rows(rows: list[dict[str, Any]], binary: Path, model: Path, threads: int) -> str:
    """Adds llama.cpp's tokens/s (and Tandem's ratio to it) to the decode and prefill rows; returns the peer's
    description for the result."""
    prompts = sorted({r["input"] for r in rows if r["scenario"] == "prefill"})
    gens = sorted({r["output"] for r in rows if r["scenario"] == "decode"})
    measured = run_llama_bench(binary, model, threads, prompts, gens)
    for row in rows:
        if row["scenario"] == "prefill":  # prompt tokens/s, as pp counts them
            theirs, ours = measured.get(("pp", row["input"])), row["tandem_tok_s"]
        elif row["scenario"] == "decode" and row["itl_ms"]:  # tg times generation alone: so does 1 / ITL
            theirs, ours = measured.get(("tg", row["output"])), 1000.0 / row["itl_ms"]
            row["decode_tok_s"] = round(ours, 3)
        else:
            continue
        if theirs:
            row |= {"peer_tok_s": round(theirs, 3), "ratio": round(ours / theirs, 3)}
    return (f"llama.cpp ({binary.name}, {threads} threads; prefill rows against pp, decode rows' 1/ITL against "
            "tg)")
