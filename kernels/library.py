"""The compiled kernels' C interface: the library loaded once (with the CPU feature mask applied), the argument
structures that mirror `csrc/common.h` (their sizes checked against the build's), the weight kinds by the numbers C
knows them by, and the argument checks every call passes before C sees it. `experts.py` and `dense.py` call it.
"""

from __future__ import annotations

import ctypes
import importlib.util
from functools import cache

import torch

from tandem.kernels.isa import masked_features
from tandem.kernels.names import ISAS

KINDS: dict[object, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, "int8": 3, "int4": 4, "mxfp4": 5}
# GGUF's block formats, by GGUF's names (kernels/blocks.py), rows as the file stores them (csrc/blocks.h)
BLOCK_KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
KINDS.update({name: 6 + i for i, name in enumerate(BLOCK_KINDS)})
# GGUF kinds whose products the AVX512_BF16 and AVX2 variants compute against int8 activations, as llama.cpp does
# (csrc/q8.c, csrc/q8avx2.c), where activations are bf16 anyway; float32 compute keeps the exact float path
# (csrc/blocks.h: on AVX-512, or else the base variant, since AVX2's blocks are the int8 path)
Q8_KINDS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
ACT_SILU, ACT_CLAMPED, ACT_GELU_TANH = 0, 1, 2  # the activations the kernels compute (csrc/common.h)
AMX_BATCH = 64  # experts one kernel region takes at most (csrc/common.h)
XB_EXTRA = 192  # 16-bit values a row of xb holds beyond its width: room for int8 inputs (csrc/common.h q8_stride)
MAX_THREADS = 4096  # a sanity bound: libgomp takes any positive count and allocates per thread


# Every argument is checked here, in Python, before C sees it: C trusts the sizes it is given, so a wrong shape
# would read past the end of a tensor or crash the process. These checks are a few attribute reads per call.
def check_threads(threads: object) -> int:
    """A thread count the kernels can take: a whole number from 1 to MAX_THREADS."""
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"thread count must be a whole number from 1 to {MAX_THREADS}, not {threads!r}")
    return threads


def check_size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive whole number, not {value!r}")
    return value


def check_matrix(name: str, w: torch.Tensor, shape: tuple[int, int]) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, not {type(w).__name__}")
    if w.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, not {w.device}")
    if tuple(w.shape) != shape:
        raise ValueError(f"{name} has shape {list(w.shape)}; this executor needs {list(shape)}")


