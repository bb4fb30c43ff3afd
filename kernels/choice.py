"""Which path a product takes: the kernel variant for a weight kind, compute dtype and token count (`best_isa`), how
far each kind stays on the kernel before torch takes over (the crossovers and chunk counts, measured in
docs/bench/kernels.md), and what the CPU experts can run at all (`check_support`).
"""

from __future__ import annotations

import functools

import torch

from tandem.kernels.errors import KernelError
from tandem.kernels.library import BLOCK_KINDS, Q8_KINDS, available_isas
from tandem.kernels.names import BLOCK_QUANTS, Quant
from tandem.kernels.quant import GROUPS, MX_BLOCK

BF16_ONLY = ("avx512bf16", "amx")  # bf16 activations (AMX int8 and int4: 16-bit fixed point, about as fine)
DEFAULT_CROSSOVER = 8  # tokens; the auto-tuner measures the real crossover
AMX_CROSSOVER = 16  # with AMX tiles the kernel stays at the bandwidth roofline up to a full tile of tokens
AMX_KINDS = (torch.bfloat16, "int8", "int4")
QUANT_KINDS: tuple[Quant, ...] = ("int8", "int4", "mxfp4")  # what the executor quantizes each expert to
QUANTIZED = (*QUANT_KINDS, *BLOCK_KINDS)  # kinds torch has no fast path for: kept on the kernel for longer prompts
# float32 x against bf16 dense weights stays on the kernel, 16 tokens a call, up to this many calls; beyond, a
# float32 copy of the matrix for torch pays for itself (up to 64 tokens the kernel is ahead on 6144x2048 with
# AVX-512 and with AVX2: docs/bench/kernels.md).
FLOAT_CHUNKS = 4
# GGUF blocks: tokens per kernel call (experts, MXFP4's too: at least; dense matrices: at most, csrc/common.h
# BLOCK_TOKENS). Their several-token kernels compute 8 tokens at a time, each row's blocks unpacked once per 8 from
# L1: more tokens a call stream each matrix from memory fewer times in a prompt (docs/bench/README.md).
BLOCK_STEP = 32
QUANT_CHUNKS = 32  # quantized experts stay on the kernel up to this many chunks of tokens (measured: beyond
# that, dequantizing once and using torch's matmul wins) where torch multiplies bf16 natively (quant_chunks)
# bf16 or fp16 weights under float32 compute stay on the kernel past one call, TILED_CALL tokens a call through
# its tiled product (csrc/tiles.c, from TILED_TOKENS a call), up to this many tokens on each variant: torch would
# convert the whole expert to float32 on each call first. Measured: docs/bench/kernels.md.
TILED_TOKENS = 16  # csrc/common.h TILED_TOKENS (AVX-512: twice that)
TILED_CALL = 64
TILED_UP_TO = {"avx2": 64, "avx512": 32}
# GGUF blocks take the tiled product in whole calls of BLOCK_STEP tokens, on these variants (csrc/tiles.c
# tiled_blocks): AVX-512 every format; AVX2 those its int8 path was measured behind (Q8_0, Q5_0, Q5_1) or lacks
# (MXFP4).
TILED_BLOCKS = {"avx512": BLOCK_KINDS, "avx2": ("Q8_0", "Q5_0", "Q5_1", "MXFP4")}
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what experts take and return (they sum in float32)


def quant_chunks(dtype: torch.dtype) -> int:
    """Chunks of tokens of `dtype` that quantized weights stay on the kernel for: QUANT_CHUNKS where torch's product
    in that dtype is native (float32; bf16 with AVX512_BF16 or AMX: past that, dequantizing once for torch wins);
    for bf16 without it, every chunk (torch's bf16 product emulated: a 2048-token prompt of a Q4_K_M file ran at 0.4
    of llama.cpp's speed on the AVX2 mask, against 1.1 for 512 tokens)."""
    return QUANT_CHUNKS if dtype != torch.bfloat16 or native_bf16() else 1 << 30


