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
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels.choice import (
    AMX_CROSSOVER,
    AMX_KINDS,
    BF16_ONLY,
    BLOCK_STEP,
    DEFAULT_CROSSOVER,
    QUANT_KINDS,
    QUANTIZED,
    TILED_CALL,
    TILED_UP_TO,
    WEIGHT_DTYPES,
    best_isa,
    check_support,
    quant_chunks,
    torch_path_quant,
)
from tandem.kernels.errors import KernelError
from tandem.kernels.library import (
    ACT_CLAMPED,
    ACT_GELU_TANH,
    ACT_SILU,
    AMX_BATCH,
    BLOCK_KINDS,
    KINDS,
    XB_EXTRA,
    Args,
    MoeArgs,
    Weights,
    available_isas,
    check_expert_code,
    check_matrix,
    check_rows,
    check_size,
    check_threads,
    library,
)
from tandem.kernels.names import BLOCK_QUANTS, ISAS, Isa, Quant
from tandem.kernels.quant import MX_BLOCK, QuantizedMatrix, quantize_int4, quantize_int8, quantize_mxfp4


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
        return CpuExecutor(hidden, inter, compute_dtype, self)

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


def glu(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """An expert's gate activation times its up projection: silu(gate) * up (SwiGLU), or, `act` "gelu_tanh", GELU
    with tanh's approximation (Gemma's GeGLU, transformers' gelu_pytorch_tanh)."""
    if act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


@dataclass(frozen=True)
class Epilogue:
    """What an expert adds around its three products (gpt-oss): biases of gate and up (before the activation) and of
    down (after it), float32; and the clamped SwiGLU's (alpha, limit), or None for plain SwiGLU; or the gate's
    activation (`act`, `glu`: Gemma's GeGLU)."""

    gate_bias: torch.Tensor | None = None  # [I]
    up_bias: torch.Tensor | None = None  # [I]
    down_bias: torch.Tensor | None = None  # [H]
    clamped: tuple[float, float] | None = None
    act: str = "silu"

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
        h = glu(g, u, self.act) if self.clamped is None else clamped_glu(g, u, *self.clamped)
        return F.linear(h, down, bias(self.down_bias))

    def fill(self, a: Args | Weights) -> None:
        """The biases' addresses (and, for `Args`, the activation) into a kernel argument structure."""
        a.gate_bias, a.up_bias, a.down_bias = (None if b is None else b.data_ptr()
                                               for b in (self.gate_bias, self.up_bias, self.down_bias))
        if isinstance(a, Args):
            a.act_kind = ACT_CLAMPED if self.clamped is not None else ACT_GELU_TANH if self.act == "gelu_tanh" \
                else ACT_SILU
            a.alpha, a.limit = self.clamped or (0.0, 0.0)


NO_EPILOGUE = Epilogue()
GELU_EPILOGUE = Epilogue(act="gelu_tanh")  # nothing added; the gate through GELU (Gemma)


def epilogue_for(act: str) -> Epilogue:
    """The epilogue of a plain expert (no biases) whose gate goes through `act`."""
    return GELU_EPILOGUE if act == "gelu_tanh" else NO_EPILOGUE


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

    def pointers(self) -> Weights:
        """The kernel's view of this expert: its weight (and scale) addresses."""
        mats = (self.gate, self.up, self.down)
        if isinstance(self.gate, QuantizedMatrix):
            w = Weights(*(m.data.data_ptr() for m in mats), *(m.scales.data_ptr() for m in mats))  # type: ignore
        else:
            w = Weights(*(m.data_ptr() for m in mats))  # type: ignore[union-attr]
        self.epilogue.fill(w)
        return w


@dataclass(frozen=True)
class LayerExperts:
    """All experts of one MoE layer for `CpuExecutor.run_layer`: the kernel's table of their weight pointers
    (valid while `experts` holds the weights)."""

    experts: list[CpuExpert]
    table: ctypes.Array[Weights]


class CpuExecutor:
    """Runs CPU experts with preallocated buffers and an explicit thread count.

    `options` as `CpuOptions` says them: its `isa` forces a kernel variant (e.g. "avx2" to test the fallback on a
    newer CPU), None picks the best; its `quant` quantizes each expert prepared (a GGUF block format's experts arrive
    quantized: `prepare_quantized`). The tensor returned by `run` is valid until the next call (it is a view of a
    reused buffer)."""

    def __init__(self, hidden: int, inter: int, compute_dtype: torch.dtype, options: CpuOptions = CpuOptions()
                 ) -> None:
        threads, crossover, group, isa = options.threads, options.crossover, options.group, options.isa
        quant = None if options.quant in BLOCK_QUANTS else options.quant
        self.hidden, self.inter = check_size("hidden size", hidden), check_size("expert width", inter)
        check_support(hidden, inter, compute_dtype, quant, group)
        if crossover is not None and not (isinstance(crossover, int) and crossover >= 0):
            raise ValueError(f"crossover must be a whole number of tokens, at least 0 (torch only), not {crossover!r}")
        self.dtype = compute_dtype
        self.threads = check_threads(torch.get_num_threads() if threads is None else threads)
        self.quant, self.group = quant, group
        self.lib = library() if options.use_kernel else None
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
        self._batch = (Args * 0)()
        self._moe: MoeArgs | None = None  # run_layer's arguments
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
            check_matrix(name, w, shape)
        if reference is not None:
            if self.quant is not None:
                raise KernelError(torch_path_quant(self.quant))
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
        check_rows("x", x, self.hidden)
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
            check_rows("x", x, self.hidden)
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
            self._batch = (Args * len(self._slots))()
        for k, i in enumerate(together):
            expert, x = jobs[i]
            self._slots[k].fill(self._batch[k], self, expert, x, isas[i])  # type: ignore[arg-type]
        code = self.lib.tk_experts(self._batch, len(together))  # type: ignore[union-attr]
        check_expert_code(code)
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
        return LayerExperts(experts, (Weights * len(experts))(*(e.pointers() for e in experts)))

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

    def moe_args(self, layer: LayerExperts, tokens: int, into: MoeArgs | None = None) -> MoeArgs:
        """A tk_moe call's arguments for `tokens` tokens of this layer, all but the routing, x and out: the ones
        run_layer reuses, or `into`. One arena serves every call (they run one at a time)."""
        expert = layer.experts[0]
        chunk = max(1, self._chunk(expert))
        if self._moe is None or self._moe.chunk < chunk:
            slots = min(len(layer.experts), AMX_BATCH)
            per_slot = self.lib.tk_moe_slot_bytes(self.hidden, self.inter, chunk)  # type: ignore[union-attr]
            self._arenas.append(torch.empty(slots * per_slot, dtype=torch.uint8))
            self._moe = MoeArgs(slots=slots, chunk=chunk, arena=self._arenas[-1].data_ptr())
        a = self._moe
        if into is not None:
            into.slots, into.chunk, into.arena = a.slots, a.chunk, a.arena
            a = into
        kind = KINDS[expert.kind]
        isa = ISAS.index(self.isa_for(expert, min(tokens, chunk)))  # type: ignore[arg-type]
        down_kind = KINDS[expert.down_kind]
        if (a.proto.kind, a.proto.down_kind, a.proto.isa, a.proto.hidden) != (kind, down_kind, isa, self.hidden):
            a.proto = Args(kind, isa, 0, self.hidden, self.inter, self.threads, self.group)
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
        check_rows("x", x, self.hidden)
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
        check_expert_code(code)
        return out

    def _run_kernel(self, expert: CpuExpert, x: torch.Tensor, isa: str, slot: _Slot | None = None) -> torch.Tensor:
        if slot is None:
            if not self._slots:
                self._slots.append(_Slot(self.hidden, self.inter, max(self.crossover, BLOCK_STEP)))
            slot = self._slots[0]
        slot.fill(slot.args, self, expert, x, isa)
        code = self.lib.tk_expert(ctypes.byref(slot.args))  # type: ignore[union-attr]
        check_expert_code(code)
        return slot.out[: x.shape[0]]


class _Slot:
    """Preallocated buffers for one expert of a kernel call: input, output, activation scratch, packed input."""

    def __init__(self, hidden: int, inter: int, crossover: int) -> None:
        t = max(1, crossover)
        self.x = torch.empty(t, hidden, dtype=torch.float32)
        self.out = torch.empty(t, hidden, dtype=torch.float32)
        self.act = torch.empty(t, 2 * inter, dtype=torch.float32)
        self.xb = torch.empty(max(t, 16), max(hidden, inter) + XB_EXTRA, dtype=torch.int16)
        self.args = Args()

    def fill(self, a: Args, ex: CpuExecutor, expert: CpuExpert, x: torch.Tensor, isa: str) -> None:
        n = x.shape[0]
        self.x[:n].copy_(x)  # float32, contiguous
        a.kind, a.down_kind, a.isa, a.tokens = KINDS[expert.kind], KINDS[expert.down_kind], ISAS.index(isa), n
        a.hidden, a.inter, a.threads, a.group = ex.hidden, ex.inter, ex.threads, ex.group
        w = expert.pointers()
        a.gate, a.up, a.down, a.gate_scale, a.up_scale, a.down_scale = (
            w.gate, w.up, w.down, w.gate_scale, w.up_scale, w.down_scale)
        a.x, a.out, a.act, a.xb = self.x.data_ptr(), self.out.data_ptr(), self.act.data_ptr(), self.xb.data_ptr()
        expert.epilogue.fill(a)

