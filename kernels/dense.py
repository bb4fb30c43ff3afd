"""Dense matrices and norms on the kernels: attention's projections, the routers and the lm_head (`DenseLinear`, any
token count, float or GGUF blocks, torch past the kernel's crossover), RMSNorm in bf16 and float32, and rows of a
quantized embedding table.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from tandem.kernels.choice import AMX_CROSSOVER, BF16_ONLY, BLOCK_STEP, FLOAT_CHUNKS, int8_only, quant_chunks
from tandem.kernels.errors import KernelError
from tandem.kernels.library import (
    BLOCK_KINDS,
    KINDS,
    Q8_KINDS,
    XB_EXTRA,
    LinearArgs,
    available_isas,
    check_threads,
    library,
)
from tandem.kernels.matmul import linear as torch_linear
from tandem.kernels.names import ISAS
from tandem.kernels.quant import QuantizedMatrix

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
        self._args = LinearArgs()
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
        if self.lib is not None and w.shape[0] % 32 and w.shape[0] > 32 and x.device.type == "cpu":
            return self._split(x, w, bias, out_dtype)
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
        if self.lib is not None and rows % 32 and rows > 32 and x.device.type == "cpu":
            return self._split(x, w, bias, out_dtype)
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

    def _split(self, x: torch.Tensor, w: torch.Tensor | QuantizedMatrix, bias: torch.Tensor | None,
               out_dtype: torch.dtype) -> torch.Tensor:
        """A matrix whose rows are not whole groups of 32 and too large to pad (an lm_head of 49,155 or 128,167
        tokens: Granite's, HunYuan's): its whole groups through the kernel, the last few rows through torch. Each
        row's sums are its own, so the result is the kernel's for those rows; torch over the whole matrix instead
        converted all of it to float32 on every call (a 2-layer Granite shape decoded at 8 tokens/s)."""
        rows = w.data.shape[0] if isinstance(w, QuantizedMatrix) else w.shape[0]
        k = rows // 32 * 32
        if isinstance(w, QuantizedMatrix):
            head = replace(w, data=w.data[:k])
            tail: torch.Tensor = replace(w, data=w.data[k:]).dequantize(x.dtype)
        else:
            head, tail = w[:k], w[k:]
        y = torch.cat([self(x, head, None, out_dtype), torch_linear(x, tail, None, out_dtype)], dim=-1)  # [..., O]
        return y if bias is None else y.add_(bias.to(y.dtype))

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
