"""What a layer kind is: the two halves of a decoder layer as the decoder sees them (`Mixer`, `FeedForward`), and what
a kind loads its weights with (`Loaders`). The kinds themselves live one to a module (runtime/attention.py,
runtime/mla.py, runtime/moe.py) and are found by name in runtime/layers.py; this module imports none of them, so
that each can name these types.

Letters: B batch, T new tokens, N a ragged pass's tokens, H hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from tandem.runtime.attention import Matrix
    from tandem.runtime.config import ModelConfig
    from tandem.runtime.families import FamilySpec
    from tandem.runtime.model import MoEModel, Segment
    from tandem.runtime.moe import ExpertWeights

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Loaders:
    """How runtime/build.py places a checkpoint's non-expert tensors, handed to each kind's `load`: `w` a weight (on
    the accelerator, or in RAM in the dtype it is kept in), `wq` a dense matrix (GGUF blocks kept as stored where the
    kernels read them), `opt` a weight the file may lack (None), `projections` several matrices as one (q, k and v),
    `stacked` several tensors along dim 0 (a missing bias as zeros), `f32` a weight in float32 whatever the compute
    dtype, `mlp` a SwiGLU's gate, up and down under a prefix as one expert, `norm` an RMSNorm's weight as it
    multiplies (the stored one plus ModelConfig.norm_offset; None where the file lacks it)."""

    spec: FamilySpec
    w: Callable[[str], torch.Tensor]
    wq: Callable[[str], Matrix]
    opt: Callable[[str], torch.Tensor | None]
    projections: Callable[[list[str], list[int]], Matrix]
    stacked: Callable[[list[str], list[int]], torch.Tensor]
    f32: Callable[[str], torch.Tensor]
    mlp: Callable[[str], ExpertWeights]
    norm: Callable[[str], torch.Tensor | None]


class Mixer(Protocol):
    """A token mixer: the half of a layer that lets a token see the others (attention and its variants), with the
    cache it keeps between passes."""

    name: str  # its name in ModelConfig.mixers and runtime/layers.py MIXERS
    module: str  # its tensors' module inside a layer (`self_attn`, `linear_attn`)
    cache: type  # the cache its layers keep (`KVCache`, `LatentCache`, a recurrent `state.StateCache`):
    # constructed (cfg, batch, context, dtype, accel, layers), with `nbytes`, `row`, `copy_rows`, `snapshot` and
    # `restore` (runtime/prefix.py asks these); a model whose mixers keep several kinds keeps a `state.LayerCaches`
    host_cache: bool  # its cache can be kept in RAM beside an accelerator, attention on the CPU (MoEModel.with_batch)

    def tensors(self, cfg: ModelConfig, spec: FamilySpec | None, layer: int, prefix: str) -> dict[str, Shape]:
        """Its tensors in layer `layer`, under `prefix` (`model.layers.N.self_attn`), named as `spec`'s family names
        them (None: the usual names, for their shapes alone), with their shapes."""
        ...

    def load(self, cfg: ModelConfig, layer: int, prefix: str, load: Loaders) -> Any:
        """Layer `layer`'s weights (under `prefix`), placed by `load`."""
        ...

    def step_refusal(self, cfg: ModelConfig) -> str | None:
        """Why the one-call decode step (runtime/decode_step.py) cannot run it; None: it can."""
        ...

    def forward(self, model: MoEModel, i: int, weights: Any, x: torch.Tensor, start: int, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """Layer i for B sequences in cache rows 0..B-1, all at positions start..: the normed x [B, T, H] -> its
        output [B, T, H] float32 (into the residual stream, unrounded); cos and sin are those positions' RoPE rows."""
        ...

    def forward_rows(self, model: MoEModel, i: int, weights: Any, x: torch.Tensor, segments: list[Segment],
                     rows: list[Any], spans: list[int]) -> torch.Tensor:
        """Layer i over a ragged pass (MoEModel.forward_rows): x [1, N, H], each segment in its cache row `rows[j]`
        over tokens spans[j]..spans[j+1] -> [1, N, H] float32."""
        ...


class FeedForward(Protocol):
    """The other half of a layer: what each token goes through on its own."""

    name: str  # its name in runtime/layers.py FEED_FORWARDS
    routed: bool  # its experts run through the dispatcher (MoEModel.dispatcher), which may queue them on an
    # accelerator while the host goes on (its weights are then a `MoEBlockWeights`)

    def start(self, model: MoEModel, i: int, weights: Any, x: torch.Tensor, h: torch.Tensor) -> Any:
        """Layer i's first half over the residual stream x [n, H] and its norm h [n, H]: a routed layer's experts
        queued (not waited for: a pipelined pass runs another micro-batch's attention meanwhile)."""
        ...

    def finish(self, model: MoEModel, weights: Any, started: Any) -> torch.Tensor:
        """What `start` began, finished: the layer's output [n, H] into the residual stream."""
        ...

    def load(self, cfg: ModelConfig, i: int, load: Loaders) -> Any:
        """Layer i's weights, placed by `load` (a routed layer's experts come later: runtime/build.py reads them
        last)."""
        ...

    def step_refusal(self, weights: Any) -> str | None:
        """Why the one-call decode step cannot run this layer's weights; None: it can."""
        ...
