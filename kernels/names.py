"""The kernels' choices by name, torch-free: what the command line offers (app/cli/flags.py builds its choice lists from
these) and what kernels/choice.py, kernels/experts.py and kernels/quant.py run."""

from __future__ import annotations

from typing import Literal

Isa = Literal["base", "avx2", "avx512", "avx512bf16", "amx"]  # a kernel variant
Quant = Literal["int8", "int4", "mxfp4", "q8_0", "q4_k"]  # weight-only quantization of experts
# each variant is named after the CPU feature it needs (base: none)
ISAS: tuple[Isa, ...] = ("base", "avx2", "avx512", "avx512bf16", "amx")
# GGUF's block formats, which the loader quantizes to once and keeps in a cache (runtime/quant_cache.py): the executor
# gets them as blocks
BLOCK_QUANTS: tuple[Quant, ...] = ("q8_0", "q4_k")
GROUPS = (32, 64, 128)  # int4 group sizes the kernels take
