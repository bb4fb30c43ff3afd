"""The kernels' Python API refuses what C cannot serve: wrong shapes, dtypes, strides and thread counts end in a
Python exception (never a crash or a read past a tensor's end), and odd strides give right answers."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.kernels.choice import AMX_CROSSOVER
from tandem.kernels.dense import DenseLinear, rms_norm_bf16
from tandem.kernels.experts import CpuExecutor, CpuOptions
from tandem.kernels.library import available_isas, library, read_bandwidth_probe
from tandem.kernels.names import ISAS
from tandem.runtime.moe import ExpertWeights

MISSING = next((i for i in ISAS if i not in available_isas()), None)  # a variant this CPU (as masked) lacks
needs_kernels = pytest.mark.skipif(library() is None, reason="the compiled kernels are not built on this machine")
H, I = 64, 96  # noqa: E741 (the letters of the shape comments)


def weights(dtype: torch.dtype = torch.bfloat16, h: int = H, i: int = I) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple((torch.randn(s, generator=g) * 0.05).to(dtype) for s in ((i, h), (i, h), (h, i)))


def executor(**kw) -> CpuExecutor:
    return CpuExecutor(H, I, torch.float32, CpuOptions(threads=kw.pop("threads", 2), **kw))


# -- the executor's own settings ------------------------------------------------------------------------------------
BAD_EXECUTORS: dict[str, Callable[[], object]] = {
    "hidden 0": lambda: CpuExecutor(0, I, torch.float32),
    "hidden -1": lambda: CpuExecutor(-1, I, torch.float32),
    "expert width 0": lambda: CpuExecutor(H, 0, torch.float32),
    "width not a whole number": lambda: CpuExecutor(H, 9.5, torch.float32),  # type: ignore[arg-type]
    "threads -1": lambda: executor(threads=-1),
    "threads 0": lambda: executor(threads=0),
    "threads 10**6": lambda: executor(threads=10**6),
    "threads 2.0": lambda: executor(threads=2.0),
    "compute float64": lambda: CpuExecutor(H, I, torch.float64),
    "compute int32": lambda: CpuExecutor(H, I, torch.int32),
    "quant int3": lambda: executor(quant="int3"),
    "int4 group 48": lambda: executor(quant="int4", group=48),
    "int4 group not dividing": lambda: CpuExecutor(H, 96, torch.float32, CpuOptions(quant="int4", group=128)),
    "crossover 2.5": lambda: executor(crossover=2.5),
    "crossover -5": lambda: executor(crossover=-5),
    "unknown variant": lambda: executor(isa="sse9"),
}


@pytest.mark.parametrize("case", BAD_EXECUTORS)
def test_bad_executor_settings_are_refused(case: str) -> None:
    with pytest.raises(ValueError):
        BAD_EXECUTORS[case]()


# -- weights handed to prepare ----------------------------------------------------------------------------------------
def _swap(i: int, w: torch.Tensor) -> Callable[[], object]:
    def run() -> object:
        mats = list(weights())
        mats[i] = w
        return executor().prepare(*mats)
    return run


BAD_WEIGHTS: dict[str, Callable[[], object]] = {
    "gate one row too many": _swap(0, torch.zeros(I + 1, H, dtype=torch.bfloat16)),
    "up too narrow": _swap(1, torch.zeros(I, H - 1, dtype=torch.bfloat16)),
    "down transposed": _swap(2, torch.zeros(I, H, dtype=torch.bfloat16)),
    "gate 1-D": _swap(0, torch.zeros(I * H, dtype=torch.bfloat16)),
    "down 3-D": _swap(2, torch.zeros(1, H, I, dtype=torch.bfloat16)),
    "up float32 beside bf16": _swap(1, torch.zeros(I, H)),
    "gate float32 beside bf16": _swap(0, torch.zeros(I, H)),
    "float64 expert": lambda: executor().prepare(*weights(torch.float64)),
    "int8 tensors": lambda: executor().prepare(*(w.to(torch.int8) for w in weights())),
    "float8 expert": lambda: executor().prepare(*weights(torch.float8_e4m3fn)),
    "not a tensor": _swap(0, [[0.0] * H] * I),  # type: ignore[arg-type]
    "quantized, wrong shape": lambda: executor(quant="int8").prepare(*weights(h=H + 32)),
    "meta device": _swap(2, torch.zeros(H, I, dtype=torch.bfloat16, device="meta")),
}


@pytest.mark.parametrize("case", BAD_WEIGHTS)
def test_bad_weights_are_refused(case: str) -> None:
    with pytest.raises((ValueError, TypeError)):
        BAD_WEIGHTS[case]()


# -- activations and experts handed to run / run_many / run_layer ---------------------------------------------------
def _run(x: torch.Tensor, **kw) -> Callable[[], object]:
    def run() -> object:
        ex = executor(**kw)
        return ex.run(ex.prepare(*weights()), x)
    return run


def _foreign_expert() -> object:
    other = CpuExecutor(H, I + 32, torch.float32, CpuOptions(threads=2)).prepare(*weights(i=I + 32))
    return executor().run(other, torch.zeros(1, H))


def _run_many(x: torch.Tensor) -> object:
    ex = executor()
    e = ex.prepare(*weights())
    return ex.run_many([(e, torch.zeros(1, H)), (e, x)], lambda i, y: None)


def _layer(*dtypes: torch.dtype) -> object:
    ex = executor()
    return ex.layer([ex.prepare(*weights(d)) for d in dtypes])


def _run_layer(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
    def run() -> object:
        ex = executor()
        layer = ex.layer([ex.prepare(*weights()) for _ in range(4)])
        return ex.run_layer(layer, x, ids, w)
    return run


ids2, w2 = torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]])
BAD_CALLS: dict[str, Callable[[], object]] = {
    "x too wide": _run(torch.zeros(1, H + 1)),
    "x too narrow": _run(torch.zeros(2, H - 32)),
    "x 1-D": _run(torch.zeros(H)),
    "x 3-D": _run(torch.zeros(1, 1, H)),
    "x float64": _run(torch.zeros(1, H, dtype=torch.float64)),
    "x int64": _run(torch.zeros(1, H, dtype=torch.int64)),
    "expert of another size": _foreign_expert,
    "run_many, one job too wide": lambda: _run_many(torch.zeros(1, H + 8)),
    "layer with no experts": lambda: executor().layer([]),
    "layer of float32 and bf16 experts": lambda: _layer(torch.float32, torch.bfloat16),
    "layer of bf16 and float32 experts": lambda: _layer(torch.bfloat16, torch.float32, torch.float32),
    "layer of fp16 and bf16 experts": lambda: _layer(torch.float16, torch.bfloat16),
    "run_layer, expert id out of range": _run_layer(torch.zeros(1, H), torch.tensor([[0, 9]]), w2),
    "run_layer, negative expert id": _run_layer(torch.zeros(1, H), torch.tensor([[-1, 0]]), w2),
    "run_layer, x too wide": _run_layer(torch.zeros(1, H + 32), ids2, w2),
    "run_layer, more rows than routings": _run_layer(torch.zeros(2, H), ids2, w2),
    "run_layer, weights of another shape": _run_layer(torch.zeros(1, H), ids2, torch.tensor([[1.0]])),
    "run_layer, ids 1-D": _run_layer(torch.zeros(1, H), torch.tensor([0, 1]), torch.tensor([0.5, 0.5])),
    "run_layer, too many tokens": _run_layer(torch.zeros(AMX_CROSSOVER + 1, H),
                                             torch.zeros(AMX_CROSSOVER + 1, 2, dtype=torch.int64),
                                             torch.ones(AMX_CROSSOVER + 1, 2)),
    "run_layer, no tokens": _run_layer(torch.zeros(0, H), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)),
    "run_layer, no experts per token": _run_layer(torch.zeros(1, H), torch.zeros(1, 0, dtype=torch.int64),
                                                  torch.zeros(1, 0)),
    "run_layer, one expert for 3 tokens x 64": _run_layer(torch.zeros(3, H), torch.zeros(3, 64, dtype=torch.int64),
                                                          torch.ones(3, 64)),
}


@needs_kernels
@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_are_refused(case: str) -> None:
    with pytest.raises((ValueError, TypeError)):
        BAD_CALLS[case]()


# -- dense matrices, norms, the bandwidth probe ------------------------------------------------------------------------
w64 = torch.zeros(64, 64, dtype=torch.bfloat16)
BAD_DENSE: dict[str, Callable[[], object]] = {
    "x wider than the matrix": lambda: DenseLinear(2)(torch.zeros(1, 96, dtype=torch.bfloat16), w64),
    "x narrower than the matrix": lambda: DenseLinear(2)(torch.zeros(1, 32, dtype=torch.bfloat16), w64),
    "float32 x narrower": lambda: DenseLinear(2)(torch.zeros(3, 32), w64),
    "matrix 1-D": lambda: DenseLinear(2)(torch.zeros(1, 64, dtype=torch.bfloat16), w64.flatten()),
    "matrix 3-D": lambda: DenseLinear(2)(torch.zeros(1, 64, dtype=torch.bfloat16), w64[None]),
    "x 0-D": lambda: DenseLinear(2)(torch.tensor(1.0), w64),
    "bias too short": lambda: DenseLinear(2)(torch.zeros(1, 64, dtype=torch.bfloat16), w64, torch.zeros(32)),
    "float64 results": lambda: DenseLinear(2)(torch.zeros(1, 64, dtype=torch.bfloat16), w64, out_dtype=torch.float64),
    "threads -3": lambda: DenseLinear(-3),
    "threads 0": lambda: DenseLinear(0),
    "unknown variant": lambda: DenseLinear(2, isa="neon"),
    "a variant this CPU lacks": lambda: DenseLinear(2, isa=MISSING or "neon"),
    "norm weight too short": lambda: rms_norm_bf16(torch.zeros(2, 64), torch.ones(63, dtype=torch.bfloat16), 1e-6),
    "norm weight too long": lambda: rms_norm_bf16(torch.zeros(2, 64), torch.ones(65, dtype=torch.bfloat16), 1e-6),
    "norm weight 2-D": lambda: rms_norm_bf16(torch.zeros(2, 64), torch.ones(1, 64, dtype=torch.bfloat16), 1e-6),
    "norm weight float32": lambda: rms_norm_bf16(torch.zeros(2, 64), torch.ones(64), 1e-6),
    "norm eps NaN": lambda: rms_norm_bf16(torch.zeros(2, 64), torch.ones(64, dtype=torch.bfloat16), float("nan")),
    "norm eps 10**400": lambda: rms_norm_bf16(torch.zeros(2, 64), torch.ones(64, dtype=torch.bfloat16), 10**400),
    "norm eps -1": lambda: rms_norm_bf16(torch.zeros(2, 64), torch.ones(64, dtype=torch.bfloat16), -1.0),
    "norm of x float64": lambda: rms_norm_bf16(torch.zeros(2, 64, dtype=torch.float64),
                                               torch.ones(64, dtype=torch.bfloat16), 1e-6),
    "probe threads -1": lambda: read_bandwidth_probe(torch.zeros(1024), -1),
    "probe threads 0": lambda: read_bandwidth_probe(torch.zeros(1024), 0),
    "probe of bf16": lambda: read_bandwidth_probe(torch.zeros(1024, dtype=torch.bfloat16), 2),
    "probe of a strided buffer": lambda: read_bandwidth_probe(torch.zeros(2048)[::2], 2),
    "probe of 3 streams": lambda: read_bandwidth_probe(torch.zeros(1024), 2, 3),
}


@needs_kernels
@pytest.mark.parametrize("case", BAD_DENSE)
def test_bad_dense_and_norm_calls_are_refused(case: str) -> None:
    with pytest.raises((ValueError, TypeError)):
        BAD_DENSE[case]()


# -- odd strides are taken, and give the right answer ----------------------------------------------------------------
@needs_kernels
def test_strided_inputs_give_the_reference_answer() -> None:
    gate, up, down = weights(torch.bfloat16)
    ex = executor()
    # weights handed over as transposed views of transposed copies (not contiguous): prepare makes them so
    expert = ex.prepare(gate.t().contiguous().t(), up.t().contiguous().t(), down.t().contiguous().t())
    wide = torch.randn(3, 2 * H)
    x = wide[:, ::2]  # [3, H], every other column
    want = ExpertWeights(gate.float(), up.float(), down.float())(x.contiguous())
    torch.testing.assert_close(expert(x).float(), want, rtol=1e-4, atol=1e-5)

    lin = DenseLinear(2)
    xs = torch.randn(2, 128, dtype=torch.bfloat16)[:, ::2]  # [2, 64] with stride 2
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(lin(xs, w, out_dtype=torch.float32), xs.float() @ w.float().t(), rtol=1e-4, atol=1e-3)

    norm_w = torch.rand(64, dtype=torch.bfloat16) + 0.5
    rows = torch.randn(4, 128)[:, 64:]  # rows 128 apart
    y = rms_norm_bf16(rows, norm_w, 1e-6)
    ref = (rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.float()).to(torch.bfloat16)
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-2)


@needs_kernels
def test_a_good_call_after_a_refused_one_still_works() -> None:
    ex = executor()
    expert = ex.prepare(*weights())
    with pytest.raises(ValueError):
        ex.run(expert, torch.zeros(1, H + 1))
    x = torch.randn(2, H)
    want = ExpertWeights(*(w.float() for w in weights()))(x)
    torch.testing.assert_close(ex.run(expert, x).float(), want, rtol=1e-4, atol=1e-5)


@needs_kernels
def test_edge_cases_that_are_not_errors() -> None:
    # crossover 0: torch for every token count
    ex = executor(crossover=0)
    gate, up, down = weights(torch.float32)
    x = torch.randn(3, H)
    torch.testing.assert_close(ex.run(ex.prepare(gate, up, down), x), ExpertWeights(gate, up, down)(x))
    # a matrix with no rows gives no columns; a bias in another dtype gives a result in the dtype asked for
    lin = DenseLinear(2)
    assert lin(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(0, 64, dtype=torch.bfloat16)).shape == (2, 0)
    w, b = torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.float64)
    xb = torch.randn(1, 64, dtype=torch.bfloat16)
    y = lin(xb, w, b)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), xb.float() @ w.float().t() + b.float(), rtol=2e-2, atol=2e-2)
    assert lin(xb, w, b, out_dtype=torch.float32).dtype == torch.float32


@needs_kernels
def test_the_argument_structures_match_the_compiled_ones() -> None:
    from tandem.kernels.library import struct_sizes

    lib = library()
    sizes = struct_sizes(lib)
    assert len(sizes) == 9 and lib.tk_struct_size(9) == 0
    for struct, size in sizes:
        assert ctypes.sizeof(struct) == size > 0, struct.__name__


@needs_kernels
def test_every_argument_structure_of_the_headers_is_compared() -> None:
    """Each `tk_*` struct the C headers declare has its tk_struct_size number, and kernels/library.py a structure for
    each number: a struct added on one side only fails here, before a size can drift unchecked."""
    from tandem.kernels.library import struct_sizes

    csrc = Path(__file__).resolve().parents[1] / "kernels" / "csrc"
    declared = {name for h in csrc.glob("*.h") for name in re.findall(r"\}\s*(tk_\w+)\s*;", h.read_text())}
    numbered = dict(re.findall(r"case (\d+): return sizeof\((tk_\w+)\);", (csrc / "api.c").read_text()))
    assert {"tk_args", "tk_weights", "tk_moe_args", "tk_linear_args"} <= declared
    assert sorted(numbered.values()) == sorted(declared)
    assert sorted(int(i) for i in numbered) == list(range(len(declared)))
    lib = library()
    assert len(struct_sizes(lib)) == len(declared) and lib.tk_struct_size(len(declared)) == 0


@needs_kernels
def test_a_structure_that_drifted_is_refused_when_the_library_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    import tandem.kernels.library as kernel_library

    class Longer(ctypes.Structure):
        _fields_ = [*kernel_library.LinearArgs._fields_, ("extra", ctypes.c_void_p)]  # (an int would fit the padding)

    monkeypatch.setattr(kernel_library, "LinearArgs", Longer)
    library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="Longer.*rebuild"):
            library()
    finally:
        monkeypatch.undo()
        library.cache_clear()
        library()


def test_fp16_dense_products_go_through_torch() -> None:
    """fp16, an older GPU's compute dtype, which the kernels do not compute: torch's product, in fp16."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g).half(), torch.randn(32, 64, generator=g).half()
    y = DenseLinear(2)(x, w)
    assert y.dtype == torch.float16 and torch.equal(y, torch.nn.functional.linear(x, w))