def check_rows(name: str, x: torch.Tensor, width: int, most: int | None = None) -> None:
    """x [n, width], a float CPU tensor (at most `most` rows)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, not {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{name} has shape {list(x.shape)}; expected [tokens, {width}]")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.device.type != "cpu":
        raise ValueError(f"{name} must be a float32, bf16 or fp16 CPU tensor, not {x.dtype} on {x.device}")
    if most is not None and x.shape[0] > most:
        raise ValueError(f"{name} has {x.shape[0]} rows; this call takes at most {most}")


class Args(ctypes.Structure):
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


class Weights(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale",
                                                      "gate_bias", "up_bias", "down_bias")]


class MoeArgs(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.c_int), ("top_k", ctypes.c_int), ("experts", ctypes.c_int), ("slots", ctypes.c_int),
        ("chunk", ctypes.c_int), ("ids", ctypes.c_void_p), ("weights", ctypes.c_void_p), ("x", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("table", ctypes.c_void_p), ("arena", ctypes.c_void_p), ("proto", Args),
        ("x_bf16", ctypes.c_void_p),
    ]


class LinearArgs(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.c_int), ("inp", ctypes.c_int), ("out", ctypes.c_int), ("threads", ctypes.c_int),
        ("w", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("xb", ctypes.c_void_p),
        ("yb", ctypes.c_void_p), ("isa", ctypes.c_int), ("kind", ctypes.c_int),
    ]


class AttendArgs(ctypes.Structure):
    _fields_ = [
        ("batch", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("dim", ctypes.c_int),
        ("rot", ctypes.c_int), ("bf16", ctypes.c_int), ("threads", ctypes.c_int), ("isa", ctypes.c_int),
        ("start", ctypes.c_int), ("first", ctypes.c_int), ("ld_q", ctypes.c_longlong), ("ld_k", ctypes.c_longlong),
        ("ld_v", ctypes.c_longlong), ("context", ctypes.c_longlong), ("q", ctypes.c_void_p), ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("kcache", ctypes.c_void_p),
        ("vcache", ctypes.c_void_p), ("sinks", ctypes.c_void_p), ("scale", ctypes.c_float), ("out", ctypes.c_void_p),
        ("rows", ctypes.c_void_p), ("starts", ctypes.c_void_p), ("window", ctypes.c_int), ("chunk", ctypes.c_int),
    ]


_F = ctypes.c_void_p  # (a float32 buffer)


class DeltaNetArgs(ctypes.Structure):  # csrc/recur.c tk_deltanet_step
    _fields_ = [
        ("batch", ctypes.c_int), ("key_heads", ctypes.c_int), ("value_heads", ctypes.c_int), ("key_dim", ctypes.c_int),
        ("value_dim", ctypes.c_int), ("conv_k", ctypes.c_int), ("tiled", ctypes.c_int), ("threads", ctypes.c_int),
        ("isa", ctypes.c_int), ("eps", ctypes.c_float), ("ld_p", ctypes.c_longlong), ("p", _F), ("conv_w", _F),
        ("A", _F), ("dt_bias", _F), ("norm_w", _F), ("conv", _F), ("ssm", _F), ("work", _F), ("out", _F),
    ]


class SSMArgs(ctypes.Structure):  # csrc/recur.c tk_ssm_step
    _fields_ = [
        ("batch", ctypes.c_int), ("heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("state", ctypes.c_int),
        ("groups", ctypes.c_int), ("conv_k", ctypes.c_int), ("threads", ctypes.c_int), ("isa", ctypes.c_int),
        ("eps", ctypes.c_float), ("dt_min", ctypes.c_float), ("dt_max", ctypes.c_float), ("ld_p", ctypes.c_longlong),
        ("p", _F), ("conv_w", _F), ("conv_b", _F), ("A", _F), ("dt_bias", _F), ("D", _F), ("norm_w", _F),
        ("conv", _F), ("ssm", _F), ("work", _F), ("out", _F),
    ]


class ShortConvArgs(ctypes.Structure):  # csrc/recur.c tk_shortconv_step
    _fields_ = [
        ("batch", ctypes.c_int), ("hidden", ctypes.c_int), ("conv_k", ctypes.c_int), ("threads", ctypes.c_int),
        ("ld_p", ctypes.c_longlong), ("p", _F), ("conv_w", _F), ("conv_b", _F), ("conv", _F), ("out", _F),
    ]


class LayerArgs(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int), ("n_qkv", ctypes.c_int), ("qk_norm", ctypes.c_int), ("scoring", ctypes.c_int),
        ("normalize", ctypes.c_int), ("window", ctypes.c_int), ("eps", ctypes.c_float), ("scaling", ctypes.c_float),
        ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p), ("h", ctypes.c_void_p), ("hf", ctypes.c_void_p), ("qkv_out", ctypes.c_void_p),
        ("attend_out", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p), ("router_bias", ctypes.c_void_p),
        ("o_bias", ctypes.c_void_p), ("qkv", LinearArgs * 4), ("o", LinearArgs), ("router", LinearArgs),
        ("attend", AttendArgs), ("moe", MoeArgs), ("f32", ctypes.c_int), ("correction", ctypes.c_void_p),
        ("ffn", ctypes.c_int), ("mlp_inter", ctypes.c_int), ("mlp", LinearArgs * 3), ("mlp_gate", ctypes.c_void_p),
        ("mlp_up", ctypes.c_void_p), ("mlp_out", ctypes.c_void_p), ("mlp_h", ctypes.c_void_p),
        ("shared_gate", ctypes.c_void_p), ("residual", ctypes.c_float), ("qkv_rows", ctypes.c_int),
        ("attn_gate", ctypes.c_int), ("mixer", ctypes.c_int), ("n_proj", ctypes.c_int), ("proj_rows", ctypes.c_int),
        ("mix_inner", ctypes.c_int), ("proj", LinearArgs * 4), ("proj_bias", ctypes.c_void_p),
        ("mix_p", ctypes.c_void_p), ("mix_pf", ctypes.c_void_p), ("mix_out", ctypes.c_void_p),
        ("recur", ctypes.c_void_p),
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
    lib.tk_expert.argtypes = [ctypes.POINTER(Args)]
    lib.tk_expert.restype = ctypes.c_int
    lib.tk_experts.argtypes = [ctypes.POINTER(Args), ctypes.c_int]
    lib.tk_experts.restype = ctypes.c_int
    lib.tk_moe.argtypes = [ctypes.POINTER(MoeArgs)]
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
    lib.tk_linear.argtypes = [ctypes.POINTER(LinearArgs)]
    lib.tk_linear.restype = ctypes.c_int
    lib.tk_attend_one.argtypes = [ctypes.POINTER(AttendArgs)]
    lib.tk_attend_one.restype = ctypes.c_int
    lib.tk_decode_layers.argtypes = [ctypes.POINTER(LayerArgs), ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_void_p]
    lib.tk_decode_layers.restype = ctypes.c_int
    for name, args in (("deltanet", DeltaNetArgs), ("ssm", SSMArgs), ("shortconv", ShortConvArgs)):
        getattr(lib, f"tk_{name}_step").argtypes = [ctypes.POINTER(args)]
        getattr(lib, f"tk_{name}_step").restype = ctypes.c_int
    lib.tk_read_sum.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    lib.tk_read_sum.restype = ctypes.c_double
    lib.tk_struct_size.argtypes = [ctypes.c_int]
    lib.tk_struct_size.restype = ctypes.c_size_t
    drifted = [s.__name__ for s, c in struct_sizes(lib) if ctypes.sizeof(s) != c]
    if drifted:  # a stale build beside newer Python (or the reverse): calling it would corrupt memory
        raise RuntimeError(f"the compiled kernels disagree with kernels/library.py on {', '.join(drifted)}; rebuild "
                           "them (make, or pip install -e .)")
    return lib


def struct_sizes(lib: ctypes.CDLL) -> list[tuple[type[ctypes.Structure], int]]:
    """Each argument structure with the size the compiled library gives its C counterpart."""
    return [(s, lib.tk_struct_size(i))
            for i, s in enumerate((Args, Weights, MoeArgs, LinearArgs, AttendArgs, LayerArgs, DeltaNetArgs, SSMArgs,
                                   ShortConvArgs))]


def available_isas() -> list[str]:
    lib = library()
    if lib is None:
        return []
    mask = lib.tk_isa_mask()
    return [name for i, name in enumerate(ISAS) if mask & (1 << i)]


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


OUT_OF_MEMORY = -9  # a kernel's scratch could not be allocated (csrc/tiles.c)


def check_expert_code(code: int) -> None:
    if code == OUT_OF_MEMORY:
        raise MemoryError("the CPU expert kernel could not allocate its scratch: free some RAM, or use fewer threads")
    if code != 0:
        raise RuntimeError(f"CPU expert kernel rejected its arguments (code {code})")

