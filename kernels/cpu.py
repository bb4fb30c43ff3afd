"""The CPU expert executor: every expert that runs on the CPU goes through here.

Few tokens (decode, beams, short prompts; up to `crossover`): the compiled kernel in `csrc/`, which
streams each weight row once for all tokens. Many tokens (prefill): torch's matrix multiply, which is
compute-bound and good at it. Weights are used where they lie (read into RAM or memory-mapped by the loader,
file dtype: no re-layout), unless quantization is asked for, which happens once when the expert is prepared (for
AMX the quantized matrices are then laid out as its kernels read them, in row blocks: see `kernels/quant.py`), or
that arrive quantized (MXFP4 from the checkpoint: `prepare_quantized`). Quantized experts stay on the kernel for
longer prompts too, a chunk of tokens at a time. An expert may carry an `Epilogue`: biases and gpt-oss's clamped
SwiGLU, which the kernels apply around their products.

Letters: n tokens, H hidden size, I expert width.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from tandem.kernels.errors import KernelError
from tandem.kernels.isa import masked_features
from tandem.kernels.matmul import linear as torch_linear
from tandem.kernels.names import BLOCK_QUANTS, ISAS, Isa, Quant
from tandem.kernels.quant import GROUPS, MX_BLOCK, QuantizedMatrix, quantize_int4, quantize_int8, quantize_mxfp4

BF16_ONLY = ("avx512bf16", "amx")  # bf16 activations (AMX int8 and int4: 16-bit fixed point, about as fine)
KINDS: dict[object, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, "int8": 3, "int4": 4, "mxfp4": 5}
# GGUF's block formats, by GGUF's names (kernels/blocks.py), rows as the file stores them (csrc/blocks.h)
BLOCK_KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
KINDS.update({name: 6 + i for i, name in enumerate(BLOCK_KINDS)})
# GGUF kinds whose products the AVX512_BF16 and AVX2 variants compute against int8 activations, as llama.cpp does
# (csrc/q8.c, csrc/q8avx2.c), where activations are bf16 anyway; float32 compute keeps the exact float path
# (csrc/blocks.h: on AVX-512, or else the base variant, since AVX2's blocks are the int8 path)
Q8_KINDS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
ACT_SILU, ACT_CLAMPED = 0, 1  # the activations the kernels compute (csrc/common.h)
DEFAULT_CROSSOVER = 8  # tokens; the auto-tuner measures the real crossover
AMX_CROSSOVER = 16  # with AMX tiles the kernel stays at the bandwidth roofline up to a full tile of tokens
AMX_KINDS = (torch.bfloat16, "int8", "int4")
QUANT_KINDS: tuple[Quant, ...] = ("int8", "int4", "mxfp4")  # what the executor quantizes each expert to
QUANTIZED = (*QUANT_KINDS, *BLOCK_KINDS)  # kinds torch has no fast path for: kept on the kernel for longer prompts
AMX_BATCH = 64  # experts one kernel region takes at most (csrc/common.h)
XB_EXTRA = 192  # 16-bit values a row of xb holds beyond its width: room for int8 inputs (csrc/common.h q8_stride)
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
MAX_THREADS = 4096  # a sanity bound: libgomp takes any positive count and allocates per thread
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what experts take and return (they sum in float32)


# Every argument is checked here, in Python, before C sees it: C trusts the sizes it is given, so a wrong shape
# would read past the end of a tensor or crash the process. These checks are a few attribute reads per call.
def check_threads(threads: object) -> int:
    """A thread count the kernels can take: a whole number from 1 to MAX_THREADS."""
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"thread count must be a whole number from 1 to {MAX_THREADS}, not {threads!r}")
    return threads


def _check_size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive whole number, not {value!r}")
    return value


def _check_matrix(name: str, w: torch.Tensor, shape: tuple[int, int]) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, not {type(w).__name__}")
    if w.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, not {w.device}")
    if tuple(w.shape) != shape:
        raise ValueError(f"{name} has shape {list(w.shape)}; this executor needs {list(shape)}")


def _check_rows(name: str, x: torch.Tensor, width: int, most: int | None = None) -> None:
    """x [n, width], a float CPU tensor (at most `most` rows)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, not {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{name} has shape {list(x.shape)}; expected [tokens, {width}]")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.device.type != "cpu":
        raise ValueError(f"{name} must be a float32, bf16 or fp16 CPU tensor, not {x.dtype} on {x.device}")
    if most is not None and x.shape[0] > most:
        raise ValueError(f"{name} has {x.shape[0]} rows; this call takes at most {most}")


class _Args(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int), ("isa", ctypes.c_int), ("tokens", ctypes.c_int), ("hidden", ctypes.c_int),
        ("inter", ctypes.c_int), ("threads", ctypes.c_int), ("group", ctypes.c_int),
        ("gate", ctypes.c_void_p), ("up", ctypes.c_void_p), ("down", ctypes.c_void_p),
        ("gate_scale", ctypes.c_void_p), ("up_scale", ctypes.c_void_p), ("down_scale", ctypes.c_void_p),
        ("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("act", ctypes.c_void_p), ("xb", ctypes.c_void_p),
        ("gate_bias", ctypes.c_void_p), ("up_bias", ctypes.c_void_p), ("down_bias", ctypes.c_void_p),
        ("act_kind", ctypes.c_int), ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
        ("down_kind", ctypes.c_int),
    ]


class _Weights(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale",
                                                      "gate_bias", "up_bias", "down_bias")]


class _MoeArgs(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.c_int), ("top_k", ctypes.c_int), ("experts", ctypes.c_int), ("slots", ctypes.c_int),
        ("chunk", ctypes.c_int), ("ids", ctypes.c_void_p), ("weights", ctypes.c_void_p), ("x", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("table", ctypes.c_void_p), ("arena", ctypes.c_void_p), ("proto", _Args),
        ("x_bf16", ctypes.c_void_p),
    ]


class _LinearArgs(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.c_int), ("inp", ctypes.c_int), ("out", ctypes.c_int), ("threads", ctypes.c_int),
        ("w", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("xb", ctypes.c_void_p),
        ("yb", ctypes.c_void_p), ("isa", ctypes.c_int), ("kind", ctypes.c_int),
    ]