@functools.cache
def native_bf16() -> bool:
    return "avx512bf16" in available_isas()


def int8_only(isa: str, kind: object) -> bool:
    """Whether this variant computes blocks of this kind against int8 activations alone (AVX2's Q8_KINDS blocks,
    csrc/q8avx2.c): not a float32 path."""
    return isa == "avx2" and kind in Q8_KINDS


def best_isa(kind: object, compute_dtype: torch.dtype, isas: list[str], tokens: int = 1) -> str | None:
    """The fastest variant of those offered for this weight kind and token count. The bf16 dot-product units
    (AMX tiles, vdpbf16ps) only where activations are bf16 anyway; AMX before vdpbf16ps. One token of bf16
    weights has nothing to reuse, and the AVX-512 rows, which stream four long runs at once, reach more of the
    probe's bandwidth than AMX tiles or vdpbf16ps (docs/bench/kernels.md)."""
    if kind == torch.bfloat16 and tokens == 1 and "avx512" in isas:
        return "avx512"
    if kind == "mxfp4" and compute_dtype == torch.bfloat16 and "avx512bf16" in isas:
        return "avx512bf16"  # one token by vdpbf16ps, several against int8 activations (csrc/q8.c)
    if kind in Q8_KINDS and compute_dtype == torch.bfloat16:  # against int8 activations, one token or several
        for isa in ("avx512bf16", "avx2"):  # csrc/q8.c, csrc/q8avx2.c
            if isa in isas:
                return isa
    if kind in AMX_KINDS and compute_dtype == torch.bfloat16:
        if "amx" in isas:
            return "amx"
        if kind == torch.bfloat16 and "avx512bf16" in isas:
            return "avx512bf16"
    for isa in ("avx512", "avx2", "base"):
        if isa in isas and not int8_only(isa, kind):
            return isa
    return None


WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # expert weights the kernels read as stored


def check_support(hidden: int, inter: int, compute_dtype: torch.dtype, quant: str | None = None, group: int = 64,
                  weight_dtype: torch.dtype | None = None, kernel_ready: bool = True) -> None:
    """What the CPU experts can run, said before anything is prepared: a `KernelError` naming what is not supported
    (the loader calls this with the checkpoint's shapes and dtypes and the chosen options; `kernel_ready` False:
    experts no kernel computes, run by their own torch code)."""
    if quant is not None and not kernel_ready:
        raise KernelError(torch_path_quant(quant))
    if compute_dtype not in COMPUTE_DTYPES:
        raise KernelError(f"experts compute in float32, bf16 or fp16, not {compute_dtype}")
    if quant not in (None, *QUANT_KINDS, *BLOCK_QUANTS):
        raise KernelError(f"quantization must be one of {', '.join(QUANT_KINDS + BLOCK_QUANTS)} or None, not "
                          f"{quant!r}")
    block = {"q8_0": 32, "q4_k": 256}.get(quant or "", 0)
    if block and (hidden % block or inter % block):
        raise KernelError(f"{quant} takes blocks of {block} values: the hidden size and expert width ({hidden}, "
                          f"{inter}) must be multiples of {block}")
    if quant == "int4" and (group not in GROUPS or hidden % group or inter % group):
        raise KernelError(f"int4 groups must be one of {GROUPS} and divide the hidden size and expert width "
                          f"({hidden}, {inter}), not {group!r}")
    if quant == "mxfp4" and (hidden % MX_BLOCK or inter % MX_BLOCK):
        raise KernelError(f"MXFP4 takes blocks of {MX_BLOCK} values: the hidden size and expert width ({hidden}, "
                          f"{inter}) must be multiples of {MX_BLOCK}")
    if weight_dtype is not None and weight_dtype not in WEIGHT_DTYPES:
        raise KernelError(f"expert weights of dtype {weight_dtype} are not supported (float32, bf16 or fp16)")


def torch_path_quant(quant: str) -> str:
    return (f"{quant} quantization is not supported for experts the kernels do not compute (gpt-oss's clamped "
            "SwiGLU with biases); run without --quant")