class _AttendArgs(ctypes.Structure):
    _fields_ = [
        ("batch", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("dim", ctypes.c_int),
        ("rot", ctypes.c_int), ("bf16", ctypes.c_int), ("threads", ctypes.c_int), ("isa", ctypes.c_int),
        ("start", ctypes.c_int), ("first", ctypes.c_int), ("ld_q", ctypes.c_longlong), ("ld_k", ctypes.c_longlong),
        ("ld_v", ctypes.c_longlong), ("context", ctypes.c_longlong), ("q", ctypes.c_void_p), ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("kcache", ctypes.c_void_p),
        ("vcache", ctypes.c_void_p), ("sinks", ctypes.c_void_p), ("scale", ctypes.c_float), ("out", ctypes.c_void_p),
        ("rows", ctypes.c_void_p), ("starts", ctypes.c_void_p), ("window", ctypes.c_int),
    ]


class _LayerArgs(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int), ("n_qkv", ctypes.c_int), ("qk_norm", ctypes.c_int), ("scoring", ctypes.c_int),
        ("normalize", ctypes.c_int), ("window", ctypes.c_int), ("eps", ctypes.c_float), ("scaling", ctypes.c_float),
        ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p), ("h", ctypes.c_void_p), ("hf", ctypes.c_void_p), ("qkv_out", ctypes.c_void_p),
        ("attend_out", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p), ("router_bias", ctypes.c_void_p),
        ("o_bias", ctypes.c_void_p), ("qkv", _LinearArgs * 3), ("o", _LinearArgs), ("router", _LinearArgs),
        ("attend", _AttendArgs), ("moe", _MoeArgs), ("f32", ctypes.c_int),
    ]


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they were not built (the torch path is used then)."""
    spec = importlib.util.find_spec("tandem.kernels._cpu")
    if spec is None or spec.origin is None:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError:
        return None
    lib.tk_isa_mask.restype = ctypes.c_int
    lib.tk_limit_isas.argtypes = [ctypes.c_int]
    lib.tk_limit_isas.restype = None
    # As if the CPU lacked what TANDEM_CPU_FEATURES removes (the VNNI kernels run only beside AMX, which goes too)
    removed = masked_features()
    lib.tk_limit_isas(sum(1 << i for i, name in enumerate(ISAS) if name not in removed))
    lib.tk_expert.argtypes = [ctypes.POINTER(_Args)]
    lib.tk_expert.restype = ctypes.c_int
    lib.tk_experts.argtypes = [ctypes.POINTER(_Args), ctypes.c_int]
    lib.tk_experts.restype = ctypes.c_int
    lib.tk_moe.argtypes = [ctypes.POINTER(_MoeArgs)]
    lib.tk_moe.restype = ctypes.c_int
    lib.tk_moe_slot_bytes.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.tk_moe_slot_bytes.restype = ctypes.c_size_t
    lib.tk_rms_norm_bf16.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int, ctypes.c_int, ctypes.c_float]
    lib.tk_rms_norm_bf16.restype = None
    lib.tk_rms_norm_f32.argtypes = lib.tk_rms_norm_bf16.argtypes
    lib.tk_rms_norm_f32.restype = None
    lib.tk_dequantize_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_int, ctypes.c_void_p]
    lib.tk_dequantize_rows.restype = ctypes.c_int
    lib.tk_linear.argtypes = [ctypes.POINTER(_LinearArgs)]
    lib.tk_linear.restype = ctypes.c_int
    lib.tk_attend_one.argtypes = [ctypes.POINTER(_AttendArgs)]
    lib.tk_attend_one.restype = ctypes.c_int
    lib.tk_decode_layers.argtypes = [ctypes.POINTER(_LayerArgs), ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_void_p]
    lib.tk_decode_layers.restype = ctypes.c_int
    lib.tk_read_sum.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    lib.tk_read_sum.restype = ctypes.c_double
    lib.tk_struct_size.argtypes = [ctypes.c_int]
    lib.tk_struct_size.restype = ctypes.c_size_t
    drifted = [s.__name__ for s, c in struct_sizes(lib) if ctypes.sizeof(s) != c]
    if drifted:  # a stale build beside newer Python (or the reverse): calling it would corrupt memory
        raise RuntimeError(f"the compiled kernels disagree with kernels/cpu.py on {', '.join(drifted)}; rebuild "
                           "them (make, or pip install -e .)")
    return lib


def struct_sizes(lib: ctypes.CDLL) -> list[tuple[type[ctypes.Structure], int]]:
    """Each argument structure with the size the compiled library gives its C counterpart."""
    return [(s, lib.tk_struct_size(i))
            for i, s in enumerate((_Args, _Weights, _MoeArgs, _LinearArgs, _AttendArgs, _LayerArgs))]


def available_isas() -> list[str]:
    lib = library()
    if lib is None:
        return []
    mask = lib.tk_isa_mask()
    return [name for i, name in enumerate(ISAS) if mask & (1 << i)]


def quant_chunks(dtype: torch.dtype) -> int:
    """Chunks of tokens of `dtype` that quantized weights stay on the kernel for: QUANT_CHUNKS where torch's product
    in that dtype is native (float32; bf16 with AVX512_BF16 or AMX: past that, dequantizing once for torch wins);
    for bf16 without it, every chunk (torch's bf16 product emulated: a 2048-token prompt of a Q4_K_M file ran at 0.4
    of llama.cpp's speed on the AVX2 mask, against 1.1 for 512 tokens)."""
    return QUANT_CHUNKS if dtype != torch.bfloat16 or _native_bf16() else 1 << 30


@functools.cache
def _native_bf16() -> bool:
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


PROBE_STREAMS = (1, 2, 4, 8)  # streams per thread the probe's loop reads side by side (csrc/api.c tk_read_sum)


def read_bandwidth_probe(buffer: torch.Tensor, threads: int, streams: int = 8) -> float:
    """Sum a float32 buffer with the kernel library's streaming loop (for DRAM bandwidth measurement), each thread
    reading its share as `streams` streams side by side (one of PROBE_STREAMS)."""
    check_threads(threads)
    if streams not in PROBE_STREAMS:
        raise ValueError(f"the bandwidth probe reads {', '.join(map(str, PROBE_STREAMS))} streams a thread, not "
                         f"{streams}")
    if buffer.dtype != torch.float32 or not buffer.is_contiguous() or buffer.device.type != "cpu":
        raise ValueError("the bandwidth probe sums a contiguous float32 CPU buffer")
    lib = library()
    if lib is None:
        return float(buffer.sum())
    return lib.tk_read_sum(buffer.data_ptr(), buffer.numel(), threads, streams)


WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # expert weights the kernels read as stored


def check_support(hidden: int, inter: int, compute_dtype: torch.dtype, quant: str | None = None, group: int = 64,
                  weight_dtype: torch.dtype | None = None, kernel_ready: bool = True) -> None:
    """What the CPU experts can run, said before anything is prepared: a `KernelError` naming what is not supported
    (the loader calls this with the checkpoint's shapes and dtypes and the chosen options; `kernel_ready` False:
    experts no kernel computes, run by their own torch code)."""
    if quant is not None and not kernel_ready:
        raise KernelError(_torch_path_quant(quant))
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


def _torch_path_quant(quant: str) -> str:
    return (f"{quant} quantization is not supported for experts the kernels do not compute (gpt-oss's clamped "
            "SwiGLU with biases); run without --quant")


@dataclass(frozen=True)
class CpuOptions:
    """How CPU experts run: thread count, kernel/torch crossover, opt-in weight-only quantization."""

    threads: int | None = None  # None: torch's intra-op thread count
    crossover: int | None = None  # up to this many tokens: the compiled kernel; more: torch (None: default)
    quant: Quant | None = None
    group: int = 64  # int4 group size: 32, 64 or 128
    isa: Isa | None = None  # force a kernel variant ("base", "avx2", "avx512", "avx512bf16")
    use_kernel: bool = True  # False: torch only
    resident: bool | None = None  # read the weights into RAM at load (they stream faster from there than from the
    # memory map); None: the loader decides by the RAM available

    @property
    def experts_in_ram(self) -> bool:
        """Whether unquantized experts are read into RAM (quantized ones are RAM copies whatever this says)."""
        return bool(self.resident) and self.quant is None

    def executor(self, hidden: int, inter: int, compute_dtype: torch.dtype) -> CpuExecutor:
        quant = self.quant if self.quant in QUANT_KINDS else None  # (block formats arrive quantized)
        return CpuExecutor(hidden, inter, compute_dtype, self.threads, self.crossover, quant, self.group, self.isa,
                           self.use_kernel)

    def expert_bytes(self, hidden: int, inter: int, stored: int) -> int:
        """RAM one expert takes beyond its memory-mapped file bytes (quantized or resident copies only)."""
        params = 3 * hidden * inter
        if self.quant == "int8":
            return params + (2 * inter + hidden) * 4
        if self.quant == "int4":
            return params // 2 + params // self.group * 2  # bf16 scale per group
        if self.quant == "mxfp4":
            return params // 2 + params // MX_BLOCK  # a scale byte per block
        if self.quant in BLOCK_QUANTS:
            return 0  # memory-mapped from the cache file (runtime/quant_cache.py)
        return params * stored if self.experts_in_ram else 0


def clamped_glu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: the gate clamped above at `limit`, the up projection to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate). The reference expert (runtime/moe.py) and the torch path share it."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass(frozen=True)
class Epilogue:
    """What an expert adds around its three products (gpt-oss): biases of gate and up (before the activation) and of
    down (after it), float32; and the clamped SwiGLU's (alpha, limit), or None for plain SwiGLU."""

    gate_bias: torch.Tensor | None = None  # [I]
    up_bias: torch.Tensor | None = None  # [I]
    down_bias: torch.Tensor | None = None  # [H]
    clamped: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for name in ("gate_bias", "up_bias", "down_bias"):
            b = getattr(self, name)
            if b is not None and (b.dtype != torch.float32 or b.dim() != 1 or not b.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous float32 vector, not {b.dtype} {list(b.shape)}")

    def run(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """The expert in torch over plain weights (x's dtype): [n, H] -> [n, H]."""
        def bias(b: torch.Tensor | None) -> torch.Tensor | None:
            return None if b is None else b.to(x.dtype)
        g, u = F.linear(x, gate, bias(self.gate_bias)), F.linear(x, up, bias(self.up_bias))  # [n, I]
        h = F.silu(g) * u if self.clamped is None else clamped_glu(g, u, *self.clamped)
        return F.linear(h, down, bias(self.down_bias))

    def fill(self, a: _Args | _Weights) -> None:
        """The biases' addresses (and, for `_Args`, the activation) into a kernel argument structure."""
        a.gate_bias, a.up_bias, a.down_bias = (None if b is None else b.data_ptr()
                                               for b in (self.gate_bias, self.up_bias, self.down_bias))
        if isinstance(a, _Args):
            a.act_kind = ACT_SILU if self.clamped is None else ACT_CLAMPED
            a.alpha, a.limit = self.clamped or (0.0, 0.0)


NO_EPILOGUE = Epilogue()


@dataclass(frozen=True)
class CpuExpert:
    """One expert ready for the CPU: its weights (views or quantized copies) and how to run them."""

    gate: torch.Tensor | QuantizedMatrix  # [I, H]
    up: torch.Tensor | QuantizedMatrix  # [I, H]
    down: torch.Tensor | QuantizedMatrix  # [H, I]
    kind: object  # a torch dtype, "int8", "int4", "mxfp4", or a GGUF block format (BLOCK_KINDS: gate and up's)
    executor: CpuExecutor
    amx_layout: bool = False  # quantized and laid out for the AMX kernels: only they (or torch, converted) read it
    # an expert the kernels do not compute (gpt-oss's clamped SwiGLU with biases): this torch function runs it, at
    # every token count ([n, H] -> [n, H]); the weights above are then only views, never read by a kernel
    reference: Callable[[torch.Tensor], torch.Tensor] | None = None
    epilogue: Epilogue = NO_EPILOGUE  # biases and clamped SwiGLU, applied by the kernels and by the torch path

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        return self.executor.run(self, x)

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def plain(w: torch.Tensor | QuantizedMatrix) -> torch.Tensor:
            if isinstance(w, QuantizedMatrix):
                return w.dequantize(dtype)
            # no .to() where the dtype matches: even a no-op one makes the expert slower (docs/bench/kernels.md)
            return w if w.dtype == dtype else w.to(dtype)
        return plain(self.gate), plain(self.up), plain(self.down)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes if isinstance(w, QuantizedMatrix) else w.numel() * w.element_size()
                   for w in (self.gate, self.up, self.down))

    @property
    def down_kind(self) -> object:
        """down's weight kind: `kind`, or another GGUF block format."""
        return self.down.kind if isinstance(self.down, QuantizedMatrix) else self.kind

    def pointers(self) -> _Weights:
        """The kernel's view of this expert: its weight (and scale) addresses."""
        mats = (self.gate, self.up, self.down)
        if isinstance(self.gate, QuantizedMatrix):
            w = _Weights(*(m.data.data_ptr() for m in mats), *(m.scales.data_ptr() for m in mats))  # type: ignore
        else:
            w = _Weights(*(m.data_ptr() for m in mats))  # type: ignore[union-attr]
        self.epilogue.fill(w)
        return w


@dataclass(frozen=True)
class LayerExperts:
    """All experts of one MoE layer for `CpuExecutor.run_layer`: the kernel's table of their weight pointers
    (valid while `experts` holds the weights)."""

    experts: list[CpuExpert]
    table: ctypes.Array[_Weights]


class CpuExecutor:
    """Runs CPU experts with preallocated buffers and an explicit thread count.

    `isa` forces a kernel variant (e.g. "avx2" to test the fallback on a newer CPU); None picks the best.
    The tensor returned by `run` is valid until the next call (it is a view of a reused buffer)."""

    def __init__(
        self, hidden: int, inter: int, compute_dtype: torch.dtype, threads: int | None = None,
        crossover: int | None = None, quant: str | None = None, group: int = 64, isa: str | None = None,
        use_kernel: bool = True,
    ) -> None:
        self.hidden, self.inter = _check_size("hidden size", hidden), _check_size("expert width", inter)
        check_support(hidden, inter, compute_dtype, quant, group)
        if crossover is not None and not (isinstance(crossover, int) and crossover >= 0):
            raise ValueError(f"crossover must be a whole number of tokens, at least 0 (torch only), not {crossover!r}")
        self.dtype = compute_dtype
        self.threads = check_threads(torch.get_num_threads() if threads is None else threads)
        self.quant, self.group = quant, group
        self.lib = library() if use_kernel else None
        self.isas = available_isas() if self.lib is not None else []
        if crossover is None:
            crossover = AMX_CROSSOVER if "amx" in self.isas and compute_dtype == torch.bfloat16 else DEFAULT_CROSSOVER
        self.crossover = crossover
        if isa is not None and isa not in self.isas:
            have = ", ".join(self.isas) or "none"
            raise KernelError(f"kernel variant {isa!r} is not available here (available: {have})")
        self.forced_isa = isa
        self._isa_cache: dict[tuple[object, int, bool], str | None] = {}  # (kind, tokens, amx_layout) -> variant
        self._slots: list[_Slot] = []  # per expert of one call: buffers and arguments, grown on demand
        self._tiled: _Slot | None = None  # a call of TILED_CALL tokens' buffers (_tiled_slot)
        self._batch = (_Args * 0)()
        self._moe: _MoeArgs | None = None  # run_layer's arguments
        # run_layer's scratch, the newest last; one outgrown stays alive: arguments planned with it point there
        self._arenas: list[torch.Tensor] = []

    def amx_serves(self, kind: object) -> bool:
        """Whether AMX tiles can run experts of this weight kind (whole tiles: bf16 takes 32 values; int8 and
        int4 are stored in chunks of 64)."""
        width = 64 if kind in QUANT_KINDS else 32
        return ("amx" in self.isas and kind in AMX_KINDS and self.dtype == torch.bfloat16
                and self.hidden % width == 0 and self.inter % width == 0)

    def prepare_quantized(self, gate: QuantizedMatrix, up: QuantizedMatrix, down: QuantizedMatrix,
                          epilogue: Epilogue = NO_EPILOGUE) -> CpuExpert:
        """One expert whose weights arrive quantized, used as they are: MXFP4 from a checkpoint, or GGUF blocks
        (gate and up of one format; down may be of another, as Q4_K_M's Q6_K rows)."""
        h, i = self.hidden, self.inter
        kind = gate.kind if isinstance(gate, QuantizedMatrix) else None
        if kind not in ("mxfp4", *BLOCK_KINDS):
            raise ValueError(f"gate must be an MXFP4 matrix or GGUF blocks ({', '.join(BLOCK_KINDS)})")
        for name, m, shape in (("gate", gate, (i, h)), ("up", up, (i, h)), ("down", down, (h, i))):
            alike = kind if name != "down" or kind == "mxfp4" else BLOCK_KINDS
            if (not isinstance(m, QuantizedMatrix) or m.kind not in alike or (m.data.shape[0], m.cols) != shape
                    or m.blocked):
                raise ValueError(f"{name} must be a {kind} matrix of {list(shape)} values, as gate is")
        if kind == "mxfp4":
            check_support(h, i, self.dtype, "mxfp4")
        return CpuExpert(gate, up, down, kind, self, epilogue=epilogue)

    def prepare(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                reference: Callable[[torch.Tensor], torch.Tensor] | None = None,
                epilogue: Epilogue = NO_EPILOGUE) -> CpuExpert:
        """Wrap (or quantize) one expert's weights; unquantized weights are used in place, never copied.
        `reference`: the expert is not one the kernels compute; this function runs it (CpuExpert.reference)."""
        h, i = self.hidden, self.inter
        for name, w, shape in (("gate", gate, (i, h)), ("up", up, (i, h)), ("down", down, (h, i))):
            _check_matrix(name, w, shape)
        if reference is not None:
            if self.quant is not None:
                raise KernelError(_torch_path_quant(self.quant))
            return CpuExpert(gate, up, down, gate.dtype, self, reference=reference)  # views: never made contiguous
        if not gate.dtype == up.dtype == down.dtype:
            raise ValueError(f"an expert's gate, up and down must share one dtype, not {gate.dtype}, {up.dtype}, "
                             f"{down.dtype}")
        if not gate.dtype.is_floating_point:
            raise ValueError(f"expert weights must be floating point, not {gate.dtype}")
        if self.quant in QUANT_KINDS:
            g = self.group
            quantize = {"int8": quantize_int8, "int4": lambda w: quantize_int4(w, g), "mxfp4": quantize_mxfp4}
            mats = [quantize[self.quant](w) for w in (gate, up, down)]
            amx = self.forced_isa in (None, "amx") and self.amx_serves(self.quant)
            if amx:
                mats = [m.blocked_layout() for m in mats]  # the layout the AMX kernels read
            return CpuExpert(*mats, self.quant, self, amx_layout=amx, epilogue=epilogue)
        if gate.dtype not in WEIGHT_DTYPES:
            raise KernelError(f"expert weights of dtype {gate.dtype} are not supported (float32, bf16 or fp16)")
        gate, up, down = (w.contiguous() for w in (gate, up, down))  # memory-mapped weights already are
        return CpuExpert(gate, up, down, gate.dtype, self, epilogue=epilogue)

    def isa_for(self, expert: CpuExpert, tokens: int = 1) -> str | None:
        if expert.reference is not None:  # no kernel computes it: torch (`_run_torch`) at every token count
            return None
        key = (expert.kind, tokens, expert.amx_layout)
        if key not in self._isa_cache:  # the decode hot path asks this for every expert call
            self._isa_cache[key] = self._choose_isa(expert.kind, tokens, expert.amx_layout)
        return self._isa_cache[key]

    def _choose_isa(self, kind: object, tokens: int, amx_layout: bool) -> str | None:
        if self.lib is None:
            return None
        if amx_layout:  # laid out for the AMX kernels alone
            return "amx" if "amx" in self.isas and tokens <= AMX_CROSSOVER else None
        isas = [i for i in self.isas if i not in BF16_ONLY]
        if (kind == torch.bfloat16 and self.inter % 2 == 0) or kind == "mxfp4" or kind in BLOCK_KINDS:
            isas.append("avx512bf16")  # vdpbf16ps (bf16: rows in pairs); GGUF blocks against int8 (csrc/q8.c)
        if self.amx_serves(kind) and tokens <= AMX_CROSSOVER and kind not in QUANT_KINDS:
            isas.append("amx")  # quantized weights reach AMX only in its block layout (the branch above)
        isas = [i for i in isas if i in self.isas]
        if self.forced_isa in isas:
            return self.forced_isa
        return best_isa(kind, self.dtype, isas, tokens)

    def _step(self, expert: CpuExpert) -> int:
        """Tokens per kernel call for this expert. GGUF blocks and MXFP4: at least BLOCK_STEP while the kernel is on
        (crossover > 0)."""
        if expert.amx_layout:
            return min(self.crossover, AMX_CROSSOVER)
        if (expert.kind in BLOCK_KINDS or expert.kind == "mxfp4") and self.crossover:
            return max(self.crossover, BLOCK_STEP)
        return self.crossover

    def _check_expert(self, expert: CpuExpert) -> None:
        """The expert was prepared for this executor's sizes (its kernel reads them as this executor's)."""
        if not isinstance(expert, CpuExpert):
            raise TypeError(f"expected an expert from CpuExecutor.prepare, not {type(expert).__name__}")
        ex = expert.executor
        if (ex.hidden, ex.inter, ex.quant, ex.group) != (self.hidden, self.inter, self.quant, self.group):
            raise ValueError(f"this expert was prepared for {ex.hidden}x{ex.inter} ({ex.quant or 'unquantized'}); "
                             f"this executor runs {self.hidden}x{self.inter} ({self.quant or 'unquantized'})")

    def run(self, expert: CpuExpert, x: torch.Tensor) -> torch.Tensor:
        self._check_expert(expert)
        _check_rows("x", x, self.hidden)
        n = x.shape[0]
        if n == 0:
            return x.new_zeros(0, self.hidden)
        step = self._step(expert)
        isa = self.isa_for(expert, min(n, step))
        if isa is not None and n <= step:
            return self._run_kernel(expert, x, isa).to(x.dtype)
        call = self._kernel_call(expert, x.dtype, isa, step, n)
        if call:
            slot = self._tiled_slot() if call > step else None
            # (each chunk copied out of the reused buffer before the next overwrites it, float32 included)
            return torch.cat([self._run_kernel(expert, x[i : i + call], isa, slot).to(x.dtype, copy=True)
                              for i in range(0, n, call)])
        return self._run_torch(expert, x)

    @staticmethod
    def _kernel_call(expert: CpuExpert, dtype: torch.dtype, isa: str | None, step: int, n: int) -> int:
        """Tokens a kernel call takes where `n` tokens are more than one call's `step`, re-streaming the weights for
        each call, or 0 where torch takes them all: quantized weights `step` a call up to quant_chunks(dtype) calls
        (torch has no fast int4 path and its int8 one slows down with tokens); bf16 or fp16 weights under float32
        compute on AVX2 and AVX-512 TILED_CALL a call up to TILED_UP_TO (torch would convert the whole expert each
        call)."""
        if isa is None or not step:
            return 0
        if expert.kind in QUANTIZED:
            return step if n <= quant_chunks(dtype) * step else 0
        if expert.kind in (torch.bfloat16, torch.float16) and dtype == torch.float32 and n <= TILED_UP_TO.get(isa, 0):
            return TILED_CALL
        return 0

    def _tiled_slot(self) -> _Slot:
        """The buffers of a call of TILED_CALL tokens (made on first use)."""
        if self._tiled is None:
            self._tiled = _Slot(self.hidden, self.inter, TILED_CALL)
        return self._tiled

    def _run_torch(self, expert: CpuExpert, x: torch.Tensor) -> torch.Tensor:
        if expert.reference is not None:
            return expert.reference(x)
        if expert.kind == "int8" and x.shape[0] <= AMX_CROSSOVER and expert.epilogue is NO_EPILOGUE:
            # torch's int8 weight-only matmul (reads the row-major layout as it is): fine for a few tokens only
            mm = torch.ops.aten._weight_int8pack_mm
            g, u, d = (m.row_major() for m in (expert.gate, expert.up, expert.down))  # type: ignore[union-attr]
            h = F.silu(mm(x, g.data, g.scales.to(x.dtype))) * mm(x, u.data, u.scales.to(x.dtype))  # type: ignore
            return mm(h, d.data, d.scales.to(x.dtype))  # type: ignore[union-attr]
        gate, up, down = expert.dense(x.dtype)
        if expert.epilogue is not NO_EPILOGUE:
            return expert.epilogue.run(x, gate, up, down)
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    def run_many(self, jobs: list[tuple[CpuExpert, torch.Tensor]], sink: Callable[[int, torch.Tensor], None]) -> None:
        """Several experts of one layer, each on its own tokens; `sink(i, y)` receives job i's output [n, H]
        (valid only during the call; float32 from the kernel, x's dtype from torch). Those the kernel takes in one
        call go through one kernel call, which runs those that can share a parallel region together
        (csrc/api.c `tk_experts`); the rest one at a time."""
        for expert, x in jobs:
            self._check_expert(expert)
            _check_rows("x", x, self.hidden)
        isas = [self.isa_for(expert, x.shape[0]) for expert, x in jobs]
        together = [i for i, (expert, x) in enumerate(jobs)
                    if isas[i] is not None and 0 < x.shape[0] <= self._step(expert)]
        if len(together) < 2:
            together = []
        alone = set(range(len(jobs))).difference(together)
        for i in sorted(alone):
            sink(i, self.run(*jobs[i]))
        if not together:
            return
        while len(self._slots) < len(together):
            self._slots.append(_Slot(self.hidden, self.inter, max(self.crossover, BLOCK_STEP)))
        if len(self._batch) < len(together):
            self._batch = (_Args * len(self._slots))()
        for k, i in enumerate(together):
            expert, x = jobs[i]
            self._slots[k].fill(self._batch[k], self, expert, x, isas[i])  # type: ignore[arg-type]
        code = self.lib.tk_experts(self._batch, len(together))  # type: ignore[union-attr]
        _check_expert_code(code)
        for k, i in enumerate(together):
            sink(i, self._slots[k].out[: jobs[i][1].shape[0]])  # float32, as the kernel summed it

    def layer(self, experts: list[CpuExpert]) -> LayerExperts:
        """One layer's experts for `run_layer`, which runs them all as one kind: they must share it."""
        if not experts:
            raise ValueError("a layer needs at least one expert")
        for e in experts:
            self._check_expert(e)
        kinds = {(e.kind, e.down_kind, e.amx_layout) for e in experts}
        if len(kinds) > 1:
            raise ValueError(f"a layer's experts must share one weight kind, not {sorted(str(k[:2]) for k in kinds)}")
        return LayerExperts(experts, (_Weights * len(experts))(*(e.pointers() for e in experts)))

    def serves_layer(self, layer: LayerExperts, tokens: int) -> bool:
        """Whether `run_layer` can take this many tokens: every expert then gets at most that many, which run_layer
        runs `_chunk` at a time; quantized experts up to quant_chunks calls each (as `run`), others in one."""
        expert = layer.experts[0]
        chunk = self._chunk(expert)
        most = quant_chunks(self.dtype) * chunk if expert.kind in QUANTIZED else chunk
        return self.lib is not None and 0 < tokens <= most and self.isa_for(expert, min(tokens, chunk)) is not None

    def _chunk(self, expert: CpuExpert) -> int:
        """Tokens one expert call of run_layer takes at most (csrc/api.c tk_moe's chunk): as `run_many` does,
        bounded by what one call of the kind takes (GGUF blocks and MXFP4: BLOCK_STEP; else AMX_CROSSOVER)."""
        bound = BLOCK_STEP if expert.kind in BLOCK_KINDS or expert.kind == "mxfp4" else AMX_CROSSOVER
        return min(self._step(expert), bound)

    def moe_args(self, layer: LayerExperts, tokens: int, into: _MoeArgs | None = None) -> _MoeArgs:
        """A tk_moe call's arguments for `tokens` tokens of this layer, all but the routing, x and out: the ones
        run_layer reuses, or `into`. One arena serves every call (they run one at a time)."""
        expert = layer.experts[0]
        chunk = max(1, self._chunk(expert))
        if self._moe is None or self._moe.chunk < chunk:
            slots = min(len(layer.experts), AMX_BATCH)
            per_slot = self.lib.tk_moe_slot_bytes(self.hidden, self.inter, chunk)  # type: ignore[union-attr]
            self._arenas.append(torch.empty(slots * per_slot, dtype=torch.uint8))
            self._moe = _MoeArgs(slots=slots, chunk=chunk, arena=self._arenas[-1].data_ptr())
        a = self._moe
        if into is not None:
            into.slots, into.chunk, into.arena = a.slots, a.chunk, a.arena
            a = into
        kind = KINDS[expert.kind]
        isa = ISAS.index(self.isa_for(expert, min(tokens, chunk)))  # type: ignore[arg-type]
        down_kind = KINDS[expert.down_kind]
        if (a.proto.kind, a.proto.down_kind, a.proto.isa, a.proto.hidden) != (kind, down_kind, isa, self.hidden):
            a.proto = _Args(kind, isa, 0, self.hidden, self.inter, self.threads, self.group)
            a.proto.down_kind = down_kind
        expert.epilogue.fill(a.proto)  # the activation (the biases come per expert from the table)
        a.experts, a.table = len(layer.experts), ctypes.addressof(layer.table)
        return a

    def run_layer(self, layer: LayerExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                  ) -> torch.Tensor:
        """A MoE layer's routed experts in one kernel call: x [T, H], expert ids [T, K], routing weights
        [T, K] -> [T, H], the weighted sum of each token's experts as a new float32 tensor (not rounded to x's
        dtype: it goes into the float32 residual stream)."""
        if layer.experts[0].executor is not self:
            self._check_expert(layer.experts[0])
        if ids.dim() != 2 or weights.shape != ids.shape:
            raise ValueError(f"expert ids {list(ids.shape)} and routing weights {list(weights.shape)} must both be "
                             "[tokens, top_k]")
        T, K = ids.shape
        _check_rows("x", x, self.hidden)
        if x.shape[0] != T or T == 0:
            raise ValueError(f"x has {x.shape[0]} rows but the routing has {T}; both need at least one")
        if not self.serves_layer(layer, T):
            raise ValueError(f"run_layer cannot take {T} tokens of these experts here; use run_many")
        a = self.moe_args(layer, T)
        # right after the weights stream, each small torch op here costs tens of microseconds (a few warm), so
        # the kernel reads a bf16 or float32 x where it lies and conversions happen only when needed
        if x.dtype == torch.bfloat16 and x.is_contiguous():
            a.x_bf16, a.x = x.data_ptr(), None
        else:
            x = x.float().contiguous()  # [T, H] (kept alive through the call)
            a.x_bf16, a.x = None, x.data_ptr()
        if ids.dtype != torch.int64 or not ids.is_contiguous():
            ids = ids.to(torch.int64).contiguous()  # [T, K]
        if weights.dtype != torch.float32 or not weights.is_contiguous():
            weights = weights.float().contiguous()  # [T, K]
        a.tokens, a.top_k = T, K
        a.ids, a.weights = ids.data_ptr(), weights.data_ptr()
        out = torch.empty(T, self.hidden)  # [T, H] float32
        a.out = out.data_ptr()
        code = self.lib.tk_moe(ctypes.byref(a))  # type: ignore[union-attr]
        if code == -6:
            raise ValueError(f"expert ids must be from 0 to {len(layer.experts) - 1}, at least one per token (top_k "
                             f"{K}), none twice for one token")
        _check_expert_code(code)
        return out

    def _run_kernel(self, expert: CpuExpert, x: torch.Tensor, isa: str, slot: _Slot | None = None) -> torch.Tensor:
        if slot is None:
            if not self._slots:
                self._slots.append(_Slot(self.hidden, self.inter, max(self.crossover, BLOCK_STEP)))
            slot = self._slots[0]
        slot.fill(slot.args, self, expert, x, isa)
        code = self.lib.tk_expert(ctypes.byref(slot.args))  # type: ignore[union-attr]
        _check_expert_code(code)
        return slot.out[: x.shape[0]]


OUT_OF_MEMORY = -9  # a kernel's scratch could not be allocated (csrc/tiles.c)


def _check_expert_code(code: int) -> None:
    if code == OUT_OF_MEMORY:
        raise MemoryError("the CPU expert kernel could not allocate its scratch: free some RAM, or use fewer threads")
    if code != 0:
        raise RuntimeError(f"CPU expert kernel rejected its arguments (code {code})")


class _Slot:
    """Preallocated buffers for one expert of a kernel call: input, output, activation scratch, packed input."""

    def __init__(self, hidden: int, inter: int, crossover: int) -> None:
        t = max(1, crossover)
        self.x = torch.empty(t, hidden, dtype=torch.float32)
        self.out = torch.empty(t, hidden, dtype=torch.float32)
        self.act = torch.empty(t, 2 * inter, dtype=torch.float32)
        self.xb = torch.empty(max(t, 16), max(hidden, inter) + XB_EXTRA, dtype=torch.int16)
        self.args = _Args()

    def fill(self, a: _Args, ex: CpuExecutor, expert: CpuExpert, x: torch.Tensor, isa: str) -> None:
        n = x.shape[0]
        self.x[:n].copy_(x)  # float32, contiguous
        a.kind, a.down_kind, a.isa, a.tokens = KINDS[expert.kind], KINDS[expert.down_kind], ISAS.index(isa), n
        a.hidden, a.inter, a.threads, a.group = ex.hidden, ex.inter, ex.threads, ex.group
        w = expert.pointers()
        a.gate, a.up, a.down, a.gate_scale, a.up_scale, a.down_scale = (
            w.gate, w.up, w.down, w.gate_scale, w.up_scale, w.down_scale)
        a.x, a.out, a.act, a.xb = self.x.data_ptr(), self.out.data_ptr(), self.act.data_ptr(), self.xb.data_ptr()
        expert.epilogue.fill(a)


KERNEL_FLOATS = (torch.bfloat16, torch.float16, torch.float32)  # dense matrices the kernel multiplies as they are
PAD_MOST = 2**20  # bytes: bf16 matrices up to this size whose rows are not whole groups of 32 (routers of 8 or 60
# experts) go through the kernel as a copy padded with zero rows, kept beside the matrix: a 30-layer model's routers
# then run in the decode step (runtime/decode_step.py) instead of F.linear between kernel calls


class DenseLinear:
    """`F.linear` for the decoder's dense matrices (attention projections, routers, lm_head). bf16 matrices go
    through the kernel for up to 16 tokens on any CPU: one token on the AVX-512 rows (four long runs per thread),
    more on AMX tiles, else rows through the variant's dot products. It streams a matrix closer to the probe's
    bandwidth than torch's matrix-vector path does (docs/bench/kernels.md), and its float32 sums can
    be had as they are (`out_dtype`): logits that bf16 would round to steps of 1/8 around 16-32, where near ties
    become exact ties. Anything else (an accelerator's tensors among it) is torch's product with the same float32
    sums (`kernels.matmul.linear`). `isa` forces a kernel variant (as `CpuOptions.isa`).

    Letters: n tokens (all leading dimensions together), I input width, O output width."""

    def __init__(self, threads: int | None = None, use_kernel: bool = True, isa: str | None = None) -> None:
        self.lib = library() if use_kernel else None
        if isa is not None and isa not in (available_isas() if self.lib is not None else ISAS):
            have = ", ".join(available_isas()) or "none"
            raise KernelError(f"kernel variant {isa!r} is not available here (available: {have})")
        self.isa = -1 if isa is None else ISAS.index(isa)
        # bf16 results for more tokens than this: torch's matrix product. With AVX512_BF16 but no AMX, oneDNN's
        # is as fast at 4 tokens and faster beyond; elsewhere the kernel is as fast or faster up to 16 (2048x2048:
        # docs/bench/kernels.md).
        have = available_isas() or ["base"]
        self.bf16_most = 4 if have[-1] == "avx512bf16" else AMX_CROSSOVER
        # float32 x: a variant that keeps it so (AVX512_BF16 and AMX would round it to bf16), unless one is forced
        self.float_isa = self.isa if isa is not None else ISAS.index([i for i in have if i not in BF16_ONLY][-1])
        # bf16 x against Q8_KINDS blocks: the int8-activation path of AVX512_BF16, else AVX2's (-1: neither)
        self.q8_isa = next((ISAS.index(i) for i in ("avx512bf16", "avx2") if i in have), -1)
        self.threads = check_threads(torch.get_num_threads() if threads is None else threads)
        self._args = _LinearArgs()
        self._buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pads: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}  # by id(matrix)

    def padded(self, w: torch.Tensor) -> torch.Tensor:
        """w itself where its rows are whole groups of 32 or it is over PAD_MOST; else a copy with zero rows up to
        the next multiple of 32, made once per matrix (the kernel's rows are independent: the first rows of its
        result are w's, bit for bit)."""
        rows = w.shape[0] if w.dim() == 2 else 0
        if (w.dim() != 2 or rows % 32 == 0 or w.dtype not in KERNEL_FLOATS or w.numel() * w.element_size() > PAD_MOST
                or w.device.type != "cpu"):
            return w
        kept = self._pads.get(id(w))
        if kept is not None and kept[0]() is w:
            return kept[1]
        pad = torch.zeros(-(-rows // 32) * 32, w.shape[1], dtype=w.dtype)  # [O rounded up to 32, I]
        pad[:rows] = w
        self._pads[id(w)] = (weakref.ref(w), pad)
        return pad

    def __call__(self, x: torch.Tensor, w: torch.Tensor | QuantizedMatrix | Sequence[QuantizedMatrix],
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., I] . w [O, I]^T (+ bias) -> [..., O] in `out_dtype` (default: x's). x bf16 or float32 (against
        bf16 weights: computed as against a float32 copy of them). w may be GGUF blocks (a QuantizedMatrix of a
        BLOCK_KINDS format), or several of them whose outputs follow one another (q, k and v of different formats)."""
        out_dtype = out_dtype or x.dtype
        if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):  # (fp16, an older GPU's: through torch)
            raise ValueError(f"DenseLinear gives bf16, fp16 or float32 results, not {out_dtype}")
        if isinstance(w, list | tuple):
            y = torch.cat([self(x, part, None, out_dtype) for part in w], dim=-1)  # [..., O]
            return y if bias is None else y.add_(bias.to(y.dtype))
        if isinstance(w, QuantizedMatrix):
            return self._blocks(x, w, bias, out_dtype)
        if w.dim() != 2 or x.dim() == 0 or x.shape[-1] != w.shape[1]:
            raise ValueError(f"x {list(x.shape)} does not fit the matrix {list(w.shape)}: expected [..., {w.shape[-1]}]"
                             " against [out, in]")
        if bias is not None and tuple(bias.shape) != (w.shape[0],):
            raise ValueError(f"bias has shape {list(bias.shape)}; expected [{w.shape[0]}]")
        n, width = (x.numel() // x.shape[-1] if x.shape[-1] else 0), x.shape[-1]
        whole = self.padded(w) if self.lib is not None else w
        if whole is not w:  # the kernel on whole groups of rows, then w's rows
            y = self(x, whole, None, out_dtype)[..., : w.shape[0]]  # [..., O]
            return y.contiguous() if bias is None else y.add(bias.to(y.dtype))
        floats = w.dtype in (torch.float32, torch.float16)  # (float32 compute: the file's own float matrices)
        if not (self.lib is not None and n > 0 and x.dtype in (torch.bfloat16, torch.float32)
                and out_dtype != torch.float16 and w.dtype in KERNEL_FLOATS and x.device.type == "cpu"
                and (not floats or x.dtype == torch.float32)
                and w.shape[0] % 32 == 0 and width % 32 == 0 and w.shape[0] > 0 and w.is_contiguous()):
            return torch_linear(x, w, bias, out_dtype)  # (weights kept in another dtype: converted per call)
        if floats and n > AMX_CROSSOVER:  # a prompt against float matrices: torch's product (one read for all)
            return torch_linear(x, w, bias, out_dtype)
        if out_dtype == torch.bfloat16 and n > self.bf16_most:
            return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype)).to(out_dtype)
        if n > FLOAT_CHUNKS * AMX_CROSSOVER and x.dtype == torch.float32:  # a long prefill against bf16 weights:
            return F.linear(x, w.float(), None if bias is None else bias.float()).to(out_dtype)  # (a float32 copy)
        if n > AMX_CROSSOVER:  # float32 sums, or float32 x: 16 tokens at a time
            rows = x.reshape(n, width)  # [n, I]
            return torch.cat([self(rows[i : i + AMX_CROSSOVER], w, bias, out_dtype)
                              for i in range(0, n, AMX_CROSSOVER)]).view(*x.shape[:-1], w.shape[0])
        isa = self.float_isa if x.dtype == torch.float32 else self.isa
        return self._kernel(x, n, w.data_ptr(), w.shape[0], KINDS[w.dtype], isa, bias, out_dtype)

    def _blocks(self, x: torch.Tensor, w: QuantizedMatrix, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        """x [..., I] against GGUF blocks: the kernel (AVX-512 rows at most) BLOCK_STEP tokens a call for up to
        quant_chunks calls, as the GGUF experts; beyond, or without the kernel, torch over the matrix dequantized for
        this call."""
        rows, width = w.data.shape[0], w.cols
        if x.dim() == 0 or x.shape[-1] != width or w.kind not in BLOCK_KINDS:
            raise ValueError(f"x {list(x.shape)} does not fit the {w.kind} matrix [{rows}, {width}]")
        if bias is not None and tuple(bias.shape) != (rows,):
            raise ValueError(f"bias has shape {list(bias.shape)}; expected [{rows}]")
        n = x.numel() // width
        if not (self.lib is not None and 0 < n <= quant_chunks(x.dtype) * BLOCK_STEP and x.device.type == "cpu"
                and x.dtype in (torch.bfloat16, torch.float32) and rows % 32 == 0 and width % 32 == 0
                and w.data.is_contiguous()):
            return torch_linear(x, w.dequantize(x.dtype), bias, out_dtype)
        if n > BLOCK_STEP:
            flat = x.reshape(n, width)  # [n, I]
            return torch.cat([self._blocks(flat[i : i + BLOCK_STEP], w, bias, out_dtype)
                              for i in range(0, n, BLOCK_STEP)]).view(*x.shape[:-1], rows)
        return self._kernel(x, n, w.data.data_ptr(), rows, KINDS[w.kind], self._block_isa(w.kind, x.dtype), bias,
                            out_dtype)

    def _block_isa(self, kind: str, dtype: torch.dtype) -> int:
        """The variant for x of this dtype against blocks of this kind."""
        if dtype == torch.float32:  # exact float sums: the float path (the AVX-512 rows at most; not AVX2's blocks)
            isa = min(self.float_isa, ISAS.index("avx512"))
            return ISAS.index("base") if int8_only(ISAS[isa], kind) else isa
        if self.isa == -1 and kind in Q8_KINDS and self.q8_isa >= 0:
            return self.q8_isa  # against int8 activations (csrc/q8.c, csrc/q8avx2.c)
        return min(self.isa, ISAS.index("avx512bf16"))  # (-1: the best, which the kernel bounds likewise)

    def one_token_call(self, w: object, x_dtype: torch.dtype = torch.bfloat16
                       ) -> tuple[int, int, int, int, int] | None:
        """How one token of `x_dtype` (bf16, or float32) meets this matrix in one tk_linear call, as __call__ would
        make it: (address, rows, width, kind, variant); None where __call__ would not make one such call (no kernel,
        F.linear, or several matrices side by side). Rows may be more than the matrix has: a padded copy's
        (`padded`)."""
        if self.lib is None:
            return None
        if isinstance(w, QuantizedMatrix):
            rows, width = w.data.shape[0], w.cols
            if w.kind not in BLOCK_KINDS or rows % 32 or width % 32 or not w.data.is_contiguous():
                return None
            return w.data.data_ptr(), rows, width, KINDS[w.kind], self._block_isa(w.kind, x_dtype)
        if isinstance(w, torch.Tensor):
            w = self.padded(w)  # (its result's first rows are the matrix's)
        if (not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype not in KERNEL_FLOATS or not w.is_contiguous()
                or w.shape[0] == 0 or w.shape[0] % 32 or w.shape[1] % 32
                or (w.dtype != torch.bfloat16 and x_dtype != torch.float32)):
            return None
        isa = self.float_isa if x_dtype == torch.float32 else self.isa
        return w.data_ptr(), w.shape[0], w.shape[1], KINDS[w.dtype], isa

    def _kernel(self, x: torch.Tensor, n: int, w: int, rows: int, kind: int, isa: int, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        """One tk_linear call: x [..., I] (n <= AMX_CROSSOVER rows; of blocks, BLOCK_STEP) against the matrix at
        address w, [rows, I]."""
        width = x.shape[-1]
        key = (width, rows)
        if key not in self._buffers:  # per matrix shape, reused: no allocation on the decode path
            t = max(AMX_CROSSOVER, BLOCK_STEP)
            self._buffers[key] = (torch.empty(t, width), torch.empty(t, rows),
                                  torch.empty(t, width + XB_EXTRA, dtype=torch.int16))
        xs, ys, xb = self._buffers[key]
        xs[:n].copy_(x.reshape(n, width))  # [n, I] float32
        y = torch.empty(*x.shape[:-1], rows, dtype=out_dtype)  # [..., O]
        a = self._args
        a.tokens, a.inp, a.out, a.threads, a.isa, a.kind = n, width, rows, self.threads, isa, kind
        a.w, a.x, a.xb = w, xs.data_ptr(), xb.data_ptr()
        if out_dtype == torch.float32:  # the kernel's sums as they are
            a.y, a.yb = y.data_ptr(), None
        else:  # bf16, rounded by the kernel
            a.y, a.yb = ys.data_ptr(), y.data_ptr()
        code = self.lib.tk_linear(ctypes.byref(a))
        if code != 0:
            raise RuntimeError(f"dense kernel rejected its arguments (code {code})")
        return y if bias is None else y.add_(bias.to(y.dtype))


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of bf16 or float32 x [..., n] (the residual stream) with a bf16 weight [n] in one kernel call: a bf16
    result, rounded where the reference rounds (`runtime.model.rms_norm`). Needs the compiled kernels (`library()`
    is not None)."""
    lib = library()
    if (lib is None or x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != torch.bfloat16
            or x.device.type != "cpu" or not weight.is_contiguous()):  # (checks only: several times per layer)
        raise ValueError("rms_norm_bf16 takes bf16 or float32 CPU tensors with a contiguous bf16 weight and needs the "
                         "compiled kernels")
    n = x.shape[-1] if x.dim() else 0
    if weight.shape != (n,) or n == 0:
        raise ValueError(f"the norm's weight has shape {list(weight.shape)}; x [..., {n}] needs [{n}]")
    if not (isinstance(eps, int | float) and not isinstance(eps, bool) and 0 < eps < 1):
        raise ValueError(f"eps must be a number above 0 and below 1, not {eps!r}")
    rows = x.numel() // n
    flat = x.reshape(rows, n)  # a view when the rows are evenly spaced (q or k out of the stacked projection)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    norm = lib.tk_rms_norm_f32 if x.dtype == torch.float32 else lib.tk_rms_norm_bf16
    norm(flat.data_ptr(), flat.stride(0) if rows > 1 else n, weight.data_ptr(), y.data_ptr(), rows, n, eps)
    return y


def lookup_rows(m: QuantizedMatrix, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [...] of a matrix of GGUF blocks (an embedding) as float32 [..., cols], exactly as
    kernels.blocks.dequantize gives them: one kernel call (torch ops where the kernels are not built)."""
    lib = library()
    flat = ids.reshape(-1).to(torch.int64).contiguous()  # [n]
    if lib is None or m.kind not in BLOCK_KINDS or not m.data.is_contiguous():
        from tandem.kernels.blocks import dequantize

        return dequantize(m.data[flat], m.kind).view(*ids.shape, -1)
    out = torch.empty(flat.numel(), m.cols)  # [n, cols]
    code = lib.tk_dequantize_rows(KINDS[m.kind], m.data.data_ptr(), m.data.shape[0], flat.data_ptr(), flat.numel(),
                                  m.cols, out.data_ptr())
    if code == -2:
        raise ValueError(f"token ids must be from 0 to {m.data.shape[0] - 1}")
    if code != 0:
        raise ValueError(f"{m.kind} rows of {m.cols} values are not whole blocks")
    return out.view(*ids.shape, m.cols)
